"""`atelier eval` killed at each named crash point (`ATELIER_CRASH_AT`), then
resumed with the same command, ends with the files of an uninterrupted run:
the same records line for line, the same trajectories and the same summary,
timings aside.

What this guards: an attempt's record is its commit point. A kill after the
trajectory but before the record must run the attempt again (once, not
twice); a kill after the record must not run it again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import build_suite

POINTS = ["eval.after_meta:1", "eval.after_trajectory:1", "eval.after_trajectory:2",
          "eval.after_record:1", "eval.before_summary:1"]
TIMINGS = {"wall_s", "episode_s", "grade_s", "started", "updated", "finished", "elapsed_s",
           "duration_s", "timings", "latency_s"}
"""Keys whose values are clock readings or durations: they differ between any two runs."""


def untimed(value):
    """`value` with every timing key dropped, at any depth."""
    if isinstance(value, dict):
        return {k: untimed(v) for k, v in value.items() if k not in TIMINGS and not k.endswith("_s")}
    if isinstance(value, list):
        return [untimed(v) for v in value]
    return value


def evaluate(suite: Path, out: Path, cache: Path, crash_at: str | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "atelier.cli", "eval", "--model", "scripted:gold", "--tasks", str(suite),
            "--passes", "1", "--run-dir", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "ATELIER_CRASH_AT"}
    env["ATELIER_CACHE"] = str(cache)
    if crash_at:
        env["ATELIER_CRASH_AT"] = crash_at
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)


def files(run: Path) -> dict[str, object]:
    """Every file of a run directory, parsed, timings aside; `results.jsonl` as its list of lines."""
    out: dict[str, object] = {}
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        rel = str(path.relative_to(run))
        text = path.read_text()
        if path.suffix == ".jsonl":
            out[rel] = [untimed(json.loads(line)) for line in text.splitlines()]
        else:
            out[rel] = untimed(json.loads(text))
    meta = out.get("eval.json")
    if isinstance(meta, dict):
        meta.pop("tasks_source", None)  # the suite's path: one per test
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, bwrap_ready: None, env_cache: str) -> tuple[Path, Path, Path]:
    """The two-task suite, a cache whose venvs are the session's, and an uninterrupted run."""
    root = tmp_path_factory.mktemp("eval-crash")
    suite, cache = build_suite(root), root / "cache"
    cache.mkdir()
    (cache / "envs").symlink_to(env_cache)
    done = evaluate(suite, root / "reference", cache)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = files(root / "reference")
    assert len(reference["results.jsonl"]) == 2 and len([k for k in reference if k.startswith("trajectories/")]) == 2
    return suite, cache, root / "reference"


def crash_then_resume(setup: tuple[Path, Path, Path], run: Path, point: str) -> None:
    suite, cache, reference = setup
    crashed = evaluate(suite, run, cache, crash_at=point)
    assert crashed.returncode == -9, f"never reached {point}: {crashed.stderr[-2000:]}"
    resumed = evaluate(suite, run, cache)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert files(run) == files(reference)


@pytest.mark.timeout(600)
def test_a_kill_between_trajectory_and_record_runs_the_attempt_once_more(setup, tmp_path: Path) -> None:
    """The second attempt's trajectory is on disk, its record is not: resumed,
    it runs again, and results.jsonl holds each attempt once."""
    crash_then_resume(setup, tmp_path / "run", "eval.after_trajectory:2")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", [p for p in POINTS if p != "eval.after_trajectory:2"])
def test_every_crash_point_resumes_to_the_uninterrupted_run(setup, tmp_path: Path, point: str) -> None:
    crash_then_resume(setup, tmp_path / "run", point)
