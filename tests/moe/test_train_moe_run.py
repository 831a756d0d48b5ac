"""`atelier train` on the tiny MoE: the engine samples it, the trainer trains it in low precision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atelier.config import load_config
from atelier.errors import AtelierError
from atelier.rl.config import TrainConfig
from atelier.rl.run import run_training

RECIPE = Path(__file__).parents[2] / "recipes" / "rl-tiny-moe.toml"


@pytest.mark.slow   # test_trainer_moe.py trains the low-precision experts in the default run
def test_tiny_moe_recipe_trains_with_low_precision_experts(tmp_path):
    config = load_config(TrainConfig, RECIPE, ["trainer.steps=2", "rollout.groups_per_step=1", "env.toy.tasks=4"])
    summary = run_training(config, tmp_path / "run")
    assert summary.steps == 2
    for m in summary.metrics:
        assert len(m["tokens_per_expert"]) == 8 and sum(m["tokens_per_expert"]) > 0
        assert m["grad_norm"] > 0 and m["sampler_mismatch"] > 0   # the quantised trainer is not the sampler


def test_router_replay_in_a_run_uses_the_samplers_experts(tmp_path):
    """`atelier train` with replay: the fp32 engine records routes into the trajectories, the fp32
    trainer's forward uses exactly those experts (every recorded token x layer), its first step
    (on the sampler's weights) reproduces the sampler's logprobs within 1e-4, and the gates learn."""
    from safetensors.torch import load_file

    config = load_config(TrainConfig, RECIPE, ["trainer.steps=2", "rollout.groups_per_step=1", "env.toy.tasks=4",
                                               "trainer.router_replay=true", "trainer.moe_precision=bf16",
                                               "rollout.dtype=float32"])
    run_dir = tmp_path / "run"
    summary = run_training(config, run_dir)
    assert summary.steps == 2
    for m in summary.metrics:
        assert m["routes_recorded"] > 0 and m["routes_match_frac"] == 1.0
    assert summary.metrics[0]["sampler_mismatch_max"] < 1e-4
    traj = json.loads(next((run_dir / "rollouts").rglob("*.json")).read_text())
    routes = traj["segments"][0]["routes"]
    assert routes["dtype"] == "uint8" and routes["shape"][1:] == [2, 2]
    before = load_file(str(run_dir / "base-model" / "model.safetensors"))
    after = load_file(str(run_dir / "checkpoints" / "step-000002" / "model" / "model.safetensors"))
    gates = [k for k in before if k.endswith("gate.weight")]
    assert gates and all(not torch.equal(before[k], after[k]) for k in gates)


def test_router_replay_refuses_a_sampler_without_routes():
    with pytest.raises((AtelierError, ValueError), match="router_replay"):
        load_config(TrainConfig, RECIPE, ["trainer.router_replay=true", "inference.engine=vllm"])
