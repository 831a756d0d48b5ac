"""Write a task directory, the one way every builder and importer does it.

`write_task` lays out `task.toml`, `repo/`, `tests/` and `gold.patch` as
`atelier.tasks.schema` describes, then loads the result back so a builder can
never write a task that `load_task` would refuse.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Mapping

from atelier.config import dump_config
from atelier.tasks.loader import TASK_FILE, load_task
from atelier.tasks.schema import Task, TaskError, TaskSpec


def write_task(out_dir: str | Path, spec: TaskSpec, repo: str | Path,
               hidden_tests: Mapping[str, str | bytes], gold_patch: str,
               *, overwrite: bool = False) -> Task:
    """Write `spec` with a copy of `repo` (its `.git` left out: a snapshot
    carries no history) and the hidden test files (repository path → content)
    into `out_dir`, and return it loaded."""
    out = Path(out_dir)
    if out.exists():
        if not overwrite:
            raise TaskError(f"task {spec.id}: {out} already exists",
                            hint="choose another output directory or remove the old task")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(repo, out / "repo", symlinks=True, ignore=shutil.ignore_patterns(".git"))
    for rel, content in hidden_tests.items():
        dest = out / "tests" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            dest.write_bytes(content)
        else:
            dest.write_text(content, encoding="utf-8")
    (out / "gold.patch").write_bytes(gold_patch.encode("utf-8"))
    full = spec.model_copy(update={"hidden_tests": sorted(set(spec.hidden_tests) | set(hidden_tests))})
    (out / TASK_FILE).write_text(dump_config(full), encoding="utf-8")
    return load_task(out)
