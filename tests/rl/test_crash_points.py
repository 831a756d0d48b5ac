"""`atelier train` killed at each named crash point (`ATELIER_CRASH_AT`), then
resumed, ends with the files of an uninterrupted run: one metrics line per
step, in order, none missing and none twice, and the same samples trained at
the same steps.

The bug this guards: the step's checkpoint committed before its metrics line
was written, so a `kill -9` in between left metrics.jsonl without that step
for good (the resumed run went on with the next one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from atelier.rl.ledger import Ledger

RECIPE = Path(__file__).parents[2] / "recipes" / "rl-tiny.toml"
# Sync mode: which samples each step trains, and their rewards, do not depend
# on timing, so a resumed run can be compared with an uninterrupted one.
ARGS = ["rollout.mode=sync", "rollout.groups_per_step=2", "rollout.group_size=2", "rollout.workers=2",
        "rollout.max_tokens=8", "env.toy.tasks=20", "trainer.lr=1e-3"]
SAME = ("step", "reward_mean", "reward_parts", "pass_rate", "best_of_k", "groups", "samples")
"""Fields of a metrics line that an uninterrupted run reproduces exactly (the
loss and logprob statistics differ in the last bits even between two
uninterrupted runs; timings always do)."""

POINTS = ["rl.after_train", "checkpoint.before_rename", "rl.after_checkpoint", "rl.after_publish",
          "rl.after_metrics", "rl.after_ledger_commit"]
RESAMPLED = {"rl.after_ledger_commit": 2}
"""Points where the next step's rollouts are in flight at the kill: they run
again with a new seed (attempt + 1, by design), so metrics past that step
may differ; which slots each step trains may not."""


def train(run: Path, steps: int, *extra: str, crash_at: str | None = None, resume: bool = False
          ) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "atelier.cli.main", "train"]
    argv += ["--resume", str(run)] if resume else [str(RECIPE), "--run-dir", str(run)]
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


def assert_like_uninterrupted(run: Path, steps: int, reference: Path | None = None,
                              exact_until: int | None = None) -> None:
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    by_step = trained_by_step(run)
    assert sorted(by_step) == list(range(1, steps + 1))
    # Each slot's last `trained` event is its only effective one: earlier ones
    # (a step that was not committed) were undone on resume.
    assert (run / "checkpoints" / f"step-{steps:06d}" / "model" / "config.json").exists()
    if reference is not None:
        want = metrics(reference)[:exact_until]
        assert [{k: r[k] for k in SAME} for r in rows[:exact_until]] == [{k: r[k] for k in SAME} for r in want]
        assert by_step == trained_by_step(reference)


@pytest.mark.timeout(600)
def test_a_kill_between_checkpoint_and_metrics_leaves_no_hole(tmp_path: Path) -> None:
    """The reported bug, at its exact moment: step 2's checkpoint is on disk,
    its metrics line is not."""
    run = tmp_path / "run"
    crash_then_resume(run, 2, "rl.after_checkpoint:2")
    assert_like_uninterrupted(run, 2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference") / "run"
    done = train(run, 3)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", POINTS)
def test_every_crash_point_resumes_to_the_uninterrupted_run(tmp_path: Path, reference: Path, point: str) -> None:
    run = tmp_path / "run"
    crash_then_resume(run, 3, f"{point}:2")
    assert_like_uninterrupted(run, 3, reference, exact_until=RESAMPLED.get(point))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_steps_past_the_last_checkpoint_are_trained_and_logged_once(tmp_path: Path, reference: Path) -> None:
    """With a checkpoint every 2 steps, a kill after step 3's line resumes
    from step 2's checkpoint: step 3 is trained again, and its first line is
    cut rather than kept beside the second."""
    run = tmp_path / "run"
    crash_then_resume(run, 3, "rl.after_metrics:3", "trainer.checkpoint_every=2")
    assert_like_uninterrupted(run, 3, reference)
