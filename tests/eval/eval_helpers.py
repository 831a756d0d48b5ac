"""A suite of two small tasks written inside a test (`calc.add` subtracts;
`calc.mul` adds), built with the project's own `write_task`."""

from __future__ import annotations

import difflib
from pathlib import Path

from atelier.tasks.schema import PythonEnv, TaskLimits, TaskMetadata, TaskSpec
from atelier.tasks.writer import write_task

OPS = ("def add(a, b):\n    return a - b\n\n\n"
       "def mul(a, b):\n    return a + b\n\n\n"
       "def sub(a, b):\n    return a - b\n")
TESTS = ("from calc import add, mul, sub\n\n\n"
         "def test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_mul():\n    assert mul(3, 4) == 12\n\n\n"
         "def test_sub():\n    assert sub(5, 3) == 2\n")


def unified(path: str, old: str, new: str) -> str:
    return f"diff --git a/{path} b/{path}\n" + "".join(difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}"))


def build_suite(root: Path) -> Path:
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
            metadata=TaskMetadata(source="test", category="wrong-operator", files_changed=1, lines_changed=1),
            limits=TaskLimits(timeout_s=60))
        write_task(suite / task_id, spec, repo, {"tests/test_calc.py": TESTS},
                   unified("calc/ops.py", OPS, fixed))
    return suite
