"""A run is reproducible from its seed, whatever ran in the process before it.

The trainer's RNGs (here: attention dropout, which draws from torch's global
generator) are seeded from `seed` and the rank when a run starts, and resumed
from each rank's saved states (`atelier.rl.checkpoint.start_rng`). Before, a
run took torch's generator as it found it: two runs with the same seed in one
process (an SFT phase then RL, a notebook) trained to different weights, and
the seed did not reach the trainer at all.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from atelier.config import load_config
from atelier.inference.tiny import build_tiny_model
from atelier.rl.checkpoint import rank_seed, rng_file, save_rng, start_rng
from atelier.rl.config import TrainConfig
from atelier.rl.run import run_training

ARGS = ["rollout.mode=sync", "rollout.batch_invariant=true", "rollout.groups_per_step=1", "rollout.group_size=2",
        "rollout.workers=2", "rollout.max_tokens=8", "env.toy.tasks=4", "trainer.lr=1e-2", "trainer.threads=1"]


def _weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:06d}" / "model" / "model.safetensors"))


def test_same_seed_same_weights_whatever_the_process_drew_before(tmp_path):
    model = build_tiny_model(tmp_path / "model", attention_dropout=0.5)   # training draws dropout masks
    config = load_config(TrainConfig, None, [f"model={model}", "trainer.steps=2", *ARGS])
    torch.manual_seed(1)
    run_training(config, tmp_path / "a")
    torch.manual_seed(2)                # another history: what a previous run or phase left behind
    torch.rand(1000)
    run_training(config, tmp_path / "b")
    a, b = _weights(tmp_path / "a", 2), _weights(tmp_path / "b", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    base = load_file(str(model / "model.safetensors"))
    assert any(not torch.equal(a[k], base[k]) for k in a)   # it trained


def test_resume_continues_the_rng_stream(tmp_path):
    """Killed (here: stopped) after step 1 and resumed: step 2 draws the uninterrupted run's masks."""
    model = build_tiny_model(tmp_path / "model", attention_dropout=0.5)
    whole = load_config(TrainConfig, None, [f"model={model}", "trainer.steps=2", *ARGS])
    run_training(whole, tmp_path / "whole")
    first = load_config(TrainConfig, None, [f"model={model}", "trainer.steps=1", *ARGS])
    run_training(first, tmp_path / "split")
    torch.manual_seed(7)
    run_training(whole, tmp_path / "split")   # continued, with one more step
    a, b = _weights(tmp_path / "whole", 2), _weights(tmp_path / "split", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("rank", [0, 3])
def test_each_rank_starts_from_its_own_seed_and_resumes_its_own_state(tmp_path, rank):
    seeds = {rank_seed(5, r) for r in range(8)} | {rank_seed(6, r) for r in range(8)}
    assert len(seeds) == 16 and max(seeds) < 2**32 and rank_seed(5, 0) == 5
    start_rng(5, rank, None)
    fresh = torch.rand(4)
    start_rng(5, rank, None)
    assert torch.equal(torch.rand(4), fresh)
    start_rng(5, rank + 1, None)
    assert not torch.equal(torch.rand(4), fresh)          # ranks draw different masks
    torch.rand(3)
    save_rng(tmp_path, rank)
    assert rng_file(tmp_path, rank).exists()
    want = torch.rand(4)
    torch.manual_seed(0)
    start_rng(5, rank, tmp_path)
    assert torch.equal(torch.rand(4), want)
