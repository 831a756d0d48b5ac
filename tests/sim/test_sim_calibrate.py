"""Calibration from a real run directory made here (the tiny model, the toy task, 3 steps), and
the `atelier simulate` commands on it."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from atelier.config import load_config
from atelier.rl.config import TrainConfig
from atelier.rl.run import run_training
from atelier.sim.calibrate import CalibrationError, measured_figures, read_run, rollout_profile, slot_histories
from atelier.sim.cluster import SimConfig
from atelier.sim.predict import calibrate, cluster_for, simulate

STEPS = 3
RUN = ["rollout.group_size=4", "rollout.groups_per_step=2", "rollout.workers=4", "rollout.max_tokens=8",
       "env.toy.tasks=16", "env.toy.env_latency_s=0.2", "env.toy.env_latency_spread=0.5", f"trainer.steps={STEPS}",
       "trainer.checkpoint_every=2", "sync.kind=delta", "sync.full_every=2"]


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("sim") / "run"
    run_training(load_config(TrainConfig, None, [f"model={tiny_model_dir}", *RUN]), run)
    return run


def _atelier(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atelier.cli.main", "simulate", *args], capture_output=True,
                          text=True, timeout=300)


def test_profiles_rebuild_each_rollout_from_its_start_to_its_grade(run_dir):
    """Time before the first call, the calls (the engine's, left to the simulator) and the time after
    each call add up to the ledger's running-to-graded span; the tokens are the ledger's."""
    run = read_run(run_dir)
    slots, groups = slot_histories(run)
    for sid, history in slots.items():
        traj = run.trajectories[sid]
        profile = rollout_profile(traj, history)
        calls = traj["timings"]["generate"]
        span = profile.setup_s + sum(c[1] for c in calls) + sum(t.after_s for t in profile.turns)
        assert span == pytest.approx(history.graded_t - history.running_t, abs=2e-3)
        assert profile.sampled == history.tokens == sum(sum(s["loss_mask"]) for s in traj["segments"])
        # the toy environment sleeps its latency after the call: the profile's time after it covers that
        assert profile.turns[-1].after_s >= traj["timings"]["env_s"] - 1e-3
    cal = calibrate(run_dir)
    assert len(cal.groups) == len(groups) == STEPS * 2 and all(len(g) == 4 for g in cal.groups)


def test_the_calibrated_cluster_holds_what_the_run_measured(run_dir):
    run = read_run(run_dir)
    cal = calibrate(run_dir)
    rows = run.rows
    assert cal.startup_s == pytest.approx(rows[0]["wall_s"] - rows[0]["interval_s"])
    assert cal.swap_s == pytest.approx(statistics.median(r["engine_swap_s"] for r in rows))
    assert cal.delta_bytes == pytest.approx(statistics.median(r["sync_bytes"] for r in rows
                                                              if r["sync_kind"] == "delta"))
    calls = [c for t in run.trajectories.values() for c in t["timings"]["generate"]]
    first_end = min(start + seconds for start, seconds, *_ in calls)
    warm = [c for c in calls if c[0] < first_end]   # in flight during the first call: the warm-up, not fitted
    assert 4 <= cal.engine.calls <= len(calls) - len(warm)   # compile stalls left out too
    assert cal.engine.decode_step_s > 0 and cal.trainer.step_s_per_position + cal.trainer.step_fixed_s > 0
    cluster = cluster_for(run.config, cal)
    assert cluster.steps == STEPS and cluster.rollout == run.config.rollout
    assert cluster.trainer.checkpoint_every == 2 and cluster.sources["inference.swap_s"].startswith("measured")
    predicted = simulate(cluster, cal.groups).figures
    measured = measured_figures(run)
    assert predicted.steps == measured.steps == STEPS
    assert predicted.samples == measured.samples == STEPS * 2 * 4
    assert set(predicted.staleness) <= {"0", "1"} and set(measured.staleness) <= {"0", "1"}


def test_calibrate_writes_a_cluster_file_that_simulate_runs(run_dir, tmp_path):
    out = tmp_path / "cluster.toml"
    done = _atelier("calibrate", str(run_dir), "--set", "rollout.mode=sync", "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["groups"] == STEPS * 2
    cluster = load_config(SimConfig, out)
    assert cluster.rollout.mode == "sync" and cluster.workload.run_dir == str(run_dir)
    ran = _atelier("run", str(out), "--json", "--fault", "inference_down:1.0:0.5")
    assert ran.returncode == 0, ran.stderr
    figures = json.loads(ran.stdout)
    assert figures["steps"] == STEPS and figures["staleness"] == {"0": 1.0}


def test_check_compares_a_run_with_its_prediction(run_dir):
    done = _atelier("check", str(run_dir), "--from", str(run_dir), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    wall = result["errors"]["wall_s"]
    assert wall["measured"] == pytest.approx(json.loads((run_dir / "summary.json").read_text())["wall_s"], rel=1e-3)
    assert wall["relative_error"] == pytest.approx((wall["predicted"] - wall["measured"]) / wall["measured"], abs=1e-3)


def test_bad_input_is_named_with_a_fix(tmp_path, run_dir):
    (tmp_path / "old").mkdir()
    for name in ("config.toml", "metrics.jsonl"):
        (tmp_path / "old" / name).write_text((run_dir / name).read_text())
    (tmp_path / "old" / "ledger.jsonl").write_text('{"event": "group", "group_id": "g", "task_id": "t", '
                                                   '"index": 0, "admitted_version": 0, "size": 1}\n')
    with pytest.raises(CalibrationError, match="without a time"):
        read_run(tmp_path / "old")
    done = _atelier("calibrate", str(tmp_path / "nothing"))
    assert done.returncode == 2 and "not the run directory" in done.stderr and "hint:" in done.stderr
    done = _atelier("run", "recipes/clusters/coder-7b.toml", "--fault", "meteor:10")
    assert done.returncode == 2 and "--fault 'meteor:10' is not a fault" in done.stderr
    done = _atelier("run", "recipes/clusters/coder-7b.toml", "--set", "rollout.stalenes=2")
    assert done.returncode == 2 and "stalenes" in done.stderr
