"""`atelier train` on the tiny MoE: the engine samples it, the trainer trains it in low precision."""

from __future__ import annotations

from pathlib import Path

import pytest

from atelier.config import load_config
from atelier.errors import AtelierError
from atelier.rl.config import TrainConfig
from atelier.rl.run import run_training

RECIPE = Path(__file__).parents[2] / "recipes" / "rl-tiny-moe.toml"


def test_tiny_moe_recipe_trains_with_low_precision_experts(tmp_path):
    config = load_config(TrainConfig, RECIPE, ["trainer.steps=2", "rollout.groups_per_step=1", "env.toy.tasks=4"])
    summary = run_training(config, tmp_path / "run")
    assert summary.steps == 2
    for m in summary.metrics:
        assert len(m["tokens_per_expert"]) == 8 and sum(m["tokens_per_expert"]) > 0
        assert m["grad_norm"] > 0 and m["sampler_mismatch"] > 0   # the quantised trainer is not the sampler


def test_router_replay_in_a_run_says_the_sampler_cannot_yet(tmp_path):
    with pytest.raises((AtelierError, ValueError), match="router_replay"):
        load_config(TrainConfig, RECIPE, ["trainer.router_replay=true"])
