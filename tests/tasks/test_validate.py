"""`tasks validate` and `tasks stats`: the pure verdicts and figures, then
real validation of a tiny task written with `write_task` (valid) and a
broken one whose gold patch fixes nothing (invalid, with the reason)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atelier.cli import main as cli
from atelier.tasks.schema import PythonEnv, TaskLimits, TaskMetadata, TaskSpec
from atelier.tasks.stats import patch_stats, suite_stats
from atelier.tasks.validate import RunOutcome, TaskCheck, check_task, grade_flags, reason, summarize, validate
from atelier.tasks.writer import write_task

OK, BAD = RunOutcome(1.0), RunOutcome(0.0, "1 target test(s) missing")


# --- pure ---------------------------------------------------------------
def test_summarize_counts_and_reasons() -> None:
    checks = [
        TaskCheck("good", (OK, OK, OK), RunOutcome(0.0)),
        TaskCheck("flaky", (OK, BAD, OK)),
        TaskCheck("never", (BAD, BAD, BAD)),
        TaskCheck("trivial", (OK, OK, OK), RunOutcome(1.0)),
        TaskCheck("broken", error="task broken: gold.patch is empty"),
        TaskCheck("infra", (RunOutcome(0.0, "timed out", infra_error=True),) * 3),
    ]
    s = summarize(checks)
    assert (s["tasks"], s["valid"], s["flaky"], s["runs"]) == (6, 1, 1, 3)
    why = {bad["id"]: bad["reason"] for bad in s["invalid"]}
    assert set(why) == {"flaky", "never", "trivial", "broken", "infra"}
    assert "1 of 3" in why["flaky"] and "flaky" in why["flaky"] and "run 2" in why["flaky"]
    assert "3 of 3" in why["never"] and "missing" in why["never"]
    lazy = RunOutcome(0.0, failed=("test_six.py::test_lazy (failed)",))  # no error: a target failed
    assert reason(TaskCheck("t", (lazy,) * 3)).endswith("(reward 0: not passed: test_six.py::test_lazy (failed))")
    assert "empty patch already passes" in why["trivial"]
    assert "gold.patch is empty" in why["broken"]
    assert "infrastructure error" in why["infra"]
    assert reason(checks[0]) is None
    assert summarize([]) == {"tasks": 0, "valid": 0, "invalid": [], "flaky": 0, "runs": 0,
                             "tampered": [], "tamper_suspect": []}


def test_grade_flags_name_every_run_and_its_tamper_reasons() -> None:
    canary = "canary test_ab12cd_bad should have failed, got passed"
    tampered = RunOutcome(0.0, "tampered: " + canary, tampered=True, tamper=(canary,), canaries_ok=False)
    flags = grade_flags(TaskCheck("t", (OK, tampered, OK)))
    assert flags["tampered"] is True and flags["tamper_suspect"] is False
    assert [g["run"] for g in flags["grades"]] == ["gold 1", "gold 2", "gold 3"]
    assert flags["grades"][1]["tamper"] == [canary] and flags["grades"][1]["canaries_ok"] is False
    assert flags["grades"][0] == {"run": "gold 1", "reward": 1.0, "error": None, "infra_error": False,
                                  "tampered": False, "tamper_suspect": [], "tamper": [], "canaries_ok": None,
                                  "failed": []}
    json.dumps(flags)  # goes into the build report as is
    suspect = RunOutcome(1.0, tamper_suspect=("six.py:216: sys.modules",), canaries_ok=True)
    flags = grade_flags(TaskCheck("t", (suspect,), RunOutcome(0.0)))
    assert flags["tampered"] is False and flags["tamper_suspect"] is True
    assert [g["run"] for g in flags["grades"]] == ["gold 1", "empty"]


def test_patch_stats_counts_lines_not_headers(h) -> None:
    assert patch_stats(h.GOLD) == patch_stats(h.GOLD)
    s = patch_stats(h.GOLD)
    assert (s.files, s.added, s.removed, s.lines) == (1, 1, 1, 2)
    # a removed line that itself starts with "--", a new file and a deletion
    old = "-- a\nkeep\n"
    patch = h.make_patch({"sql/q.sql": (old, "keep\n"), "new.py": (None, "x = 1\ny = 2\n")})
    patch += ("diff --git a/gone.txt b/gone.txt\ndeleted file mode 100644\n--- a/gone.txt\n"
              "+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n")
    s = patch_stats(patch)
    assert (s.files, s.added, s.removed) == (3, 2, 2)
    assert patch_stats("") == patch_stats("no diff here\n")
    assert patch_stats("").files == 0


def test_suite_stats_medians(task_factory, h) -> None:
    from atelier.tasks import load_task

    a = load_task(task_factory("a", prompt="x" * 10))
    two = h.make_patch({"calc/ops.py": (h.OPS, h.OPS.replace("a - b", "a + b"))})
    b = load_task(task_factory("b", prompt="y" * 30, gold=two))
    s = suite_stats([a, b])
    assert s["tasks"] == 2 and s["sources"] == {"test": 2}
    assert s["median_prompt_chars"] == 20.0
    assert s["median_lines_changed"] == 3.0  # 2 and 4
    assert s["median_files_changed"] == 1.0
    assert s["reference"]["reference benchmark"] == {"prompt_chars": 390, "lines_changed": 181}
    assert suite_stats([])["median_lines_changed"] is None


# --- real grading ---------------------------------------------------------
def make_task(out: Path, h, tmp_path: Path, gold: str) -> Path:
    repo = tmp_path / f"src-{out.name}"
    for rel, text in h.REPO.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    spec = TaskSpec(id=out.name, prompt="add() subtracts; make it add.",
                    env=PythonEnv(python="3.11", system_site_packages=True),
                    fail_to_pass=h.F2P, pass_to_pass=h.P2P,
                    metadata=TaskMetadata(source="test"), limits=TaskLimits(timeout_s=30))
    write_task(out, spec, repo, h.HIDDEN, gold)
    return out


def wrong_gold(h) -> str:
    """A gold patch that does not fix the task: it multiplies where the tests want a sum."""
    return h.make_patch({"calc/ops.py": (h.OPS, h.OPS.replace("a - b", "a * b", 1))})


@pytest.mark.usefixtures("bwrap_ready")
def test_validate_valid_and_broken_tasks(tmp_path: Path, env_cache: Path, h,
                                         monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    suite = tmp_path / "suite"
    make_task(suite / "good", h, tmp_path, h.GOLD)
    make_task(suite / "wrong-gold", h, tmp_path, wrong_gold(h))

    seen = []
    checks = validate(suite, runs=2, cache_dir=str(env_cache), on_task=seen.append)
    assert [c.id for c in seen] == ["good", "wrong-gold"]
    s = summarize(checks)
    assert (s["tasks"], s["valid"]) == (2, 1)
    assert s["invalid"][0]["id"] == "wrong-gold"
    assert "gold patch failed in 2 of 2" in s["invalid"][0]["reason"]

    monkeypatch.setenv("ATELIER_CACHE", str(env_cache.parent))
    with pytest.raises(SystemExit) as info:
        cli.main(["tasks", "validate", str(suite / "good"), "--runs", "1", "--json"])
    assert info.value.code == 0
    assert json.loads(capsys.readouterr().out)["valid"] == 1
    with pytest.raises(SystemExit) as info:
        cli.main(["tasks", "stats", str(suite), "--json"])
    assert info.value.code == 0
    assert json.loads(capsys.readouterr().out)["sources"] == {"test": 2}


@pytest.mark.usefixtures("bwrap_ready")
def test_check_task_side_by_side_matches_one_at_a_time(tmp_path: Path, env_cache: Path, h) -> None:
    from atelier.tasks.loader import load_task

    good = load_task(make_task(tmp_path / "suite" / "good", h, tmp_path, h.GOLD))
    wrong = load_task(make_task(tmp_path / "suite" / "wrong-gold", h, tmp_path, wrong_gold(h)))
    checks = {}
    for task in (good, wrong):
        alone = check_task(task, 2, cache_dir=str(env_cache), workers=1)
        checks[task.id] = check_task(task, 2, cache_dir=str(env_cache), workers=3)
        assert checks[task.id] == alone
    assert [r.reward for r in checks["good"].gold] == [1.0, 1.0] and checks["good"].empty.reward == 0.0
    assert [r.reward for r in checks["wrong-gold"].gold] == [0.0, 0.0]
    assert checks["wrong-gold"].empty is None  # graded beside gold, not kept: the task is invalid either way


def test_validate_cli_exit_1_on_invalid(tmp_path: Path, capsys) -> None:
    """A task that does not load is invalid: exit 1, reason printed, nothing run."""
    bad = tmp_path / "suite" / "broken"
    bad.mkdir(parents=True)
    (bad / "task.toml").write_text('id = "broken"\nprompt = "p"\n')
    with pytest.raises(SystemExit) as info:
        cli.main(["tasks", "validate", str(tmp_path / "suite")])
    assert info.value.code == 1
    out = capsys.readouterr().out
    assert "0/1 task(s) valid" in out and "INVALID broken" in out and "repo/" in out
