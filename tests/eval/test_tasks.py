"""Choosing the tasks of an evaluation: a task, a suite, a split (no sandbox)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from atelier.eval.records import EvalError
from atelier.eval.tasks import load_tasks
from atelier.tasks.schema import TaskError
from tests.helpers import build_suite


def test_a_task_a_suite_and_a_split_directory(tmp_path: Path) -> None:
    suite = build_suite(tmp_path)
    assert [t.id for t in load_tasks(suite)] == ["calc-add", "calc-mul"]
    assert [t.id for t in load_tasks(suite / "calc-mul")] == ["calc-mul"]
    split_root = tmp_path / "split"
    shutil.copytree(suite / "calc-add", split_root / "test" / "calc-add")
    shutil.copytree(suite / "calc-mul", split_root / "train" / "calc-mul")
    assert [t.id for t in load_tasks(split_root, "test")] == ["calc-add"]
    with pytest.raises((EvalError, TaskError), match="split 'dev'"):
        load_tasks(split_root, "dev")
    with pytest.raises(EvalError, match="not found"):
        load_tasks(tmp_path / "nope")
