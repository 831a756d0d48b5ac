"""`atelier train` killed with SIGKILL mid-run resumes with no sample trained twice and none lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

from atelier.rl.ledger import Ledger
from tests.helpers import wait_until

STEPS, GROUPS, SIZE = 4, 2, 2
ARGS = [f"trainer.steps={STEPS}", f"rollout.groups_per_step={GROUPS}", f"rollout.group_size={SIZE}",
        "rollout.workers=4", "rollout.max_tokens=8", "env.toy.tasks=40", "env.toy.env_latency_s=0.4",
        "trainer.lr=1e-3"]


def _train(*extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "atelier.cli.main", "train", *extra, "--quiet"]
    for a in ARGS:
        argv += ["--set", a]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_steps(proc: subprocess.Popen, metrics: Path, n: int, limit: float = 240.0) -> None:
    assert wait_until(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= n, limit,
                      interval=0.05, process=proc), "the training process made no progress"


def _wait_for_running(proc: subprocess.Popen, ledger: Path, limit: float = 240.0) -> None:
    assert wait_until(lambda: any(s.state == "running" for s in Ledger.load(ledger).slots.values()), limit,
                      process=proc), "no rollout was ever running"


def test_kill_9_then_resume_trains_every_sample_exactly_once(tmp_path):
    run = tmp_path / "run"
    recipe = Path(__file__).parents[2] / "recipes" / "rl-tiny.toml"
    proc = _train(str(recipe), "--run-dir", str(run))
    _wait_for_steps(proc, run / "metrics.jsonl", 1)
    _wait_for_running(proc, run / "ledger.jsonl")  # after a step, with rollouts in flight
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = Ledger.load(run / "ledger.jsonl")
    in_flight = {s.slot_id for s in before.in_state("running")}
    assert in_flight  # async: rollouts were running when the process died

    resumed = _train(str(recipe), "--run-dir", str(run))   # the same command continues the run
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err

    assert_trained_exactly_once(run, STEPS, GROUPS, SIZE, in_flight)
    assert (run / "checkpoints" / f"step-{STEPS:06d}" / "model" / "config.json").exists()


def assert_trained_exactly_once(run: Path, steps: int, groups: int, size: int, in_flight: set[str]) -> None:
    """The ledger of a resumed run: every sample trained once, in exactly one step, none lost; the
    rollouts in flight at the kill ran again."""
    ledger = Ledger.load(run / "ledger.jsonl")
    counts = ledger.counts()
    assert counts["trained"] == steps * groups * size, counts
    assert counts["queued"] == counts["running"] == counts["graded"] == counts["ready"] == 0
    # single epoch: each task in one group; no group lost, none admitted beyond the steps
    tasks = Counter(g.task_id for g in ledger.groups.values())
    assert max(tasks.values()) == 1 and len(ledger.groups) == steps * groups
    # each step trained exactly `groups` whole groups; no slot in two steps
    by_step: dict[int, set[str]] = defaultdict(set)
    for s in ledger.slots.values():
        by_step[s.step].add(s.group_id)
    assert sorted(by_step) == list(range(1, steps + 1))
    assert all(len(g) == groups for g in by_step.values())
    trained_at: dict[str, set[int]] = defaultdict(set)
    for line in (run / "ledger.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("state") == "trained":
            trained_at[event["slot_id"]].add(event["step"])
    assert all(len(at) == 1 for at in trained_at.values()), trained_at
    # rollouts that were in flight at the kill ran again, at the same attempt (so with the same seed:
    # a kill is not the rollout's failure); their trajectories exist
    requeued = {json.loads(line)["slot_id"] for line in (run / "ledger.jsonl").read_text().splitlines()
                if json.loads(line).get("reason") == "re-run after restart"}
    assert in_flight <= requeued
    for sid in in_flight:
        assert ledger.slots[sid].attempt == 0 and ledger.slots[sid].state == "trained"
    assert all((run / "rollouts" / f"{sid.replace('/', '--')}.json").exists()
               for sid, s in ledger.slots.items() if s.state == "trained")
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(logged)) == list(range(1, steps + 1))
