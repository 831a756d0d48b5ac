"""The trainer's recomputed logprobs are the engine's; the CLI's user errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from atelier.cli import main as cli
from atelier.errors import AtelierError
from atelier.inference.engine import LocalEngine
from atelier.inference.types import SamplingParams
from atelier.rl.advantages import weighted_advantage
from atelier.rl.config import TrainerConfig
from atelier.rl.sample import Sample
from atelier.rl.trainer import Trainer, token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_match_the_sampler_so_on_policy_ratios_are_one(tiny_model_dir, temperature):
    prompt = [5, 17, 99, 3, 250]
    with LocalEngine(tiny_model_dir, dtype="float32") as engine:
        gen = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=temperature, seed=3))
    trainer = Trainer(tiny_model_dir, TrainerConfig(norm_tokens=1.0), temperature=temperature)
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logp, _ = token_logprobs(trainer.model, ids, torch.ones_like(ids), temperature)
    recomputed = logp[0, len(prompt):]
    assert torch.allclose(recomputed, torch.tensor(gen.logprobs), atol=1e-4)
    sample = Sample(prompt + gen.token_ids, [0] * len(prompt) + [1] * len(gen.token_ids),
                    [0.0] * len(prompt) + gen.logprobs, [-1] * len(prompt) + gen.versions, 1.0, "g", "t")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_step([sample])
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["staleness_hist"] == {"0": len(gen.token_ids)}
    assert trainer.step == 1
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_train_cli_user_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli.app, ["train"])
    assert isinstance(result.exception, AtelierError)
    assert "no recipe" in str(result.exception)
    result = runner.invoke(cli.app, ["train", "--resume", str(tmp_path)])
    assert isinstance(result.exception, AtelierError) and "cannot resume" in str(result.exception)
    bad = tmp_path / "r.toml"
    bad.write_text("[rollout]\ngroup_sise = 4\n")
    result = runner.invoke(cli.app, ["train", str(bad)])
    assert isinstance(result.exception, AtelierError) and "group_size" in str(result.exception)   # the typo is named with a suggestion


def test_asking_for_a_logger_that_is_not_installed_is_a_user_error(tmp_path, monkeypatch):
    import sys

    from atelier.rl.metrics import MissingLogger, flat_scalars, make_loggers

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingLogger) as info:
        make_loggers(["wandb"], tmp_path, {})
    assert "pip install wandb" in info.value.hint
    assert flat_scalars({"step": 3, "reward_parts": {"length": -0.5}, "mode": "async", "ok": True}) == {
        "step": 3.0, "reward_parts/length": -0.5}


def test_one_rank_bf16_step_keeps_fp32_masters_and_tracks_the_fp32_step(tiny_model_dir):
    """bf16 on one rank computes with bf16 copies but steps the fp32 weights, close to the fp32 step."""
    g = torch.Generator().manual_seed(1)
    samples = [Sample(torch.randint(0, 256, (9,), generator=g).tolist(), [0] + [1] * 8, [0.0] + [-3.0] * 8,
                      [-1] + [0] * 8, adv, "g", "t") for adv in (1.0, -1.0, 1.0)]
    out = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(tiny_model_dir, TrainerConfig(precision=precision, norm_tokens=16.0, micro_batch=2,
                                                        lr=1e-3))
        metrics = trainer.train_step(samples)
        state = trainer.model.state_dict()
        assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in trainer.model.parameters())
        out[precision] = metrics, state
    (m32, w32), (m16, w16) = out["fp32"], out["bf16"]
    assert m16["loss"] == pytest.approx(m32["loss"], rel=0.05)
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.05)
    for k in w32:
        torch.testing.assert_close(w16[k], w32[k], rtol=0, atol=3e-3)


def test_activation_checkpointing_takes_the_same_step(tiny_model_dir):
    """Per-layer checkpointing recomputes activations in the backward; the step itself is unchanged."""
    g = torch.Generator().manual_seed(2)
    samples = [Sample(torch.randint(0, 256, (9,), generator=g).tolist(), [0] + [1] * 8, [0.0] + [-3.0] * 8,
                      [-1] + [0] * 8, adv, "g", "t") for adv in (1.0, -1.0)]
    out = []
    for checkpointing in (False, True):
        trainer = Trainer(tiny_model_dir, TrainerConfig(precision="fp32", norm_tokens=16.0, lr=1e-3,
                                                        activation_checkpointing=checkpointing))
        out.append((trainer.train_step(samples), trainer.model.state_dict()))
    (m0, w0), (m1, w1) = out
    assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-5)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=1e-5, atol=1e-6)


def test_adam_eps_turns_sign_descent_into_a_step_along_the_gradient(tiny_model_dir):
    """With AdamW's default eps a first step moves every weight whose gradient is not zero by
    about the learning rate, large gradient or small; with eps far above the gradients it moves
    each by lr * gradient / eps, so the step follows the gradient's direction and scale."""
    g = torch.Generator().manual_seed(4)
    samples = [Sample(torch.randint(0, 256, (9,), generator=g).tolist(), [0] + [1] * 8, [0.0] + [-3.0] * 8,
                      [-1] + [0] * 8, adv, "g", "t") for adv in (1.0, -1.0)]
    moves = {}
    for eps in (1e-8, 1.0):
        trainer = Trainer(tiny_model_dir, TrainerConfig(precision="fp32", norm_tokens=16.0, lr=1e-3, eps=eps))
        before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
        trainer.train_step(samples)
        after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        moved = (after - before).abs()
        moves[eps] = moved[moved > 0]
    sign_like, along_gradient = moves[1e-8], moves[1.0]
    assert sign_like.median() > 0.9e-3 and sign_like.max() < 1.1e-3
    assert along_gradient.median() < 1e-2 * 1e-3     # clipped gradients are far below 1


def test_zero_advantage_samples_are_not_run_and_change_nothing(tiny_model_dir):
    """With kl_beta = 0 a zero-advantage sample adds nothing to the gradient: the step is the
    same without it, and it is counted, not trained (with kl_beta > 0 it is trained)."""
    g = torch.Generator().manual_seed(3)
    samples = [Sample(torch.randint(0, 256, (9,), generator=g).tolist(), [0] + [1] * 8, [0.0] + [-3.0] * 8,
                      [-1] + [0] * 8, adv, "g", "t") for adv in (0.5, 0.0, -0.5, 0.0)]
    out = []
    for batch in (samples, [s for s in samples if s.advantage]):
        trainer = Trainer(tiny_model_dir, TrainerConfig(precision="fp32", norm_tokens=16.0, lr=1e-3))
        out.append((trainer.train_step(batch), trainer.model.state_dict()))
    (m_all, w_all), (m_some, w_some) = out
    assert m_all["skipped_zero_advantage"] == 2 and m_some["skipped_zero_advantage"] == 0
    assert m_all["train_tokens"] == m_some["train_tokens"] == 16
    assert m_all["staleness_hist"] == {"0": 32}   # staleness still counts every sample of the step
    for k in w_all:
        torch.testing.assert_close(w_all[k], w_some[k], rtol=0, atol=0)
    trainer = Trainer(tiny_model_dir, TrainerConfig(precision="fp32", norm_tokens=16.0, kl_beta=0.1))
    assert trainer.train_step(samples)["skipped_zero_advantage"] == 0


@pytest.mark.parametrize("scale", [0.0, 0.25])
def test_negative_advantage_scale_trains_negatives_at_that_weight(tiny_model_dir, scale):
    """`negative_advantage_scale` takes the step of the same samples with every negative advantage
    multiplied by it, positives untouched; at 0 the samples below their group's mean are not run."""
    g = torch.Generator().manual_seed(5)
    samples = [Sample(torch.randint(0, 256, (9,), generator=g).tolist(), [0] + [1] * 8, [0.0] + [-3.0] * 8,
                      [-1] + [0] * 8, adv, "g", "t") for adv in (0.5, -0.3, -0.2, 0.0)]
    rescaled = [dataclasses.replace(s, advantage=s.advantage * scale if s.advantage < 0 else s.advantage)
                for s in samples]
    out = []
    for batch, cfg_scale in ((samples, scale), (rescaled, 1.0), (samples, 1.0)):
        trainer = Trainer(tiny_model_dir, TrainerConfig(precision="fp32", norm_tokens=16.0, lr=1e-3,
                                                        negative_advantage_scale=cfg_scale))
        out.append((trainer.train_step(batch), trainer.model.state_dict()))
    (m_scaled, w_scaled), (m_manual, w_manual), (_, w_reference) = out
    for k in w_scaled:
        torch.testing.assert_close(w_scaled[k], w_manual[k], rtol=0, atol=0)
    assert any(not torch.equal(w_scaled[k], w_reference[k]) for k in w_scaled)   # the knob did something
    assert m_scaled["skipped_zero_advantage"] == (3 if scale == 0.0 else 1)
    assert m_scaled["loss"] == m_manual["loss"]
    assert weighted_advantage(-0.4, 0.5) == -0.2 and weighted_advantage(0.4, 0.0) == 0.4
    with pytest.raises(ValueError, match="negative_scale"):
        weighted_advantage(-1.0, 1.5)
    with pytest.raises(ValueError):
        TrainerConfig(negative_advantage_scale=-0.1)


def group_samples(seed: int = 4) -> list[Sample]:
    """Two groups of three after one system prompt (70 tokens): each group its own task, then a turn
    its members sampled alike (66 trained tokens) and a tool result, then each member's own sampled
    tokens; group 1's last two members are the same rollout."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()   # noqa: E731
    prompt, samples = rand(70), []
    # advantages that do not sum to 0 in a group, and sampler logprobs that differ by member: else the
    # shared turn's loss terms would cancel (reward minus the group mean, equal importance weights)
    for group, advantages in enumerate(((1.0, -0.5, -0.2), (0.6, -0.3, -0.3))):
        task, turn, tool = rand(6), rand(66), rand(4)
        owns = [rand(5 + i) for i in range(3)]
        if group == 1:
            owns[2] = owns[1]
        for i, (own, adv) in enumerate(zip(owns, advantages)):
            ids = prompt + task + turn + tool + own
            mask = [0] * 76 + [1] * 66 + [0] * 4 + [1] * len(own)
            samples.append(Sample(ids, mask, [-5.0 - i if m else 0.0 for m in mask], [i % 2 if m else -1 for m in mask],
                                  adv, f"g{group}", "t"))
    return samples


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_a_prefix_tree_runs_shared_tokens_once_and_takes_the_same_step(tiny_model_dir, kl_beta):
    """The system prompt runs once a step, each group's task and shared turn once a group (its trained
    tokens' loss applied to one logprob per token, for every member), and the step is the one of
    running every sample whole."""
    samples = group_samples()
    out = []
    # the runs' activations kept, then recomputed for their backward, then every layer checkpointed too;
    # micro-batches of 2: a group's continuations run together over the group's keys and values
    for share, recompute, checkpointing in ((False, False, False), (True, False, False), (True, True, False),
                                            (True, True, True)):
        trainer = Trainer(tiny_model_dir, TrainerConfig(precision="fp32", norm_tokens=16.0, lr=1e-3, micro_batch=2,
                                                        share_prefix=share, recompute_prefix=recompute,
                                                        activation_checkpointing=checkpointing, kl_beta=kl_beta))
        out.append((trainer.train_step(samples), trainer.model.state_dict()))
    (m0, w0), *shared = out
    whole = sum(len(s.token_ids) for s in samples)
    assert m0["positions_run"] == m0["positions_whole"] == whole
    for m1, w1 in shared:
        # the prompt's 69 (token 70 is the first a group feeds), each group's 76, each member's own tail
        assert m1["positions_run"] == 69 + 2 * 76 + sum(len(s.token_ids) - 145 for s in samples)
        assert m1["train_tokens"] == m0["train_tokens"] == 6 * 66 + (5 + 6 + 7) + (5 + 6 + 6)
        for key in ("loss", "grad_norm", "entropy", "is_weight_mean", "kl_k1", "sampler_k1"):
            assert m1[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6)
        for k in w0:   # Adam's first step moves a weight by about lr (1e-3) whatever its gradient's size
            torch.testing.assert_close(w1[k], w0[k], rtol=0, atol=2e-5)


def test_a_recomputed_prefix_holds_no_graph_until_its_backward(tiny_model_dir):
    """`recompute_prefix`: while the continuations run, the prefix's keys and values come from a
    forward without a graph (its activations are not held); its backward runs it again and gives
    the gradients of the kept graph."""
    from transformers import AutoModelForCausalLM

    from atelier.distributed import PolicyHead

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    head = PolicyHead(lm)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    grads = []
    for recompute in (False, True):
        head.zero_grad(set_to_none=True)
        prefix = head.encode_prefix(ids[:, :30], recompute=recompute)
        assert all((k.grad_fn is None) == recompute for k, _ in prefix.kv)
        logp, _ = head(ids[:, 30:], torch.ones(1, 10, dtype=torch.long), prefix=prefix)
        logp.sum().backward()
        prefix.backward()
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None})
    kept, recomputed = grads
    assert kept.keys() == recomputed.keys() and "model.layers.0.self_attn.k_proj.weight" in kept
    for name in kept:
        torch.testing.assert_close(recomputed[name], kept[name], rtol=1e-5, atol=1e-7)


def test_prefix_forest_shares_runs_of_the_minimum_length_and_stops_before_a_split():
    from atelier.rl.prefix_tree import positions_run, prefix_forest

    prompt = list(range(100))
    a = prompt + [1] * 80 + [5, 6]          # a and b share 180 tokens, c only the prompt
    b = prompt + [1] * 80 + [7, 8, 9]
    c = prompt + [2] * 10
    nodes, leaves = prefix_forest([a, b, c], minimum=64)
    assert leaves == []
    (root,) = nodes
    # the root feeds 0..98 and reads token 99's logprob last: token 100 is the first the continuations differ in
    assert (root.start, root.end, root.members, root.leaves) == (0, 99, [0, 1, 2], [2])
    (pair,) = root.children
    assert (pair.start, pair.end, pair.members, pair.leaves, pair.children) == (99, 179, [0, 1], [0, 1], [])
    assert positions_run((nodes, leaves), [182, 183, 110]) == 99 + 80 + (182 - 179) + (183 - 179) + (110 - 99)
    # below the minimum nothing is shared; a lone sequence is a leaf; a sequence inside another is covered
    assert prefix_forest([a, b, c], minimum=200) == ([], [0, 1, 2])
    assert prefix_forest([a]) == ([], [0])
    nodes, leaves = prefix_forest([a, a[:150]], minimum=64)
    assert leaves == [] and (nodes[0].start, nodes[0].end, nodes[0].leaves) == (0, 149, [0])


def test_each_cpu_step_hands_back_the_heap_it_freed(tiny_model_dir, monkeypatch):
    """The trainer trims glibc's heaps after every step on the CPU (see
    `atelier.distributed.trim_freed_memory`, tested in test_distributed.py)."""
    from atelier import distributed as D

    trims = []
    monkeypatch.setattr(D, "trim_freed_memory", lambda: trims.append(1) or True)
    trainer = Trainer(tiny_model_dir, TrainerConfig(norm_tokens=8.0, lr=1e-3))
    sample = Sample([5, 17, 99, 3, 250, 7], [0, 0, 0, 1, 1, 1], [0.0] * 3 + [-2.0] * 3, [-1] * 6, 1.0, "g", "t")
    for _ in range(2):
        trainer.train_step([sample, dataclasses.replace(sample, advantage=-1.0)])
    assert len(trims) == 2
