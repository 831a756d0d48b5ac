"""Grading for real: a tiny `calc` task in bubblewrap sandboxes, with patches
that try to cheat. The venv (requirements [], the base interpreter's pytest
through system site-packages) is built once per session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atelier.cli import main as cli
from atelier.failures import is_infra, is_out_of_memory
from atelier.sandbox import SandboxOutOfMemory, create_sandbox
from atelier.tasks import load_task
from atelier.tasks.envs import MARKER, ensure_env, env_mounts
from atelier.tasks.grade import grade

pytestmark = pytest.mark.usefixtures("bwrap_ready")


@pytest.fixture
def task(task_dir: Path):
    return load_task(task_dir)


def run(task, patch: str | None, env_cache: Path, **kw):
    return grade(task, patch, cache_dir=str(env_cache), **kw)


def test_env_is_built_once_and_reused(task, env_cache: Path) -> None:
    venv = ensure_env(task, env_cache)
    assert (venv / MARKER).is_file() and str(venv) in env_mounts(venv)
    stamp = (venv / MARKER).stat().st_mtime_ns
    assert ensure_env(task, env_cache) == venv
    assert (venv / MARKER).stat().st_mtime_ns == stamp


def test_gold_patch_scores_one(task, env_cache: Path) -> None:
    r = run(task, task.gold_patch, env_cache)
    assert r.error is None and r.reward == 1.0, r.log_tail
    assert (r.fail_to_pass.passed, r.fail_to_pass.total) == (1, 1)
    assert (r.pass_to_pass.passed, r.pass_to_pass.total) == (3, 3)
    assert r.tests["tests/test_calc.py::TestSub::test_sub[1-1-0]"] == "passed"


def test_empty_patch_scores_zero(task, env_cache: Path) -> None:
    r = run(task, "", env_cache)
    assert r.reward == 0.0 and r.error is None, r.error
    assert r.tests["tests/test_calc.py::test_add"] == "failed"
    assert r.pass_to_pass.passed == 3


def test_edited_tests_are_restored(task, env_cache: Path, h) -> None:
    cheat = h.HIDDEN["tests/test_calc.py"].replace("assert add(2, 3) == 5", "pass")
    base = h.REPO["tests/test_base.py"]
    patch = h.make_patch({"tests/test_calc.py": (None, cheat),
                          "tests/test_base.py": (base, base.replace("== 3", "== 3 or True"))})
    r = run(task, patch, env_cache)
    assert r.reward == 0.0 and r.tests["tests/test_calc.py::test_add"] == "failed"


def test_printed_passed_lines_count_for_nothing(task, env_cache: Path, h) -> None:
    fake = ("import atexit\natexit.register(print, 'tests/test_calc.py::test_add PASSED')\n" + h.OPS)
    conftest = ("def pytest_terminal_summary(terminalreporter):\n"
                "    terminalreporter.write_line('tests/test_calc.py::test_add PASSED')\n"
                "    terminalreporter.write_line('===== 4 passed in 0.01s =====')\n")
    patch = h.make_patch({"calc/ops.py": (h.OPS, fake), "conftest.py": (None, conftest)})
    r = run(task, patch, env_cache)
    assert "PASSED" in r.log_tail
    assert r.reward == 0.0 and r.tests["tests/test_calc.py::test_add"] == "failed"


def test_agent_conftest_cannot_rewrite_results(task, env_cache: Path, h) -> None:
    forge = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
             "def pytest_runtest_makereport(item, call):\n"
             "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    patch = h.make_patch({"conftest.py": (None, forge), "calc/conftest.py": (None, forge),
                          "pytest.ini": (None, "[pytest]\naddopts = -p calc.conftest\n")})
    r = run(task, patch, env_cache)
    assert r.error is None and r.reward == 0.0
    assert r.tests["tests/test_calc.py::test_add"] == "failed"


def test_exit_zero_before_tests_is_tampered(task, env_cache: Path, h) -> None:
    exits = "import os\nprint('4 passed')\nos._exit(0)\n"
    patch = h.make_patch({"calc/__init__.py": (h.REPO["calc/__init__.py"], exits)})
    r = run(task, patch, env_cache)
    assert r.reward == 0.0 and not r.infra_error and r.tampered
    assert "no closing record" in r.error and r.exit_code is None
    assert any("process exit" in s for s in r.tamper_suspect)


def test_a_patch_that_breaks_the_import_is_wrong_not_tampered(task, env_cache: Path, h) -> None:
    patch = h.make_patch({"calc/ops.py": (h.OPS, h.OPS.replace("def add(a, b):", "def add(a, b)"))})
    r = run(task, patch, env_cache)
    assert r.reward == 0.0 and not r.tampered and not r.infra_error, (r.error, r.tamper)
    assert r.exit_code in (2, 4) and r.error  # a collection error, or its targets "not found"


def test_patch_that_does_not_apply(task, env_cache: Path) -> None:
    r = run(task, task.gold_patch.replace("return a - b", "return a * b"), env_cache)
    assert r.reward == 0.0 and "does not apply" in r.error


def test_timeout_is_infrastructure(task_factory, env_cache: Path, h) -> None:
    task = load_task(task_factory())
    task = task.model_copy(update={"limits": task.limits.model_copy(update={"timeout_s": 2})})
    patch = h.make_patch({"calc/__init__.py": (h.REPO["calc/__init__.py"], "import time\ntime.sleep(30)\n")})
    r = run(task, patch, env_cache)
    assert r.infra_error and r.reward == 0.0 and "timed out after 2 s" in r.error


def _hog(h, mib: int) -> str:
    """calc/ops.py fixed, but `add` first fills `mib` MiB."""
    return h.OPS_FIXED.replace("return a + b", f"x = bytearray({mib} * 1024**2)\n    return a + b + len(x) * 0", 1)


def _kills_for_memory(task) -> bool:
    """Whether one process past the limit is killed here (a memory cgroup);
    otherwise RLIMIT_AS fails its allocation inside it (the watchdog kills
    only where many processes together pass the limit: tests/sandbox)."""
    with create_sandbox(task.snapshot, task.limits.sandbox_config(backend="bwrap")) as probe:
        return probe.memory_enforcement == "cgroup"


def test_memory_hog_patch_scores_zero_not_infra(task_factory, env_cache: Path, h) -> None:
    """The reward-hack route: a patch that allocates until it is killed
    during grading is the patch's failure when the gold patch's run fits
    under the same limit (else a policy would dodge every negative reward:
    infra is retried, then dropped)."""
    task = load_task(task_factory())
    task = task.model_copy(update={"limits": task.limits.model_copy(update={"memory_mb": 256})})
    patch = h.make_patch({"calc/ops.py": (h.OPS, _hog(h, 1024))})
    r = run(task, patch, env_cache)
    assert r.reward == 0.0 and not r.infra_error, r
    if _kills_for_memory(task):
        assert r.oom_killed and is_out_of_memory(r.error) and "gold patch" in r.error, r.error
    else:
        assert r.tests["tests/test_calc.py::test_add"] == "failed" and "MemoryError" in r.log_tail


def test_out_of_memory_is_infrastructure_when_the_gold_does_not_fit(task_factory, env_cache: Path, h) -> None:
    """Where the gold patch is killed under the same limit, the limit is not
    the patch's doing: infra, retried, never scored; grading the gold itself
    (validation) scores 0 and says the limit is too low."""
    gold = h.make_patch({"calc/ops.py": (h.OPS, _hog(h, 1024))})
    task = load_task(task_factory(name="calc-hungry", gold=gold))
    task = task.model_copy(update={"limits": task.limits.model_copy(update={"memory_mb": 256})})
    if not _kills_for_memory(task):
        pytest.skip("no memory cgroup here: RLIMIT_AS fails the allocation instead")
    r = run(task, task.gold_patch, env_cache)
    assert r.reward == 0.0 and r.oom_killed and is_out_of_memory(r.error) and "reference" in r.error, r
    with pytest.raises(SandboxOutOfMemory, match="not the patch's doing") as info:
        run(task, h.make_patch({"calc/ops.py": (h.OPS, _hog(h, 2048))}), env_cache)
    assert is_infra(info.value)


def test_grading_a_live_sandbox_forks_it(task, env_cache: Path, h) -> None:
    from atelier.sandbox import create_sandbox

    venv = ensure_env(task, env_cache)
    config = task.limits.sandbox_config(ro_mounts=env_mounts(venv))
    with create_sandbox(task.snapshot, config) as live:
        live.write_file("calc/ops.py", h.OPS_FIXED)
        live.write_file("tests/test_calc.py", "def test_add():\n    pass\n")  # a cheat
        r = run(task, None, env_cache, sandbox=live)
        assert r.reward == 1.0, (r.error, r.log_tail)
        assert live.read_file("tests/test_calc.py") == "def test_add():\n    pass\n"  # untouched
        assert "tests/test_base.py" not in live.diff()
    # a sandbox that cannot see the env: its diff is graded in a fresh one
    with create_sandbox(task.snapshot, task.limits.sandbox_config()) as bare:
        bare.write_file("calc/ops.py", h.OPS_FIXED)
        assert run(task, None, env_cache, sandbox=bare).reward == 1.0


def cli_ok(*argv: str) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    assert info.value.code == 0


def test_cli_grade_json_and_show(task_dir: Path, env_cache: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("ATELIER_CACHE", str(env_cache.parent))
    empty = tmp_path / "empty.patch"
    empty.write_text("")
    cli_ok("tasks", "grade", str(task_dir), "--patch", str(task_dir / "gold.patch"), "--json")
    out = json.loads(capsys.readouterr().out)
    assert out["reward"] == 1.0 and out["error"] is None
    assert out["tampered"] is False and out["tamper_suspect"] == []
    assert out["fail_to_pass"] == {"passed": 1, "total": 1}
    assert out["pass_to_pass"] == {"passed": 3, "total": 3}
    cli_ok("tasks", "grade", str(task_dir), "--patch", str(empty), "--json")
    assert json.loads(capsys.readouterr().out)["reward"] == 0.0
    cli_ok("tasks", "show", str(task_dir))
    assert "fail_to_pass (1)" in capsys.readouterr().out


def test_cli_bad_input_exits_2(tmp_path: Path, task_dir: Path, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["tasks", "show", str(tmp_path / "nope")])
    assert info.value.code == 2 and "hint:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["tasks", "grade", str(task_dir), "--patch", str(tmp_path / "none.patch")])
    assert info.value.code == 2 and "cannot read patch" in capsys.readouterr().err
