"""Loading tasks and suites: every mistake is a TaskError naming the task,
the field or file, and the fix."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from atelier.errors import AtelierError
from atelier.tasks import TaskError, load_suite, load_task
from atelier.tasks.schema import PythonEnv


def test_a_valid_task_loads(task_dir: Path, h) -> None:
    task = load_task(task_dir)
    assert task.id == "calc-add"
    assert task.snapshot == task_dir.resolve() / "repo"
    assert task.fail_to_pass == h.F2P and task.pass_to_pass == h.P2P
    assert task.gold_patch == h.GOLD
    assert isinstance(task.env, PythonEnv) and task.env.system_site_packages
    assert task.metadata.category == "wrong-operator" and task.limits.timeout_s == 30
    assert task.test_files() == ["tests/test_calc.py", "tests/test_base.py"]
    assert isinstance(TaskError("x"), AtelierError)


def load_error(path: Path) -> TaskError:
    with pytest.raises(TaskError) as info:
        load_task(path)
    return info.value


def test_missing_repo(task_factory) -> None:
    err = load_error(task_factory(repo={}))
    assert "calc-add" in err.message and "repo/" in err.message and err.hint


def test_missing_hidden_test_file(task_factory) -> None:
    err = load_error(task_factory(hidden_tests=["tests/test_calc.py", "tests/test_gone.py"]))
    assert "tests/test_gone.py" in err.message and "hidden_tests" in err.message
    assert "tests/test_gone.py" in err.hint


def test_empty_fail_to_pass(task_factory) -> None:
    err = load_error(task_factory(fail_to_pass=[]))
    assert "fail_to_pass is empty" in err.message and "at least one" in err.hint


def test_malformed_toml(task_factory) -> None:
    err = load_error(task_factory(toml='id = "x"\nprompt = unquoted\n'))
    assert "calc-add" in err.message and "malformed TOML" in err.message and ":2" in err.message


def test_unknown_key_is_named_with_a_suggestion(task_factory) -> None:
    err = load_error(task_factory(fail_to_passs=["x"]))
    assert "unknown key 'fail_to_passs'" in err.message and "fail_to_pass" in err.hint


def test_unknown_env_kind(task_factory, h) -> None:
    toml = 'id = "t"\nprompt = "p"\nfail_to_pass = ["tests/test_base.py::test_sub_zero"]\n[env]\nkind = "conda"\n'
    err = load_error(task_factory(toml=toml))
    assert "env" in err.message and "conda" in err.message


def test_node_id_file_must_exist(task_factory) -> None:
    err = load_error(task_factory(pass_to_pass=["tests/test_nope.py::test_x"]))
    assert "tests/test_nope.py" in err.message


def test_overlapping_lists(task_factory, h) -> None:
    err = load_error(task_factory(pass_to_pass=h.F2P))
    assert "both" in err.message


def test_missing_gold_patch(task_factory) -> None:
    err = load_error(task_factory(gold=None))
    assert "gold.patch" in err.message


def test_gold_patch_keeps_crlf_lines(task_dir: Path) -> None:
    """A patch of a CRLF file must reach `git apply` byte for byte (read
    with universal newlines it no longer applies)."""
    patch = ("diff --git a/make.bat b/make.bat\n--- a/make.bat\n+++ b/make.bat\n"
             "@@ -1 +1 @@\n-@echo off\r\n+@echo on\r\n")
    (task_dir / "gold.patch").write_bytes(patch.encode())
    assert load_task(task_dir).gold_patch == patch


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "-c", "commit.gpgsign=false", *args], check=True, capture_output=True)


def test_snapshot_with_one_commit_is_fine(task_dir: Path) -> None:
    repo = task_dir / "repo"
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    assert load_task(task_dir).id == "calc-add"


def test_snapshot_with_history_is_refused(task_dir: Path) -> None:
    repo = task_dir / "repo"
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    (repo / "calc" / "ops.py").write_text("def add(a, b):\n    return a + b\n")
    git(repo, "commit", "-qam", "the fix")
    git(repo, "reset", "-q", "--hard", "HEAD~1")  # unreachable, still in the object store
    err = load_error(task_dir)
    assert "2 commits" in err.message and "no history" in err.message and "git" in err.hint


def test_suite_by_scanning_and_by_index(tmp_path: Path, h) -> None:
    suite = tmp_path / "suite"
    for name in ("b-task", "a-task"):
        h.write_task(suite / name)
    assert [t.id for t in load_suite(suite)] == ["a-task", "b-task"]
    (suite / "index.toml").write_text('tasks = ["b-task"]\n')
    assert [t.id for t in load_suite(suite)] == ["b-task"]


def test_suite_reports_every_broken_task(tmp_path: Path, h) -> None:
    suite = tmp_path / "suite"
    h.write_task(suite / "ok")
    h.write_task(suite / "bad1", fail_to_pass=[])
    h.write_task(suite / "bad2", id="ok")  # duplicate id
    with pytest.raises(TaskError) as info:
        load_suite(suite)
    assert "2 broken tasks" in info.value.message
    assert "bad1" in info.value.message and "'ok' is used by both" in info.value.message


def test_missing_directories(tmp_path: Path) -> None:
    assert "not found" in load_error(tmp_path / "nope").message
    (tmp_path / "empty").mkdir()
    assert "task.toml" in load_error(tmp_path / "empty").message
    with pytest.raises(TaskError, match="no tasks found"):
        load_suite(tmp_path / "empty")


def test_write_task_round_trips_and_drops_history(tmp_path) -> None:
    import subprocess

    from atelier.tasks.schema import TaskSpec
    from atelier.tasks.writer import write_task

    repo = tmp_path / "src"
    repo.mkdir()
    (repo / "m.py").write_text("x = 1\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    spec = TaskSpec(id="w", prompt="make x two", fail_to_pass=["tests/test_m.py::test_x"])
    task = write_task(tmp_path / "task", spec, repo, {"tests/test_m.py": "def test_x(): pass\n"},
                      "--- a/m.py\n+++ b/m.py\n")
    assert task.hidden_tests == ["tests/test_m.py"]
    assert not (task.snapshot / ".git").exists()
    assert (task.root / "tests" / "tests" / "test_m.py").read_text() == "def test_x(): pass\n"
