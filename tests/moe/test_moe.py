"""The tiny MoE model, router replay and low-precision experts, applied from outside the model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from atelier.inference.tiny import tiny_moe_config
from atelier.moe.metrics import load_balance, sampler_mismatch
from atelier.moe.precision import UnsupportedMoeModel, apply_moe_precision
from atelier.moe.replay import RouterReplay, RouterReplayError, pack_routes, unpack_routes


def tiny_moe(seed: int = 0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(512), dtype=dtype)
    return model.eval()


def sample_with_cache(model, prompt: list[int], n_new: int, seed: int = 0):
    """A sampler as an engine runs it: prefill, then one token per step through the KV cache.
    Returns the sequence, the sampled tokens' logprobs and the routes recorded for every fed token."""
    g = torch.Generator().manual_seed(seed)
    replay = RouterReplay(model)
    ids = list(prompt)
    logps = []
    with torch.no_grad(), replay.record():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(n_new):
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=g))
            ids.append(tok)
            logps.append(float(logp[tok]))
            out = model(input_ids=torch.tensor([[tok]]), cache=out.past_key_values, use_cache=True)
    routes = replay.recorded()[:-1]                  # the last step fed the final token: keep T - 1 rows
    routes = torch.cat([routes, torch.full_like(routes[:1], -1)])   # the final token: no record
    replay.remove()
    return ids, logps, routes


def trainer_logprobs(model, ids: list[int], n_new: int):
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logp[-n_new:]


def test_pack_routes_is_compact_and_round_trips():
    ids = torch.tensor([[[0, 7], [3, 1]], [[-1, -1], [5, 2]]])
    packed = pack_routes(ids, num_experts=8)
    assert packed.dtype == np.uint8 and packed[1, 0, 0] == 255
    assert torch.equal(unpack_routes(packed), ids)
    assert pack_routes(ids, num_experts=300).dtype == np.uint16


def test_replay_uses_exactly_the_samplers_experts_and_reproduces_its_logprobs():
    model = tiny_moe()
    prompt = list(range(10, 30))
    ids, mu, routes = sample_with_cache(model, prompt, n_new=12)
    assert routes.shape == (len(ids), 2, 2)
    replay = RouterReplay(model)
    with torch.no_grad(), replay.replay(pack_routes(routes, 8)):
        logp = trainer_logprobs(model, ids, 12)
    used = replay.used()
    assert torch.equal(used[:-1], routes[:-1])
    assert float((logp - torch.tensor(mu)).abs().max()) < 1e-4


def test_replay_from_a_bf16_sampler_forces_its_routes_where_recompute_flips_them():
    sampler = tiny_moe(dtype=torch.bfloat16)
    trainer = tiny_moe(dtype=torch.float32)
    trainer.load_state_dict({k: v.float() for k, v in sampler.state_dict().items()})
    ids, _, routes = sample_with_cache(sampler, list(range(40, 72)), n_new=32, seed=1)
    replay = RouterReplay(trainer)
    with torch.no_grad():
        trainer(input_ids=torch.tensor([ids]))
        free = replay.used()
        with replay.replay(routes):
            trainer(input_ids=torch.tensor([ids]))
            forced = replay.used()
    assert torch.equal(forced[:-1], routes[:-1])
    # bf16 against fp32 flips some routing decisions (sets of experts, not their order)
    flips = (free[:-1].sort(-1).values != routes[:-1].sort(-1).values).any(-1).float().mean()
    assert float(flips) > 0


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
    lb = load_balance(torch.tensor([0, 0, 1, -1]), 4)
    assert lb["tokens_per_expert"] == [2, 1, 0, 0] and lb["expert_imbalance"] == pytest.approx(8 / 3)
