"""Release-diff tasks: changelog parsing (pure), the F2P/P2P split (pure), and
a real build from two versions of a tiny package written here, graded in
bubblewrap sandboxes. PyPI builds are `slow`."""

from __future__ import annotations

from pathlib import Path

import pytest

from atelier.tasks import load_task
from atelier.tasks.release import build_release_task, changelog_entry, is_test_path, runtime_requirements, split_tests

# --- changelog_entry -------------------------------------------------------------

MD = """# Changelog

## [Unreleased]

## [1.2.0] - 2024-01-01
### Fixed
- `parse` accepts tabs.

## [1.1.0] - 2023-06-01
- Old thing.

[1.2.0]: https://example.com/compare/1.1.0...1.2.0
"""

RST = """Changes
=======

1.2.0 (2024-01-01)
------------------

- Fix ``parse`` on tabs.
- Add ``dump``.

1.1.0 (2023-06-01)
------------------

- Old thing.
"""

PALLETS = """Version 1.2.0
-------------

Released 2024-01-01

-   Fix tabs. :issue:`12`

Version 1.1.0
-------------

Released 2023-06-01

-   Old.
"""

PLAIN = """v1.2.0
  * Fix tabs.
  * Faster.

v1.1.0
  * Old.
"""

TOWNCRIER = """attrs 1.2.0 (2024-01-01)
========================

Changes
-------

- Fix tabs.

attrs 1.1.0 (2023-06-01)
========================

- Old.
"""


@pytest.mark.parametrize("text, expected", [
    (MD, "### Fixed\n- `parse` accepts tabs."),
    (RST, "- Fix ``parse`` on tabs.\n- Add ``dump``."),
    (PALLETS, "-   Fix tabs. :issue:`12`"),
    (PLAIN, "  * Fix tabs.\n  * Faster."),
    (TOWNCRIER, "Changes\n-------\n\n- Fix tabs."),
    ("## 1.1.0\n\n- a\n\n## 1.2.0\n\n- b\n", "- b"),
    ("### v1.2 (2024-01-01)\n\n* b\n\n### v1.1\n* a\n", "* b"),
    ("1.2.0 - 2024-01-01\n\n- b\n\n1.1.0 - 2023-01-01\n\n- a\n", "- b"),
    # reST link headings, as PyJWT writes them
    ("`Unreleased <https://x/compare/1.2.0...HEAD>`__\n------\n\n"
     "`v1.2.0 <https://x/compare/1.1.0...1.2.0>`__\n------\n\nFixed\n~~~~~\n\n- b\n\n"
     "`v1.1.0 <https://x/compare/1.0.0...1.1.0>`__\n------\n\n- a\n", "Fixed\n~~~~~\n\n- b"),
])
def test_changelog_entry_formats(text: str, expected: str) -> None:
    assert changelog_entry(text, "1.2.0") == expected


def test_changelog_entry_missing_or_empty() -> None:
    assert changelog_entry(MD, "9.9.9") is None
    assert changelog_entry("## 1.2.0\n\n## 1.1.0\n- a\n", "1.2.0") is None
    # a version named in prose is not a heading
    assert changelog_entry("Upgrade to 1.2.0 soon.\n\n## 1.1.0\n- a\n", "1.2.0") is None
    assert changelog_entry(RST, "1.1.0") == "- Old thing."


def test_changelog_versions_compare_normalised() -> None:
    assert changelog_entry("## 1.2\n- b\n## 1.1\n- a\n", "1.2.0") == "- b"
    assert changelog_entry("## 2.0.0rc1\n- b\n", "2.0.0-rc.1") == "- b"


# --- pure helpers ------------------------------------------------------------------

def test_test_paths() -> None:
    assert is_test_path("tests/data/x.json") and is_test_path("src/pkg/tests/test_a.py")
    assert is_test_path("conftest.py") and is_test_path("pkg/util_test.py")
    assert not is_test_path("pkg/testing.py") and not is_test_path("pkg/contest.py")


def test_split_tests_drops_flaky() -> None:
    base = [{"a": "failed", "b": "passed", "c": "passed", "e": "passed"}] * 3
    base = [*base[:2], {"a": "failed", "b": "passed", "c": "failed", "e": "passed"}]
    gold = [{"a": "passed", "b": "passed", "c": "passed", "d": "passed", "e": "failed"}] * 3
    f2p, p2p, flaky = split_tests(base, gold)
    assert (f2p, p2p, flaky) == (["a", "d"], ["b"], ["c"])
    inherited = [{"t/test_a.py::A::x": "passed", "t/__init__.py::A::y": "passed"}] * 3
    assert split_tests(inherited, inherited, ["t/test_a.py"]) == ([], ["t/test_a.py::A::x"], [])


def test_runtime_requirements() -> None:
    reqs = ["attrs>=21", "tomli; python_version < '3.11'", "rich; extra == 'cli'",
            "pytest-mock; extra == 'tests'", "mypkg-core", "zipp>=3; python_version >= '3.8'"]
    assert runtime_requirements(reqs, "3.11", exclude="MyPkg_Core") == [
        "attrs>=21", "pytest-mock", "zipp>=3"]


# --- a real build from two local releases -------------------------------------------

V1 = {
    "pyproject.toml": '[project]\nname = "tinyfmt"\nversion = "1.0.0"\n',
    "tinyfmt/__init__.py": "def pad(s, n):\n    return s.ljust(n - 1)\n\n\ndef shout(s):\n    return s.upper()\n",
    "tests/test_fmt.py": "from tinyfmt import shout\n\n\ndef test_shout():\n    assert shout('a') == 'A'\n",
    "CHANGES.md": "# Changes\n\n## 1.0.0\n\n- First release.\n",
}
V2 = {
    "pyproject.toml": '[project]\nname = "tinyfmt"\nversion = "1.1.0"\n',
    "tinyfmt/__init__.py": "def pad(s, n):\n    return s.ljust(n)\n\n\ndef shout(s):\n    return s.upper()\n",
    "tests/test_fmt.py": "from tinyfmt import pad, shout\n\n\ndef test_shout():\n    assert shout('a') == 'A'\n"
                         "\n\ndef test_pad():\n    assert pad('a', 3) == 'a  '\n",
    "tests/test_more.py": "from tinyfmt import pad\n\n\ndef test_pad_zero():\n    assert pad('ab', 4) == 'ab  '\n",
    "CHANGES.md": "# Changes\n\n## 1.1.0 (2024-05-01)\n\n- `pad` pads to the full width.\n\n"
                  "## 1.0.0\n\n- First release.\n",
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture
def releases(tmp_path: Path) -> tuple[Path, Path]:
    return write_tree(tmp_path / "v1", V1), write_tree(tmp_path / "v2", V2)


@pytest.mark.usefixtures("bwrap_ready")
def test_build_from_local_dirs_grades_gold_one_empty_zero(releases, tmp_path: Path, env_cache: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from atelier.tasks.grade import grade
    from atelier.tasks.release import sandbox_runner

    monkeypatch.setenv("ATELIER_CACHE", str(env_cache.parent))
    lines: list[str] = []
    old, new = releases
    report = build_release_task(old, new, tmp_path / "out", requirements=[],
                                runner=sandbox_runner(cache_dir=str(env_cache)),
                                timeout_s=60, progress=lines.append)
    assert report.dropped is None, report
    assert report.test_runs == 6 and any("on gold (3/3)" in ln for ln in lines)
    task = load_task(report.task_dir)
    assert task.id == "tinyfmt-1.0.0-to-1.1.0"
    assert task.prompt == "- `pad` pads to the full width."
    assert task.fail_to_pass == ["tests/test_fmt.py::test_pad", "tests/test_more.py::test_pad_zero"]
    assert task.pass_to_pass == ["tests/test_fmt.py::test_shout"]
    assert sorted(task.hidden_tests) == ["tests/test_fmt.py", "tests/test_more.py"]
    assert "tinyfmt/__init__.py" in task.gold_patch and "tests/" not in task.gold_patch
    assert (task.snapshot / "tests/test_fmt.py").read_text() == V1["tests/test_fmt.py"]
    assert task.metadata.source == "release-diff"
    good = grade(task, task.gold_patch, cache_dir=str(env_cache))
    assert good.reward == 1.0, (good.error, good.log_tail)
    empty = grade(task, "", cache_dir=str(env_cache))
    assert empty.reward == 0.0


def test_no_changelog_entry_is_dropped_with_reason(releases, tmp_path: Path) -> None:
    old, new = releases
    (new / "CHANGES.md").write_text("# Changes\n\n## 1.0.0\n\n- First release.\n")

    def never(task, patch):  # the changelog is checked before any test runs
        raise AssertionError("ran tests")

    report = build_release_task(old, new, tmp_path / "out", requirements=[], runner=never)
    assert report.task_dir is None
    assert report.dropped == "no changelog entry for 1.1.0 (CHANGES.md)"
    assert not (tmp_path / "out").exists()


def test_no_failing_test_is_dropped_with_reason(releases, tmp_path: Path) -> None:
    old, new = releases

    def all_pass(task, patch):
        return {"tests/test_fmt.py::test_shout": "passed"}

    report = build_release_task(old, new, tmp_path / "out", requirements=[], runner=all_pass)
    assert report.dropped is not None and report.dropped.startswith("no test fails at 1.0.0")
    assert report.test_runs == 6


def test_cli_release_diff_local(releases, tmp_path: Path, capsys, monkeypatch) -> None:
    from atelier.cli import main as cli

    old, new = releases
    (new / "CHANGES.md").write_text("nothing\n")
    with pytest.raises(SystemExit) as exc:
        cli.main(["tasks", "build", "release-diff", "--old-dir", str(old), "--new-dir", str(new),
                  "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert exc.value.code == 1 and "dropped tinyfmt-1.0.0-to-1.1.0: no changelog entry" in out


def test_cli_needs_a_source(tmp_path: Path, capsys) -> None:
    from atelier.cli import main as cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["tasks", "build", "release-diff", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--package" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.usefixtures("bwrap_ready")
def test_build_from_pypi(tmp_path: Path) -> None:
    """cachetools 5.1.0 → 5.2.0 adds `keys.methodkey` and `cache_clear`, with tests."""
    from atelier.tasks.grade import grade
    from atelier.tasks.release import build_from_pypi

    report = build_from_pypi("cachetools", "5.1.0", "5.2.0", tmp_path / "out", timeout_s=300)
    assert report.dropped is None, report
    task = load_task(report.task_dir)
    assert "methodkey" in task.prompt and task.fail_to_pass
    assert grade(task, task.gold_patch).reward == 1.0
    assert grade(task, "").reward == 0.0


@pytest.mark.slow
def test_unknown_pypi_version_is_a_task_error(tmp_path: Path) -> None:
    from atelier.tasks.release import build_from_pypi
    from atelier.tasks.schema import TaskError

    with pytest.raises(TaskError, match="no source distribution of cachetools==0.0.99"):
        build_from_pypi("cachetools", "0.0.99", "5.2.0", tmp_path)


def test_find_changelog(tmp_path: Path) -> None:
    from atelier.tasks.release import find_changelog

    write_tree(tmp_path, {"CHANGES.rst": "", "README.md": "", "docs/versions.rst": "",
                          "docs/api.rst": "", "docs/history.md": ""})
    assert [p.relative_to(tmp_path).as_posix() for p in find_changelog(tmp_path)] == [
        "CHANGES.rst", "docs/history.md", "docs/versions.rst"]
    # deeper in docs/ (soupsieve, h11), after the shallow ones; not in _static or too deep
    write_tree(tmp_path, {"docs/src/markdown/about/changelog.md": "", "doc/source/changes.rst": "",
                          "docs/_static/changes.txt": "", "docs/a/b/c/d/changelog.md": "",
                          "docs/src/markdown/index.md": ""})
    assert [p.relative_to(tmp_path).as_posix() for p in find_changelog(tmp_path)] == [
        "CHANGES.rst", "docs/history.md", "docs/versions.rst", "docs/src/markdown/about/changelog.md",
        "doc/source/changes.rst"]


def test_existing_task_dir_is_refused_before_running(releases, tmp_path: Path) -> None:
    from atelier.tasks.schema import TaskError

    old, new = releases
    (tmp_path / "out" / "tinyfmt-1.0.0-to-1.1.0").mkdir(parents=True)
    with pytest.raises(TaskError, match="already exists"):
        build_release_task(old, new, tmp_path / "out", requirements=[], runner=None)


def test_changelog_entry_one_bullet_per_release() -> None:
    text = ("- 0.8.8: Python 3.9 support.\n  New formats: ``html``.\n- 0.8.7: Bug fixes.\n"
            "- 0.8.6: Stop supporting 3.3.\n")
    assert changelog_entry(text, "0.8.8") == "Python 3.9 support.\nNew formats: ``html``."
    assert changelog_entry(text, "0.8.7") == "Bug fixes."
    assert changelog_entry(text, "0.9.0") is None
