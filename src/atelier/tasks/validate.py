"""Check that tasks are sound: the gold patch passes every time, the empty
patch fails.

Example: `atelier tasks validate suites/mutations --runs 3 --json`.

A task is valid when `grade(task, gold)` gives reward 1 in each of `runs`
runs (default 3: a gold patch that passes only sometimes means a flaky test
or a drifted dependency, see docs/pitfalls.md) and `grade(task, "")` gives reward 0
(else the task asks for nothing). A task directory that does not load is
invalid too, with the loader's message as the reason (so is one whose
environment cannot be built).

`check_task` runs the sandboxes; `reason` and `summarize` are pure, so the
verdicts are tested without running anything.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from atelier.config import ConfigError, load_config
from atelier.tasks.grade import grade
from atelier.tasks.loader import INDEX_FILE, TASK_FILE, SuiteIndex, load_task
from atelier.tasks.schema import Task, TaskError


@dataclasses.dataclass(frozen=True)
class RunOutcome:
    """One grading run, reduced to what the verdict needs."""

    reward: float
    error: str | None = None
    infra_error: bool = False
    tampered: bool = False
    tamper_suspect: tuple[str, ...] = ()
    tamper: tuple[str, ...] = ()
    """Why the run was `tampered` (a wrong canary is named here)."""
    canaries_ok: bool | None = None
    """`GradeResult.canaries_ok`: None when the canaries were not checked."""
    failed: tuple[str, ...] = ()
    """Target tests that did not pass, as "node (status)" (the first few)."""


@dataclasses.dataclass(frozen=True)
class TaskCheck:
    id: str
    gold: tuple[RunOutcome, ...] = ()
    empty: RunOutcome | None = None
    error: str | None = None
    """Set when the task did not load or its environment could not be built
    (a `TaskError`); nothing was graded then."""


def reason(check: TaskCheck) -> str | None:
    """Why the task is invalid, or None when it is valid."""
    if check.error is not None:
        return f"cannot be checked: {check.error}"
    if not check.gold:
        return "the gold patch was never graded"
    failed = [(i, r) for i, r in enumerate(check.gold, 1) if r.reward != 1.0]
    if failed:
        i, first = failed[0]
        what = "infrastructure error" if first.infra_error else "reward {:g}".format(first.reward)
        why = first.error or ("not passed: " + ", ".join(first.failed) if first.failed else None)
        detail = f" ({what}: {why})" if why else f" ({what})"
        flaky = " (flaky: passed in the other runs)" if len(failed) < len(check.gold) else ""
        return (f"gold patch failed in {len(failed)} of {len(check.gold)} run(s){flaky}; "
                f"first in run {i}{detail}")
    if check.empty is None:
        return "the empty patch was never graded"
    if check.empty.reward != 0.0:
        return "the empty patch already passes: fail_to_pass tests do not fail at base"
    if check.empty.infra_error:
        return f"the empty patch run hit an infrastructure error: {check.empty.error}"
    return None


def grade_flags(check: TaskCheck) -> dict:
    """What each grading of `check` gave, for a build report that drops the
    task: `{"tampered": any gold or empty run tampered, "tamper_suspect":
    any run flagged by the static screen, "grades": [{"run": "gold 1" ...
    "empty", "reward", "error", "infra_error", "tampered", "tamper",
    "tamper_suspect", "canaries_ok", "failed"}]}`. A gold patch dropped with
    `tampered` set is a false positive of the grader, not a bad task."""
    runs = [(f"gold {i}", r) for i, r in enumerate(check.gold, 1)]
    runs += [("empty", check.empty)] if check.empty is not None else []
    return {"tampered": any(r.tampered for _, r in runs),
            "tamper_suspect": any(r.tamper_suspect for _, r in runs),
            "grades": [{"run": name, **dataclasses.asdict(r), "tamper": list(r.tamper),
                        "tamper_suspect": list(r.tamper_suspect), "failed": list(r.failed)}
                       for name, r in runs]}


def summarize(results: Iterable[TaskCheck]) -> dict:
    """`{"tasks": n, "valid": k, "invalid": [{"id", "reason"}], "flaky": m,
    "runs": r, "tampered": [ids], "tamper_suspect": [ids]}` over the checks
    (r: the most gold runs of any task; `tampered`: tasks whose gold patch
    was graded tampered in some run, false positives of the grader;
    `tamper_suspect`: tasks whose gold patch the static screen flags)."""
    results = list(results)
    invalid = [{"id": c.id, "reason": why} for c in results if (why := reason(c)) is not None]
    flaky = sum(1 for c in results
                if c.gold and 0 < sum(r.reward == 1.0 for r in c.gold) < len(c.gold))
    return {"tasks": len(results), "valid": len(results) - len(invalid), "invalid": invalid,
            "flaky": flaky, "runs": max((len(c.gold) for c in results), default=0),
            "tampered": [c.id for c in results if any(r.tampered for r in c.gold)],
            "tamper_suspect": [c.id for c in results if any(r.tamper_suspect for r in c.gold)]}


# --- I/O ------------------------------------------------------------------
def task_dirs(path: str | Path) -> list[Path]:
    """`path` itself when it is a task (holds task.toml), else the suite's
    task directories (its index.toml, or every subdirectory with a task.toml)."""
    root = Path(path).resolve()
    if (root / TASK_FILE).is_file():
        return [root]
    if not root.is_dir():
        raise TaskError(f"not a directory: {path}", hint="pass a task directory or a suite of them")
    if (root / INDEX_FILE).is_file():
        try:
            return [root / rel for rel in load_config(SuiteIndex, root / INDEX_FILE).tasks]
        except ConfigError as exc:
            raise TaskError(f"suite {root.name}: {exc.message}", hint=exc.hint) from None
    dirs = sorted(p.parent for p in root.glob(f"*/{TASK_FILE}"))
    if not dirs:
        raise TaskError(f"no tasks found in {root}",
                        hint=f"pass a task directory (with {TASK_FILE}) or a suite of them")
    return dirs


FAILED_SHOWN = 5
"""Failed targets a run outcome keeps (the reason names them)."""


def _outcome(result) -> RunOutcome:
    failed = [f"{node} ({status})" for node, status in result.tests.items() if status != "passed"]
    more = [f"+{len(failed) - FAILED_SHOWN} more"] if len(failed) > FAILED_SHOWN else []
    return RunOutcome(result.reward, result.error, result.infra_error, result.tampered,
                      tuple(result.tamper_suspect), tuple(result.tamper), result.canaries_ok,
                      tuple(failed[:FAILED_SHOWN] + more))


def check_task(task: Task, runs: int = 3, *, backend: str = "bwrap",
               cache_dir: str | None = None, workers: int | None = None) -> TaskCheck:
    """Grade the gold patch `runs` times and the empty patch once, `workers`
    gradings at a time (default: one per CPU). The empty patch's grading
    is not looked at when gold already failed: the task is invalid either way.

    The gradings share nothing but the task's read-only snapshot, so they
    run side by side, and build the same tasks as one at a time
    (docs/log/2026-12-05-dotted-names.md)."""
    def run(patch: str) -> RunOutcome:
        return _outcome(grade(task, patch, backend=backend, cache_dir=cache_dir))

    patches = [task.gold_patch] * runs + [""]
    with ThreadPoolExecutor(max_workers=max(1, min(workers or os.cpu_count() or 1, len(patches)))) as pool:
        *gold, empty = pool.map(run, patches)
    if any(r.reward != 1.0 for r in gold):
        return TaskCheck(task.id, tuple(gold))
    return TaskCheck(task.id, tuple(gold), empty)


def validate(path: str | Path, runs: int = 3, *, backend: str = "bwrap",
             cache_dir: str | None = None,
             on_task: Callable[[TaskCheck], None] | None = None) -> list[TaskCheck]:
    """Check every task under `path` (a task or a suite); `on_task` is
    called after each one (progress)."""
    if runs < 1:
        raise TaskError(f"--runs must be at least 1, got {runs}", hint="use --runs 3")
    checks = []
    for d in task_dirs(path):
        try:
            task = load_task(d)
            check = check_task(task, runs, backend=backend, cache_dir=cache_dir)
        except TaskError as exc:
            check = TaskCheck(d.name, error=exc.message)
        checks.append(check)
        if on_task is not None:
            on_task(check)
    return checks
