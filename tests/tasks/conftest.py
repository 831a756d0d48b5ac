"""Fixtures for task tests: a tiny task written inside the test (package
`calc` whose `add` subtracts), patches made with difflib, a shared venv
cache, and a skip when bubblewrap cannot run."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Callable

import pytest

OPS = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
OPS_FIXED = OPS.replace("return a - b", "return a + b", 1)

REPO = {
    "calc/__init__.py": "from calc.ops import add, sub\n",
    "calc/ops.py": OPS,
    "tests/test_base.py": "from calc import sub\n\n\ndef test_sub_zero():\n    assert sub(3, 0) == 3\n",
}

HIDDEN = {
    "tests/test_calc.py": (
        "import pytest\n\nfrom calc import add, sub\n\n\n"
        "def test_add():\n    assert add(2, 3) == 5\n\n\n"
        "class TestSub:\n    @pytest.mark.parametrize('a,b,c', [(5, 3, 2), (1, 1, 0)])\n"
        "    def test_sub(self, a, b, c):\n        assert sub(a, b) == c\n"
    ),
}

F2P = ["tests/test_calc.py::test_add"]
P2P = ["tests/test_calc.py::TestSub::test_sub[5-3-2]", "tests/test_calc.py::TestSub::test_sub[1-1-0]",
       "tests/test_base.py::test_sub_zero"]


def make_patch(changes: dict[str, tuple[str | None, str | None]]) -> str:
    """A git-applicable diff from {path: (old text or None, new text or None)}."""
    out = []
    for path, (old, new) in changes.items():
        header = []
        if old is None:
            header = [f"diff --git a/{path} b/{path}\n", "new file mode 100644\n"]
        out += header + list(difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
            fromfile="/dev/null" if old is None else f"a/{path}",
            tofile="/dev/null" if new is None else f"b/{path}"))
    return "".join(out)


GOLD = make_patch({"calc/ops.py": (OPS, OPS_FIXED)})


def toml_value(v: object) -> str:
    import json
    return json.dumps(v)


def write_task(root: Path, *, toml: str | None = None, repo: dict | None = None,
               hidden: dict | None = None, gold: str | None = GOLD, **fields: object) -> Path:
    """Write a task directory; `fields` override top-level keys of task.toml
    (a value None drops the key); `toml` replaces the whole file."""
    for rel, text in (REPO if repo is None else repo).items():
        (root / "repo" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "repo" / rel).write_text(text)
    for rel, text in (HIDDEN if hidden is None else hidden).items():
        (root / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "tests" / rel).write_text(text)
    if gold is not None:
        (root / "gold.patch").write_text(gold)
    if toml is None:
        top = {"id": root.name, "prompt": "add() is wrong; fix it.",
               "hidden_tests": list(HIDDEN), "fail_to_pass": F2P, "pass_to_pass": P2P}
        top.update(fields)
        toml = "".join(f"{k} = {toml_value(v)}\n" for k, v in top.items() if v is not None)
        toml += ('\n[env]\nkind = "python"\npython = "3.11"\nrequirements = []\n'
                 "system_site_packages = true\n"
                 '\n[metadata]\nsource = "test"\ncategory = "wrong-operator"\n'
                 "files_changed = 1\nlines_changed = 1\n\n[limits]\ntimeout_s = 30\n")
    (root / "task.toml").write_text(toml)
    return root


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    return write_task(tmp_path / "calc-add")


@pytest.fixture
def task_factory(tmp_path: Path) -> Callable[..., Path]:
    def make(name: str = "calc-add", **kw: object) -> Path:
        return write_task(tmp_path / name, **kw)
    return make


@pytest.fixture(scope="session")
def env_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One venv cache for the session: the calc env is built once. It is
    laid out as `$ATELIER_CACHE/envs`, so the CLI can share it."""
    envs = tmp_path_factory.mktemp("cache") / "envs"
    envs.mkdir()
    return envs


class Helpers:
    make_patch = staticmethod(make_patch)
    write_task = staticmethod(write_task)
    OPS, OPS_FIXED, GOLD, REPO, HIDDEN, F2P, P2P = OPS, OPS_FIXED, GOLD, REPO, HIDDEN, F2P, P2P


@pytest.fixture
def h() -> type[Helpers]:
    return Helpers
