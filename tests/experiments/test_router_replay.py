"""experiments/router_replay at smoke scale: replay removes every routing flip."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "router_replay"


@pytest.mark.slow
def test_smoke_run(tmp_path):
    spec = importlib.util.spec_from_file_location("router_replay_run", EXPERIMENT / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    results = run.main(["--out", str(tmp_path), "--smoke"])
    later = results["one_step_later"]
    assert later["no_replay"]["routing_flip_frac"] > 0
    assert later["replay"]["routing_flip_frac"] == 0.0
    assert (tmp_path / "results.json").exists()


def test_committed_results_show_replay_removes_flips():
    results = json.loads((EXPERIMENT / "results.json").read_text())
    for case in ("same_weights", "one_step_later"):
        assert results[case]["replay"]["routing_flip_frac"] == 0.0
    assert results["one_step_later"]["no_replay"]["routing_flip_frac"] > 0
