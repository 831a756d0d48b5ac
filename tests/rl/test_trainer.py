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
from atelier.rl import trainer as trainer_module
from atelier.rl.advantages import final_advantages, trained_samples, weighted_advantage
from atelier.rl.config import TrainerConfig
from atelier.rl.metrics import sample_metrics, staleness_counts
from atelier.rl.sample import Sample
from atelier.rl.trainer import Trainer
from atelier.train.head import token_logprobs


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
    assert staleness_counts([sample], 0) == {0: len(gen.token_ids)}   # sampled by the weights it trains
    assert trainer.step == 1
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_train_cli_user_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli.app, ["train"])
    assert isinstance(result.exception, AtelierError)
    assert "no recipe" in str(result.exception)
    result = runner.invoke(cli.app, ["train", "--run-dir", str(tmp_path)])
    assert isinstance(result.exception, AtelierError) and "holds no run to continue" in str(result.exception)
    bad = tmp_path / "r.toml"
    bad.write_text("[rollout]\ngroup_sise = 4\n")
    result = runner.invoke(cli.app, ["train", str(bad)])
    # the typo is named with a suggestion
    assert isinstance(result.exception, AtelierError) and "group_size" in str(result.exception)


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
    """With kl_beta = 0 a zero-advantage sample adds nothing to the gradient: the step over every
    sample is the step over the ones `trained_samples` keeps, which does not run them (with
    kl_beta > 0 it keeps them all)."""
    g = torch.Generator().manual_seed(3)
    samples = [Sample(torch.randint(0, 256, (9,), generator=g).tolist(), [0] + [1] * 8, [0.0] + [-3.0] * 8,
                      [-1] + [0] * 8, adv, "g", "t") for adv in (0.5, 0.0, -0.5, 0.0)]
    kept = trained_samples(samples, kl_beta=0.0)
    assert [s.advantage for s in kept] == [0.5, -0.5] and trained_samples(samples, kl_beta=0.1) == samples
    out = []
    for batch in (samples, kept):
        trainer = Trainer(tiny_model_dir, TrainerConfig(precision="fp32", norm_tokens=16.0, lr=1e-3))
        out.append((trainer.train_step(batch), trainer.model.state_dict()))
    (m_all, w_all), (m_some, w_some) = out
    assert (m_all["train_tokens"], m_some["train_tokens"]) == (32, 16)   # run, and not run
    assert m_all["loss"] == pytest.approx(m_some["loss"], rel=1e-6)
    for k in w_all:   # up to the rounding of summing the same gradients over a bigger batch
        torch.testing.assert_close(w_all[k], w_some[k], rtol=1e-5, atol=1e-7)
    metrics = sample_metrics(staleness_counts(samples, 0), len(samples) - len(kept))
    assert metrics == {"staleness_hist": {"0": 32}, "staleness_max": 0, "skipped_zero_advantage": 2}


@pytest.mark.parametrize("scale", [0.0, 0.25])
def test_negative_advantage_scale_sets_the_final_advantage_of_samples_below_the_mean(scale):
    """`negative_advantage_scale`: the advantage a sample leaves `atelier.rl.advantages` with is its
    group advantage, times the scale when it is negative; at 0 the samples below their group's mean
    have advantage 0 and are not run."""
    rewards = [1.0, 0.2, 0.3, None, 0.5]
    plain = [0.5, -0.3, -0.2, None, 0.0]
    final = final_advantages(rewards, scale)
    assert final == pytest.approx([0.5, -0.3 * scale, -0.2 * scale, None, 0.0])
    assert final_advantages(rewards) == pytest.approx(plain)
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


def test_each_cpu_step_hands_back_the_heap_it_freed(tiny_model_dir, monkeypatch):
    """The trainer trims glibc's heaps after every step on the CPU (see
    `atelier.train.devices.trim_freed_memory`, tested in tests/train/test_devices.py)."""
    trims = []
    monkeypatch.setattr(trainer_module, "trim_freed_memory", lambda: trims.append(1) or True)
    trainer = Trainer(tiny_model_dir, TrainerConfig(norm_tokens=8.0, lr=1e-3))
    sample = Sample([5, 17, 99, 3, 250, 7], [0, 0, 0, 1, 1, 1], [0.0] * 3 + [-2.0] * 3, [-1] * 6, 1.0, "g", "t")
    for _ in range(2):
        trainer.train_step([sample, dataclasses.replace(sample, advantage=-1.0)])
    assert len(trims) == 2
