"""Which tasks an evaluation runs: one task directory, a suite, or a split of one.

A split is either a subdirectory of the suite (`SUITE/test`), itself a
suite, or the tasks the suite's `index.toml` assigns to it (`load_suite`'s
`split`, where the task loader supports it).
"""

from __future__ import annotations

import inspect
from pathlib import Path

from atelier.eval.records import EvalError
from atelier.tasks.loader import TASK_FILE, load_suite, load_task
from atelier.tasks.schema import Task


def load_tasks(path: str | Path, split: str | None = None) -> list[Task]:
    root = Path(path)
    if not root.is_dir():
        raise EvalError(f"tasks directory not found: {path}",
                        hint="pass a task directory (with task.toml) or a suite of them")
    if split:
        sub = root / split
        if not sub.is_dir():
            if "split" in inspect.signature(load_suite).parameters:
                return load_suite(root, split=split)
            have = sorted(p.name for p in root.iterdir() if p.is_dir() and not (p / TASK_FILE).is_file())
            raise EvalError(f"suite {root} has no split {split!r} ({sub} is not a directory)",
                            hint=f"splits here: {', '.join(have)}" if have else
                            "leave out --split to evaluate every task of the suite")
        root = sub
    if (root / TASK_FILE).is_file():
        return [load_task(root)]
    return load_suite(root)
