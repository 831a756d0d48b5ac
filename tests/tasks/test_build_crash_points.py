"""`atelier tasks build` killed at each named crash point (`ATELIER_CRASH_AT`),
then run again with the same command, ends with the suite of an uninterrupted
build: the same task directories byte for byte, the same index, the same
state, and a report with the same tasks, drops and splits.

What this guards: a task renamed into the suite before its state was
recorded (kept on resume, but missing from `state.json`), and files past the
last task (index, report) that must be rebuilt, not trusted."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_suite import MUT, SPEC, V1, V2, V3, write_tree

POINTS = ["tasks_build.after_task:1", "tasks_build.after_state:1", "tasks_build.after_task:2",
          "tasks_build.after_state:2", "tasks_build.after_entry:1", "tasks_build.before_index:1",
          "tasks_build.after_index:1"]
DEFAULT = "tasks_build.after_task:1"


def build(spec: Path, out: Path, cache: Path, crash_at: str | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "atelier.cli", "tasks", "build", "--suite", str(spec), "--out", str(out),
            "--json"]
    env = {k: v for k, v in os.environ.items() if k != "ATELIER_CRASH_AT"}
    env["ATELIER_CACHE"] = str(cache)
    if crash_at:
        env["ATELIER_CRASH_AT"] = crash_at
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)


def suite_files(out: Path) -> dict[str, object]:
    """What a build leaves, comparable across builds: every task file by hash,
    the index and state, and the report's tasks, drops and splits (not which
    run built a task: `built` and `kept` differ by design)."""
    tasks = {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(out.rglob("*")) if p.is_file() and not p.relative_to(out).parts[0].startswith(".")
             and p.parent != out}
    report = json.loads((out / "build-report.json").read_text())
    entries = [{"key": e["key"], "tasks": sorted(e["kept"] + e["built"]), "dropped": e["dropped"],
                "candidates_dropped": e["candidates_dropped"], "error": e["error"]} for e in report["entries"]]
    return {"tasks": tasks, "index": (out / "index.toml").read_text(),
            "state": json.loads((out / ".atelier-build" / "state.json").read_text()),
            "staging": sorted(p.name for p in (out / ".atelier-build" / "staging").glob("*")),
            "splits": report["splits"], "entries": entries}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, bwrap_ready: None, env_cache: Path) -> tuple[Path, Path, Path]:
    """The tiny spec of test_suite (two local releases, one dropped; one
    mutation task), the session's cache, and an uninterrupted build."""
    root = tmp_path_factory.mktemp("build-crash")
    for name, files in (("v1", V1), ("v2", V2), ("v3", V3), ("shapes", MUT)):
        write_tree(root / "spec" / name, files)
    spec = root / "spec" / "tiny.toml"
    spec.write_text(SPEC)
    cache = env_cache.parent
    done = build(spec, root / "reference", cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["built"] == 2
    return spec, cache, root / "reference"


def crash_then_resume(setup: tuple[Path, Path, Path], out: Path, point: str) -> None:
    spec, cache, reference = setup
    crashed = build(spec, out, cache, crash_at=point)
    assert crashed.returncode == -9, f"never reached {point}: {crashed.stderr[-2000:]}"
    resumed = build(spec, out, cache)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert suite_files(out) == suite_files(reference)


@pytest.mark.timeout(900)
def test_a_kill_after_a_task_lands_before_its_state_resumes_to_the_uninterrupted_build(setup, tmp_path) -> None:
    crash_then_resume(setup, tmp_path / "out", DEFAULT)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("point", [p for p in POINTS if p != DEFAULT])
def test_every_crash_point_resumes_to_the_uninterrupted_build(setup, tmp_path: Path, point: str) -> None:
    crash_then_resume(setup, tmp_path / "out", point)
