"""Fixtures for the harness tests: a small buggy project, a real bubblewrap
sandbox over it, tool contexts, and the tiny ChatML tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from atelier.sandbox import SandboxConfig

CALC = '''"""Small arithmetic helpers."""


def add(a, b):
    return a - b


def mul(a, b):
    return a * b


def scale(values, factor):
    return [mul(v, factor) for v in values]
'''

TESTS = '''import unittest

from pkg.calc import add, mul, scale


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mul(self):
        self.assertEqual(mul(2, 3), 6)

    def test_scale(self):
        self.assertEqual(scale([1, 2], 3), [3, 6])


if __name__ == "__main__":
    unittest.main()
'''

REPO_FILES: dict[str, str | bytes] = {
    "README.md": "# calc\n\nArithmetic helpers. Run the tests with `python3 -m unittest`.\n",
    "pkg/__init__.py": "",
    "pkg/calc.py": CALC,
    "pkg/http_headers.py": "def parse_header_line(line):\n    name, _, value = line.partition(':')\n"
                           "    return name.strip().lower(), value.strip()\n",
    "tests/__init__.py": "",
    "tests/test_calc.py": TESTS,
    "docs/notes.txt": "value = 1\nvalue = 1\nother\n",
    "data.bin": bytes(range(256)),
}

TEST_COMMAND = "python3 -m unittest -q tests.test_calc"


def write_repo(root: Path, files: dict[str, str | bytes] = REPO_FILES) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return write_repo(tmp_path / "repo")


@pytest.fixture
def backend() -> str:
    """The sandbox backend of `sandbox`; test modules may parametrize it."""
    return "bwrap"


@pytest.fixture
def sandbox(repo: Path, backend: str, request: pytest.FixtureRequest):
    from atelier.sandbox import create_sandbox

    if backend == "bwrap":
        request.getfixturevalue("bwrap_ready")
    sb = create_sandbox(repo, SandboxConfig(backend=backend, timeout_s=30))
    try:
        yield sb
    finally:
        sb.close()


@pytest.fixture
def ctx(sandbox):
    from atelier.harness.tools import ToolContext

    return ToolContext(sandbox)


@pytest.fixture
def call(ctx):
    """call(name, **arguments) -> ToolOutcome, through the real registry and checks."""
    from atelier.harness.tools import call_tool, default_tools

    tools = default_tools()

    def run(name: str, **arguments: Any):
        return call_tool(tools, ctx, name, arguments)

    return run


@pytest.fixture(scope="session")
def tokenizer():
    from atelier.inference.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()
