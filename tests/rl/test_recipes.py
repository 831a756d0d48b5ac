"""Every RL recipe in recipes/ is a valid TrainConfig, and its dump reloads to the same config."""

from __future__ import annotations

from pathlib import Path

import pytest

from atelier.config import dump_config, load_config
from atelier.rl.config import TrainConfig

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("rl-*.toml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_recipe_loads_and_round_trips(recipe, tmp_path):
    config = load_config(TrainConfig, recipe)
    dumped = tmp_path / "config.toml"
    dumped.write_text(dump_config(config))
    assert load_config(TrainConfig, dumped) == config


def test_there_are_rl_recipes():
    assert {r.name for r in RECIPES} >= {"rl-tiny.toml"}
