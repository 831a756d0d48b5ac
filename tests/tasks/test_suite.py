"""Suite specs and `build_suite`: spec errors, the plan (pure), and a real
build of a tiny spec (two local releases, a release without a changelog
entry, a small mutation source) in bubblewrap sandboxes: validated tasks,
splits in the index, the drop report, resume that builds nothing, and a
crash that leaves no half task. The committed spec is checked for shape;
building real entries from PyPI is `slow`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atelier.tasks import load_suite
from atelier.tasks.schema import TaskError
from atelier.tasks.suite import SuiteError, known_suites, load_spec, resolve_spec
from atelier.tasks.suite_build import build_suite, plan, planned_units
from tests.helpers import SHAPES, write_tree

V1 = {
    "pyproject.toml": '[project]\nname = "tinyfmt"\nversion = "1.0.0"\n',
    "tinyfmt/__init__.py": "def pad(s, n):\n    return s.ljust(n - 1)\n\n\ndef shout(s):\n    return s.upper()\n",
    "tests/test_fmt.py": "from tinyfmt import shout\n\n\ndef test_shout():\n    assert shout('a') == 'A'\n",
    "CHANGES.md": "# Changes\n\n## 1.0.0\n\n- First release.\n",
}
V2 = {
    **V1,
    "pyproject.toml": '[project]\nname = "tinyfmt"\nversion = "1.1.0"\n',
    "tinyfmt/__init__.py": V1["tinyfmt/__init__.py"].replace("n - 1", "n"),
    "tests/test_fmt.py": V1["tests/test_fmt.py"] + "\n\ndef test_pad():\n    from tinyfmt import pad\n"
                                                   "    assert pad('a', 3) == 'a  '\n",
    "tests/test_slow.py": "def test_other():\n    assert True\n",
    "CHANGES.md": "# Changes\n\n## 1.1.0\n\n- `pad` pads to the full width.\n\n## 1.0.0\n\n- First release.\n",
}
V3 = {**V2, "pyproject.toml": '[project]\nname = "tinyfmt"\nversion = "1.2.0"\n',
      "tinyfmt/__init__.py": V2["tinyfmt/__init__.py"] + "\n\ndef quiet(s):\n    return s.lower()\n"}
"""1.1.0 → 1.2.0 has no changelog entry: dropped, with that reason."""

MUT = SHAPES
"""The repository a suite's mutation entry builds from (path = "shapes")."""


SPEC = """
name = "tiny-bench"
runs = 1

[[release]]
package = "tinyfmt"
from_version = "1.0.0"
to_version = "1.1.0"
old_dir = "v1"
new_dir = "v2"
tests = ["tests/test_fmt.py"]
requirements = []
timeout_s = 60

[[release]]
package = "tinyfmt"
from_version = "1.1.0"
to_version = "1.2.0"
old_dir = "v2"
new_dir = "v3"
requirements = []

[[mutation]]
package = "shapes"
path = "shapes"
seed = 1
count = 1
max_attempts = 12
timeout_s = 60
"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    for name, files in (("v1", V1), ("v2", V2), ("v3", V3), ("shapes", MUT)):
        write_tree(tmp_path / "spec" / name, files)
    path = tmp_path / "spec" / "tiny.toml"
    path.write_text(SPEC)
    return path


# --- specs -----------------------------------------------------------------------
def test_spec_loads_with_splits_and_defaults(spec_file: Path) -> None:
    spec = load_spec(spec_file)
    assert spec.spec.name == "tiny-bench" and spec.spec.runs == 1
    first, second = spec.spec.release
    assert first.split == "test" and first.tests == ["tests/test_fmt.py"]
    assert first.task_id == "tinyfmt-1.0.0-to-1.1.0" and second.requirements == []
    assert spec.spec.mutation[0].split == "train"
    assert spec.local("v1") == spec_file.parent / "v1"


@pytest.mark.parametrize("body, words", [
    ('name = "x"\n', "lists no entries"),
    ('name = "x"\n[[release]]\npackage = "a"\nfrom_version = "1"\nto_versoin = "2"\n', "to_versoin"),
    ('name = "x"\n[[release]]\npackage = "a"\nfrom_version = "1"\nto_version = "2"\nold_dir = "v1"\n',
     "old_dir and new_dir go together"),
    ('name = "x"\n[[mutation]]\npackage = "a"\ncount = 3\n', "exactly one of version"),
    ('name = "x"\n[[mutation]]\npackage = "a"\nversion = "1"\ncount = 0\n', "count"),
    ('name = "x"\n[[release]]\npackage = "a"\nfrom_version = "1"\nto_version = "2"\nsplit = "val"\n', "split"),
    ('name = "x"\n' + '[[release]]\npackage = "a"\nfrom_version = "1"\nto_version = "2"\n' * 2, "listed twice"),
    ('name = "x"\n[[mutation]]\npackage = "a"\npath = "nowhere"\ncount = 1\n', "nowhere not found"),
    ('name = "x"\nrelease = [\n', "x.toml"),
])
def test_spec_errors_name_the_problem(tmp_path: Path, body: str, words: str) -> None:
    path = tmp_path / "x.toml"
    path.write_text(body)
    with pytest.raises(SuiteError) as err:
        load_spec(path)
    assert words in err.value.message
    assert err.value.hint


def test_unknown_suite_lists_the_known_ones() -> None:
    with pytest.raises(SuiteError) as err:
        resolve_spec("no-such-bench")
    assert "no-such-bench" in err.value.message
    assert "atelier-bench" in err.value.hint and "atelier-bench" in known_suites()


def test_plan_only_and_limit(spec_file: Path) -> None:
    spec = load_spec(spec_file)
    releases, mutations = plan(spec)
    assert len(releases) == 2 and [c for _, c in mutations] == [1]
    assert planned_units(spec) == 3
    assert plan(spec, "release")[1] == [] and plan(spec, "mutation")[0] == []
    releases, mutations = plan(spec, limit=1)
    assert len(releases) == 1 and [c for _, c in mutations] == [1]


def test_committed_spec_is_pinned_pypi_with_splits() -> None:
    spec = resolve_spec("atelier-bench").spec
    assert spec.name == "atelier-bench"
    assert all(r.split == "test" and r.old_dir is None for r in spec.release)
    assert all(m.split == "train" and m.version is not None for m in spec.mutation)
    assert all(r.fail_to_pass and r.pass_to_pass is not None for r in spec.release), \
        "every committed release entry records what its validation measured"


def test_committed_spec_meets_the_benchmark_targets() -> None:
    """atelier-bench v0: at least 40 release diffs from at least 10 packages
    (test split) and at least 200 mutation tasks (train split)."""
    spec = resolve_spec("atelier-bench").spec
    assert len(spec.release) >= 40, len(spec.release)
    packages = {r.package.lower().replace("_", "-") for r in spec.release}
    assert len(packages) >= 10, sorted(packages)
    assert sum(m.count for m in spec.mutation) >= 200, [(m.package, m.count) for m in spec.mutation]


# --- building ----------------------------------------------------------------------
@pytest.mark.usefixtures("bwrap_ready")
def test_build_resume_drops_and_splits(spec_file: Path, tmp_path: Path, env_cache: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from atelier.tasks import suite_build

    monkeypatch.setenv("ATELIER_CACHE", str(env_cache.parent))
    spec, out = load_spec(spec_file), tmp_path / "out"

    # A crash while validating leaves no half task, and is an error, not a drop.
    def power_cut(*args, **kw):
        raise RuntimeError("power cut")

    with monkeypatch.context() as m:
        m.setattr(suite_build, "_validation_drop", power_cut)
        crashed = build_suite(spec, out, only="release", limit=1)
    assert crashed.entries[0].error == "RuntimeError: power cut"
    assert not (out / "tinyfmt-1.0.0-to-1.1.0").exists()

    seen: list[tuple[int, str]] = []
    first = build_suite(spec, out, jobs=2, progress=lambda n, msg: seen.append((n, msg)))
    report = json.loads((out / "build-report.json").read_text())
    assert report["built"] == 2 and report["kept"] == 0 and report["errors"] == 0, report
    assert report["splits"] == {"test": 1, "train": 1}
    assert report["dropped"] == 1
    (drop,) = [d for e in report["entries"] for d in e["dropped"]]
    assert drop["what"] == "tinyfmt-1.1.0-to-1.2.0" and "no changelog entry for 1.2.0" in drop["reason"]
    rel = first.entries[0]
    assert (rel.fail_to_pass, rel.pass_to_pass) == (1, 1)  # test_slow.py left out by `tests`
    assert sum(n for n, _ in seen) == planned_units(spec)

    test = load_suite(out, split="test")
    assert [t.id for t in test] == ["tinyfmt-1.0.0-to-1.1.0"]
    assert test[0].fail_to_pass == ["tests/test_fmt.py::test_pad"]
    train = load_suite(out, split="train")
    assert len(train) == 1 and all(t.metadata.source == "mutation" for t in train)
    assert len(load_suite(out)) == 2
    with pytest.raises(TaskError, match="no task in split 'dev'"):
        load_suite(out, split="dev")
    assert not any((out / ".atelier-build" / "staging").iterdir())

    # Resume: everything is there or was dropped for good; nothing runs.
    def no_runs(*args, **kw):
        raise AssertionError("a resumed build ran tests")

    with monkeypatch.context() as m:
        m.setattr(suite_build, "_validation_drop", no_runs)
        m.setattr("atelier.tasks.release.sandbox_runner", no_runs)
        m.setattr("atelier.tasks.mutation_tasks.sandbox_pytest_runner", no_runs)
        again = build_suite(spec, out).to_json()
    assert again["built"] == 0 and again["kept"] == 2 and again["errors"] == 0
    assert again["dropped"] == 1 and again["splits"] == {"test": 1, "train": 1}


@pytest.mark.usefixtures("bwrap_ready")
def test_a_validation_drop_keeps_its_grade_flags_in_the_report_and_on_resume(
        spec_file: Path, tmp_path: Path, env_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gold patch the grader calls `tampered` at validation is dropped
    like a bad candidate; the report must say it was `tampered`, or a false
    positive of the grader would hide as a drop. A grader that calls the
    first candidate tampered (and passes the rest without running them)."""
    from atelier.tasks import suite_build
    from atelier.tasks.validate import RunOutcome, TaskCheck

    monkeypatch.setenv("ATELIER_CACHE", str(env_cache.parent))
    why = "canary test_ab12cd_bad should have failed, got passed"
    seen: list[str] = []

    def check_task(task, runs, **kw):
        seen.append(task.id)
        if len(seen) == 1:
            return TaskCheck(task.id, (RunOutcome(0.0, "tampered: " + why, tampered=True, tamper=(why,),
                                                  canaries_ok=False),) * runs)
        return TaskCheck(task.id, (RunOutcome(1.0, canaries_ok=True),) * runs, RunOutcome(0.0))

    monkeypatch.setattr(suite_build, "check_task", check_task)
    spec, out = load_spec(spec_file), tmp_path / "out"
    build_suite(spec, out, only="mutation")
    report = json.loads((out / "build-report.json").read_text())
    assert report["built"] == 1 and report["dropped"] == 1, report
    (drop,) = report["entries"][0]["dropped"]
    assert drop["what"] == seen[0] and drop["reason"].startswith("validation: gold patch failed in 1 of 1")
    assert drop["tampered"] is True
    assert drop["grades"] == [{"run": "gold 1", "reward": 0.0, "error": "tampered: " + why,
                               "infra_error": False, "tampered": True, "tamper": [why],
                               "tamper_suspect": [], "canaries_ok": False, "failed": []}]
    lines = suite_build.summarize_drops([suite_build.EntryResult(**report["entries"][0])])
    assert lines[0].startswith(f"dropped {seen[0]}: ") and "gold graded TAMPERED" in lines[0]

    # Resumed: nothing is validated again, and the drop is still reported with its flags.
    monkeypatch.setattr(suite_build, "check_task", lambda *a, **kw: pytest.fail("validated again"))
    again = build_suite(spec, out, only="mutation").to_json()
    assert again["kept"] == 1 and again["entries"][0]["dropped"] == [drop]


def test_cli_suite_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from atelier.cli import main as cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["tasks", "build", "--suite", "no-such-bench", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "known suites: " in err and "atelier-bench" in err
    with pytest.raises(SystemExit) as exc:
        cli.main(["tasks", "build", "--suite", "atelier-bench"])
    assert exc.value.code == 2 and "--suite and --out go together" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.usefixtures("bwrap_ready")
def test_build_two_committed_entries_from_pypi(tmp_path: Path) -> None:
    spec = resolve_spec("atelier-bench")
    build = build_suite(spec, tmp_path / "bench", only="release", limit=2)
    data = build.to_json()
    assert data["built"] == 2, data
    for entry, committed in zip(build.entries, spec.spec.release):
        assert entry.fail_to_pass == committed.fail_to_pass
