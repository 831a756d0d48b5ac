"""Helpers that tests of several packages share (plain functions; fixtures stay in conftest.py).

Waits tell a hang from progress: their timeouts are generous bounds for a loaded
2-core machine, and no test asserts how long anything took.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import subprocess
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Callable

from atelier.tasks.schema import PythonEnv, TaskLimits, TaskMetadata, TaskSpec
from atelier.tasks.writer import write_task

ROOT = Path(__file__).parents[1]


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, *, interval: float = 0.02,
               process: subprocess.Popen | None = None) -> bool:
    """Poll `predicate` until it is true (True) or `timeout` seconds pass (False). With `process`,
    fail at once, with what it printed, if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if process is not None and process.poll() is not None:
            out, err = process.communicate()
            raise AssertionError(f"the process exited with status {process.returncode} first:\n"
                                 f"{(err or out or '')[-3000:]}")
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def rank_env() -> dict[str, str]:
    """What a test's trainer ranks get on top of the test's environment: this checkout first on the
    path (tests import `tests.*`), one thread each."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


# --- a suite of two small tasks ------------------------------------------------------

OPS = ("def add(a, b):\n    return a - b\n\n\n"
       "def mul(a, b):\n    return a + b\n\n\n"
       "def sub(a, b):\n    return a - b\n")
TESTS = ("from calc import add, mul, sub\n\n\n"
         "def test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_mul():\n    assert mul(3, 4) == 12\n\n\n"
         "def test_sub():\n    assert sub(5, 3) == 2\n")


def unified(path: str, old: str, new: str) -> str:
    """A git-style unified diff of one file."""
    return f"diff --git a/{path} b/{path}\n" + "".join(difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}"))


def build_suite(root: Path, source: str = "test") -> Path:
    """Two small tasks (`calc.add` subtracts, `calc.mul` adds: a swapped operator each) in the standard
    task layout, written with the project's own `write_task`; `source` is their metadata's."""
    repo = root / "_repo"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("from calc.ops import add, mul, sub\n")
    (repo / "calc" / "ops.py").write_text(OPS)
    suite = root / "suite"
    fixes = {"calc-add": ("add", OPS.replace("return a - b", "return a + b", 1)),
             "calc-mul": ("mul", OPS.replace("return a + b", "return a * b", 1))}
    for task_id, (name, fixed) in fixes.items():
        spec = TaskSpec(
            id=task_id, prompt=f"{name}() gives wrong answers; fix it.",
            env=PythonEnv(python="3.11", system_site_packages=True),
            hidden_tests=["tests/test_calc.py"],
            fail_to_pass=[f"tests/test_calc.py::test_{name}"],
            pass_to_pass=["tests/test_calc.py::test_sub"],
            metadata=TaskMetadata(source=source, category="wrong-operator", files_changed=1, lines_changed=1),
            limits=TaskLimits(timeout_s=60))
        write_task(suite / task_id, spec, repo, {"tests/test_calc.py": TESTS},
                   unified("calc/ops.py", OPS, fixed))
    return suite


# --- a small repository to mutate ----------------------------------------------------

def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Write `files` (path -> text, dedented) under `root`."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text).lstrip("\n"))
    return root


SHAPES = {
    "shapes/__init__.py": "",
    "shapes/calc.py": '''
        def add(a, b):
            return a + b


        def clamp(x, lo, hi):
            """Keep x within [lo, hi]."""
            if x < lo:
                return lo
            if x > hi:
                return hi
            return x
    ''',
    "shapes/seq.py": '''
        def window(xs, n):
            return [xs[i:i + n] for i in range(len(xs) - n + 1)]


        def both_positive(a, b):
            return a > 0 and b > 0
    ''',
    "tests/test_calc.py": '''
        from shapes.calc import add, clamp


        def test_add():
            assert add(2, 3) == 5
            assert add(-1, 1) == 0


        def test_clamp():
            assert clamp(5, 0, 10) == 5
            assert clamp(-5, 0, 10) == 0
            assert clamp(50, 0, 10) == 10
            assert clamp(0, 0, 10) == 0 and clamp(10, 0, 10) == 10
    ''',
    "tests/test_seq.py": '''
        from shapes.seq import both_positive, window


        def test_window():
            assert window([1, 2, 3, 4], 2) == [[1, 2], [2, 3], [3, 4]]
            assert window([1, 2, 3], 3) == [[1, 2, 3]]


        def test_both_positive():
            assert both_positive(1, 2)
            assert not both_positive(1, -2)
            assert not both_positive(-1, 2)
    ''',
}
"""A package with its own tests, which every test of a function catches a mutation of."""


EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def load_experiment(name: str) -> ModuleType:
    """`experiments/<name>/run.py` as a module (the experiments are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_run", EXPERIMENTS / name / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
