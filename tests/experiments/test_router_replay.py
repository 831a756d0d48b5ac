"""experiments/router_replay: replay removes every routing flip, offline and in `atelier train`'s RL loop."""

from __future__ import annotations

import json

import pytest

from tests.helpers import EXPERIMENTS, load_experiment

EXPERIMENT = EXPERIMENTS / "router_replay"


@pytest.mark.slow
def test_smoke_run(tmp_path):
    run = load_experiment("router_replay")
    results = run.main(["--out", str(tmp_path), "--smoke"])
    later = results["one_step_later"]
    assert later["no_replay"]["routing_flip_frac"] > 0
    assert later["replay"]["routing_flip_frac"] == 0.0
    assert set(results["rl"]) == {"float32-sync-free", "float32-sync-replay", "bfloat16-sync-free",
                                  "bfloat16-sync-replay"}
    for arm in results["rl"].values():
        assert arm["steps"] == 2 and len(arm["curves"]["reward_mean"]) == 2
    assert results["rl"]["float32-sync-replay"]["summary"]["mismatch_abs_max"] < 1e-4
    assert (tmp_path / "results.json").exists() and (tmp_path / "router_replay.png").stat().st_size > 0


def test_committed_results_show_replay_removes_flips():
    results = json.loads((EXPERIMENT / "results.json").read_text())
    for case in ("same_weights", "one_step_later"):
        assert results[case]["replay"]["routing_flip_frac"] == 0.0
    assert results["one_step_later"]["no_replay"]["routing_flip_frac"] > 0


def test_committed_rl_runs_show_replay_and_learning():
    rl = json.loads((EXPERIMENT / "results.json").read_text())["rl"]
    assert len(rl) == 6
    for name, arm in rl.items():
        s = arm["summary"]
        assert s["reward_final"] > s["reward_first"] + 0.5, name          # every arm learns the toy task
        if arm["replay"]:
            assert s["routing_flip_frac"] == 0.0, name
    # fp32 sampler and trainer on the same weights: the recompute is the sampler's, replay or not
    assert rl["float32-sync-replay"]["summary"]["mismatch_abs_max"] < 1e-4
    # a bf16 sampler routes some tokens differently from the fp32 trainer; staleness far more
    assert 0 < rl["bfloat16-sync-free"]["summary"]["routing_flip_frac"] < rl["bfloat16-async-free"]["summary"][
        "routing_flip_frac"]
