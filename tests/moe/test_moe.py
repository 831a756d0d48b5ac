"""The tiny MoE model, router replay and low-precision experts, applied from outside the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atelier.moe.metrics import expert_counts, load_balance, sampler_mismatch
from atelier.moe.precision import UnsupportedMoeModel, apply_moe_precision
from atelier.moe.replay import RouterReplay, RouterReplayError, pack_routes, unpack_routes
from tests.moe.conftest import sample_with_cache, tiny_moe, trainer_logprobs


def test_pack_routes_is_compact_and_round_trips():
    ids = torch.tensor([[[0, 7], [3, 1]], [[-1, -1], [5, 2]]])
    packed = pack_routes(ids, num_experts=8)
    assert packed.dtype == np.uint8 and packed[1, 0, 0] == 255
    assert torch.equal(unpack_routes(packed), ids)
    assert pack_routes(ids, num_experts=300).dtype == np.uint16


# Mixtral: slow here; the engine-based test (test_sampler_routes.py) checks the same on the tiny Mixtral.
@pytest.mark.parametrize("arch", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen3_moe"])
def test_replay_uses_exactly_the_samplers_experts_and_reproduces_its_logprobs(arch):
    model = tiny_moe(arch=arch)
    prompt = list(range(10, 30))
    ids, mu, routes = sample_with_cache(model, prompt, n_new=12)
    assert routes.shape == (len(ids), 2, 2)
    replay = RouterReplay(model)
    with torch.no_grad(), replay.replay(pack_routes(routes, 8)):
        logp = trainer_logprobs(model, ids, 12)
    used = replay.used()
    assert torch.equal(used[:-1], routes[:-1])
    assert float((logp - torch.tensor(mu)).abs().max()) < 1e-4


@pytest.mark.slow   # the RL run test checks routes_match_frac == 1 with replay in atelier train
def test_replay_forces_the_samplers_routes_where_the_trainer_would_route_otherwise():
    # a bf16 sampler and an fp32 trainer whose routers moved a little (weights a step apart)
    sampler = tiny_moe(dtype=torch.bfloat16)
    trainer = tiny_moe(dtype=torch.float32)
    trainer.load_state_dict({k: v.float() for k, v in sampler.state_dict().items()})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if name.endswith("gate.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
    ids, _, routes = sample_with_cache(sampler, list(range(40, 72)), n_new=32, seed=1)
    replay = RouterReplay(trainer)
    with torch.no_grad():
        trainer(input_ids=torch.tensor([ids]))
        free = replay.used()
        with replay.replay(routes):
            trainer(input_ids=torch.tensor([ids]))
            forced = replay.used()
    flips = (free[:-1].sort(-1).values != routes[:-1].sort(-1).values).any(-1).float().mean()
    assert float(flips) > 0.05
    assert torch.equal(forced[:-1], routes[:-1])


def test_gates_get_gradients_under_replay():
    model = tiny_moe().train()
    ids = torch.randint(0, 512, (2, 16))
    g = torch.Generator().manual_seed(0)
    routes = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(32 * 2)]).reshape(32, 2, 2)
    replay = RouterReplay(model)
    with replay.replay(routes):
        loss = model(input_ids=ids, labels=ids).loss
        assert torch.equal(replay.used(), routes)
    loss.backward()
    for router in replay.routers:
        assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0


def test_replay_rejects_routes_that_do_not_fit():
    model = tiny_moe()
    replay = RouterReplay(model)
    with pytest.raises(RouterReplayError, match="tokens"):
        with replay.replay(torch.zeros(5, 2, 2, dtype=torch.long)):
            model(input_ids=torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(RouterReplayError, match="needs"):
        with replay.replay(torch.zeros(5, 3, 2, dtype=torch.long)):
            pass
    from transformers import AutoModelForCausalLM, LlamaConfig

    llama = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(RouterReplayError, match="router"):
        RouterReplay(llama)
    with pytest.raises(UnsupportedMoeModel):
        apply_moe_precision(llama, "mxfp8")


def test_low_precision_experts_match_hf_when_unquantised_and_train():
    ids = torch.randint(0, 512, (2, 24))
    base = tiny_moe()
    want = base(input_ids=ids).logits
    model = tiny_moe()
    assert apply_moe_precision(model, "none", backend="reference") == 2
    assert float((model(input_ids=ids).logits - want).detach().abs().max()) < 1e-5
    lowp = tiny_moe().train()
    apply_moe_precision(lowp, "nvfp4_fwd_mxfp8_bwd", backend="reference")
    out = lowp(input_ids=ids, labels=ids)
    rel = float((out.logits - want).detach().norm() / want.detach().norm())
    assert 0 < rel < 0.2
    out.loss.backward()
    experts = lowp.model.layers[0].mlp.experts
    assert float(experts.gate_up_proj.grad.abs().sum()) > 0 and float(experts.down_proj.grad.abs().sum()) > 0


@pytest.mark.slow   # tests/kernels/test_quant.py checks the same property on the quantiser itself
def test_per_token_scales_are_batch_invariant_and_per_tensor_scales_are_not():
    seq = torch.randint(0, 512, (1, 16))
    others = torch.randint(0, 512, (3, 16))
    gaps = {}
    for recipe in ("nvfp4_fwd_mxfp8_bwd", "nvfp4_tensor_fwd_mxfp8_bwd"):
        model = tiny_moe()
        apply_moe_precision(model, recipe, backend="reference")
        with torch.no_grad():
            alone = model(input_ids=seq).logits[0]
            batched = model(input_ids=torch.cat([seq, others])).logits[0]
        gaps[recipe] = float((alone - batched).abs().max())
    assert gaps["nvfp4_fwd_mxfp8_bwd"] < 1e-5
    assert gaps["nvfp4_tensor_fwd_mxfp8_bwd"] > 1e-3


def test_metrics():
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    mu = torch.log(torch.tensor([[0.5, 0.05, 0.8]]))
    m = sampler_mismatch(logp, mu, torch.tensor([[0, 1, 1]]), is_cap=2.0)
    assert m["mismatch_abs_max"] == pytest.approx(np.log(4), rel=1e-6)
    assert m["is_truncated_frac"] == 0.5
    assert m["mismatch_k1"] == pytest.approx(-(np.log(4) + np.log(0.9 / 0.8)) / 2, rel=1e-6)
    lb = load_balance(expert_counts(torch.tensor([0, 0, 1, -1]), 4))
    assert lb["tokens_per_expert"] == [2, 1, 0, 0] and lb["expert_imbalance"] == pytest.approx(8 / 3)
