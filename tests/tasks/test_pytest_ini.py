"""The release builder's pytest command: the project's own pythonpath kept,
coverage and xdist options left out of addopts (pure, plus small files)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from atelier.tasks.pytest_ini import command_for, read_ini, strip_plugin_options, test_command


def test_strip_plugin_options_keeps_everything_else() -> None:
    args = ["--import-mode=importlib", "--no-cov-on-fail", "--cov=semver", "--cov", "pkg",
            "--cov-report", "term-missing", "--doctest-modules", "-n", "auto", "-nauto",
            "--dist=loadfile", "-ra", "--strict-markers", "--cov", "--doctest-glob=*.rst"]
    assert strip_plugin_options(args) == ["--import-mode=importlib", "--doctest-modules", "-ra",
                                          "--strict-markers", "--doctest-glob=*.rst"]
    assert strip_plugin_options(["-v", "--tb=short"]) == ["-v", "--tb=short"]


@pytest.mark.parametrize("ini, src, expected", [
    (None, False, ["python", "-m", "pytest"]),
    (None, True, ["python", "-m", "pytest", "--rootdir=.", "-o", "pythonpath=src"]),
    ({"addopts": [], "pythonpath": ["src", "tests"]}, True, ["python", "-m", "pytest", "--rootdir=."]),
    ({"addopts": [], "pythonpath": ["tests"]}, True,
     ["python", "-m", "pytest", "--rootdir=.", "-o", "pythonpath=tests src"]),
    ({"addopts": ["--color=yes"], "pythonpath": []}, False, ["python", "-m", "pytest"]),
    ({"addopts": ["--cov=x", "--doctest-glob=*.rst"], "pythonpath": []}, False,
     ["python", "-m", "pytest", "-o", "addopts='--doctest-glob=*.rst'"]),  # pytest shlex-splits it
])
def test_command_for(ini, src: bool, expected: list[str]) -> None:
    assert shlex.split(command_for(ini, src)) == expected


def test_read_ini_takes_the_file_pytest_takes(tmp_path: Path) -> None:
    assert read_ini(tmp_path) is None
    (tmp_path / "setup.cfg").write_text("[tool:pytest]\npythonpath = src tests\naddopts =\n"
                                        "    --cov=semver\n    --doctest-glob='*.rst'\n")
    assert read_ini(tmp_path) == {"addopts": ["--cov=semver", "--doctest-glob=*.rst"],
                                  "pythonpath": ["src", "tests"]}
    (tmp_path / "tox.ini").write_text("[tox]\nenvlist = py311\n")  # no [pytest]: not pytest's
    assert read_ini(tmp_path)["pythonpath"] == ["src", "tests"]
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = ["-ra", "--cov"]\n')
    assert read_ini(tmp_path) == {"addopts": ["-ra", "--cov"], "pythonpath": []}
    (tmp_path / "pytest.ini").write_text("[other]\n")  # pytest.ini wins, even without [pytest]
    assert read_ini(tmp_path) == {"addopts": [], "pythonpath": []}
    (tmp_path / "src").mkdir()
    assert test_command(tmp_path, src_layout=True) == ("python -m pytest -p no:benchmark -p no:hypothesispytest"
                                                       " --rootdir=. -o pythonpath=src")


def test_idle_plugins_are_switched_off_unless_mentioned(tmp_path: Path) -> None:
    from atelier.tasks.pytest_ini import idle_plugin_args

    old, other = tmp_path / "old", tmp_path / "new"
    (old / "pkg").mkdir(parents=True)
    (old / "pkg" / "core.py").write_text("def f():\n    return 1\n")
    assert idle_plugin_args(old) == ["-p", "no:benchmark", "-p", "no:hypothesispytest"]
    (other / "tests").mkdir(parents=True)
    (other / "tests" / "test_core.py").write_text("from hypothesis import given\n")
    assert idle_plugin_args(old, other) == ["-p", "no:benchmark"]
    (old / "pyproject.toml").write_text('[project]\noptional-dependencies = {bench = ["pytest-benchmark"]}\n')
    assert idle_plugin_args(old, other) == []
    assert shlex.split(test_command(old, src_layout=False)) == ["python", "-m", "pytest",
                                                                 "-p", "no:hypothesispytest"]
