"""`atelier train` killed at each named crash point (`ATELIER_CRASH_AT`), then
resumed, ends with the files of an uninterrupted run with the same seed:
metrics line for line (measurements of time and memory aside), the ledger's
slots, and the final checkpoint's weights and optimizer state bit for bit.

What makes bit-for-bit possible (each was a difference between two
*uninterrupted* runs, or between a resumed run and one, before):
- sync mode and `rollout.batch_invariant`: a rollout's sampler logprobs do not
  depend on which thread reached the engine first (a prefix-cache hit moved
  them by up to 2e-3 in bf16);
- a rollout cut off by the kill runs again with its own seed, not attempt + 1
  (`atelier.rl.reconciler.rollout_seed`);
- the curriculum's recent window follows admission order, not completion
  order; the counters of rollouts generated but not yet reported come back
  from the ledger;
- `trainer.threads` fixed (1 here) and OMP_NUM_THREADS=1.

The bug this first guarded: the step's checkpoint committed before its metrics
line was written, so a `kill -9` in between left metrics.jsonl without that
step for good (the resumed run went on with the next one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atelier.rl.ledger import Ledger

RECIPE = Path(__file__).parents[2] / "recipes" / "rl-tiny.toml"
ARGS = ["rollout.mode=sync", "rollout.batch_invariant=true", "rollout.groups_per_step=2", "rollout.group_size=2",
        "rollout.workers=2", "rollout.max_tokens=8", "env.toy.tasks=20", "trainer.lr=1e-3", "trainer.threads=1"]
MEASURED = {"wall_s", "interval_s", "gen_tokens_per_s", "trainer_idle_s", "trainer_busy_s", "trainer_idle_fraction",
            "sync_seconds", "sync_bytes_per_s", "engine_swap_s", "train_seconds", "train_tokens_per_s",
            "peak_memory_gb"}
"""Fields of a metrics line that measure time or memory; every other field must repeat exactly."""
SLOT_FIELDS = ("group_id", "task_id", "member", "state", "attempt", "reward", "passed", "start_version", "step",
               "advantage", "turns", "tokens")
"""What the ledger says of a slot, less the notes of its history (a re-run's reason)."""

POINTS = ["rl.after_train", "checkpoint.before_rename", "rl.after_checkpoint", "rl.after_publish",
          "rl.after_metrics", "rl.after_ledger_commit"]


def train(run: Path, steps: int, *extra: str, crash_at: str | None = None, resume: bool = False
          ) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "atelier.cli.main", "train"]
    argv += [str(RECIPE), "--run-dir", str(run)]   # the same command starts the run and continues it
    for a in [*ARGS, f"trainer.steps={steps}", *extra]:
        argv += ["--set", a]
    env = {k: v for k, v in os.environ.items() if k != "ATELIER_CRASH_AT"}
    env["OMP_NUM_THREADS"] = "1"
    if crash_at:
        env["ATELIER_CRASH_AT"] = crash_at
    return subprocess.run([*argv, "--quiet"], capture_output=True, text=True, env=env, timeout=600)


def crash_then_resume(run: Path, steps: int, point: str, *extra: str) -> None:
    crashed = train(run, steps, *extra, crash_at=point)
    assert crashed.returncode == -9, f"never reached {point}: {crashed.stderr[-2000:]}"
    resumed = train(run, steps, *extra, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def trained_by_step(run: Path) -> dict[int, list[str]]:
    by_step: dict[int, list[str]] = defaultdict(list)
    for s in Ledger.load(run / "ledger.jsonl").slots.values():
        assert s.state == "trained", s
        by_step[s.step].append(s.slot_id)
    return {k: sorted(v) for k, v in sorted(by_step.items())}


def ledger_state(run: Path) -> dict:
    ledger = Ledger.load(run / "ledger.jsonl")
    return {"groups": {g.group_id: (g.task_id, g.index, g.admitted_version, g.dropped) for g in ledger.groups.values()},
            "slots": {sid: tuple(getattr(s, f) for f in SLOT_FIELDS) for sid, s in ledger.slots.items()}}


def final_state(run: Path, steps: int) -> tuple[dict, dict]:
    last = run / "checkpoints" / f"step-{steps:06d}"
    return (load_file(last / "model" / "model.safetensors"),
            torch.load(last / "optimizer.pt", weights_only=True)["state"])


def assert_bitwise_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        if isinstance(want[k], dict):
            assert_bitwise_equal(got[k], want[k], f"{what}[{k}]")
        else:
            assert torch.equal(got[k], want[k]), f"{what}[{k}] differs by up to {(got[k] - want[k]).abs().max()}"


def assert_like_uninterrupted(run: Path, steps: int, reference: Path | None = None) -> None:
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    by_step = trained_by_step(run)
    assert sorted(by_step) == list(range(1, steps + 1))
    # Each slot's last `trained` event is its only effective one: earlier ones
    # (a step that was not committed) were undone on resume.
    assert (run / "checkpoints" / f"step-{steps:06d}" / "model" / "config.json").exists()
    if reference is not None:
        def same(r: dict) -> dict:
            return {k: v for k, v in r.items() if k not in MEASURED}
        assert [same(r) for r in rows] == [same(r) for r in metrics(reference)]
        assert ledger_state(run) == ledger_state(reference)
        assert by_step == trained_by_step(reference)
        (weights, optim), (want_w, want_o) = final_state(run, steps), final_state(reference, steps)
        assert_bitwise_equal(weights, want_w, "weights")
        assert_bitwise_equal(optim, want_o, "optimizer state")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    done = train(run, 3)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_uninterrupted_runs_end_with_the_same_bits(tmp_path: Path, reference: Path) -> None:
    """The premise of every comparison below: nothing but time differs between two runs."""
    run = tmp_path / "run"
    done = train(run, 3)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_like_uninterrupted(run, 3, reference)


@pytest.mark.timeout(600)
def test_a_kill_with_rollouts_in_flight_resumes_to_the_uninterrupted_runs_bits(tmp_path: Path,
                                                                              reference: Path) -> None:
    """Killed just after step 2 committed: step 3's rollouts are running, and run again on resume
    with their own seeds. (Every other point, and the reported bug's moment -- step 2's checkpoint on
    disk, its metrics line not -- are in the slow sweep below.)"""
    run = tmp_path / "run"
    crash_then_resume(run, 3, "rl.after_ledger_commit:2")
    before = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    assert any(e.get("reason") == "re-run after restart" for e in before)
    assert_like_uninterrupted(run, 3, reference)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("at", [1, 2, 3])
def test_every_crash_point_resumes_to_the_uninterrupted_run(tmp_path: Path, reference: Path, point: str,
                                                            at: int) -> None:
    run = tmp_path / "run"
    crash_then_resume(run, 3, f"{point}:{at}")
    assert_like_uninterrupted(run, 3, reference)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_steps_past_the_last_checkpoint_are_trained_and_logged_once(tmp_path: Path, reference: Path) -> None:
    """With a checkpoint every 2 steps, a kill after step 3's line resumes
    from step 2's checkpoint: step 3 is trained again, and its first line is
    cut rather than kept beside the second."""
    run = tmp_path / "run"
    crash_then_resume(run, 3, "rl.after_metrics:3", "trainer.checkpoint_every=2")
    assert_like_uninterrupted(run, 3, reference)
