"""Importers: SWE-bench field parsing and a real import from a tiny local
git mirror (graded: gold = 1, base = 0); Harbor task directories."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from atelier.cli import main as cli
from atelier.tasks import TaskError, load_task
from atelier.tasks.harbor import NODE, dockerfile_needs, dockerfile_workdir, import_dir, rewrite_paths
from atelier.tasks.swebench import (
    import_file,
    import_instance,
    mirror_path,
    parse_instance,
    parse_test_ids,
    patch_files,
    read_instances,
)


def raw_instance(h, **over) -> tuple[dict, str]:
    """A SWE-bench-style instance for the calc task (FAIL_TO_PASS JSON-encoded,
    as in the official dataset) and the test file's base content."""
    fixed = h.OPS_FIXED
    new_test = h.HIDDEN["tests/test_calc.py"]
    old_test = "from calc import sub\n\n\ndef test_old():\n    assert sub(1, 1) == 0\n"
    inst = {
        "instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": "HEAD",
        "patch": h.make_patch({"calc/ops.py": (h.OPS, fixed)}),
        "test_patch": ("diff --git a/tests/test_calc.py b/tests/test_calc.py\n"
                       + h.make_patch({"tests/test_calc.py": (old_test, new_test)})),
        "problem_statement": "add(2, 3) returns -1; it should add.",
        "FAIL_TO_PASS": json.dumps(h.F2P), "PASS_TO_PASS": h.P2P,
        "version": "1.0", "environment_setup_commit": "abc",
    }
    inst.update(over)
    return inst, old_test


# --- pure -----------------------------------------------------------------
def test_test_ids_accept_lists_and_json_strings() -> None:
    assert parse_test_ids(["a.py::t"], "FAIL_TO_PASS", "x") == ["a.py::t"]
    assert parse_test_ids('["a.py::t", "b.py::C::u[1]"]', "FAIL_TO_PASS", "x") == ["a.py::t", "b.py::C::u[1]"]
    assert parse_test_ids("[]", "PASS_TO_PASS", "x") == []
    with pytest.raises(TaskError, match="x: FAIL_TO_PASS is a string but not JSON"):
        parse_test_ids("a.py::t", "FAIL_TO_PASS", "x")
    with pytest.raises(TaskError, match="must be a list"):
        parse_test_ids('{"a": 1}', "FAIL_TO_PASS", "x")


def test_parse_instance_checks_fields(h) -> None:
    inst, _ = raw_instance(h)
    parsed = parse_instance(inst)
    assert parsed.fail_to_pass == h.F2P and parsed.pass_to_pass == h.P2P
    assert parsed.version == "1.0"
    with pytest.raises(TaskError, match="acme__calc-1: missing field.*base_commit"):
        parse_instance({k: v for k, v in inst.items() if k != "base_commit"})
    with pytest.raises(TaskError, match="not a pytest node id") as info:
        parse_instance({**inst, "FAIL_TO_PASS": '["test_x (app.tests.T)"]'})
    assert "Django" in info.value.hint
    js = "diff --git a/x.js b/x.js\n--- a/x.js\n+++ b/x.js\n@@ -1 +1 @@\n-a\n+b\n"
    with pytest.raises(TaskError, match="\\.py"):
        parse_instance({**inst, "patch": js, "test_patch": ""})


def test_read_instances_json_and_jsonl() -> None:
    assert read_instances('[{"a": 1}, {"a": 2}]') == [{"a": 1}, {"a": 2}]
    assert read_instances('{"a": 1}\n\n{"a": 2}\n') == [{"a": 1}, {"a": 2}]
    with pytest.raises(TaskError, match="line 2"):
        read_instances('{"a": 1}\n{oops\n')


def test_patch_files_and_mirror_path(tmp_path: Path, h) -> None:
    gone = "diff --git a/old.py b/old.py\ndeleted file mode 100644\n--- a/old.py\n+++ /dev/null\n"
    assert patch_files(h.GOLD + gone) == ["calc/ops.py"]
    assert mirror_path(tmp_path, "acme/calc") is None
    (tmp_path / "acme" / "calc").mkdir(parents=True)
    assert mirror_path(tmp_path, "acme/calc") == tmp_path / "acme" / "calc"
    (tmp_path / "acme__calc").mkdir()
    assert mirror_path(tmp_path, "acme/calc") == tmp_path / "acme__calc"


# --- real import --------------------------------------------------------------
def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def make_mirror(repos: Path, h, old_test: str) -> str:
    """acme/calc with two commits; the base is the first (the second must not leak)."""
    mirror = repos / "acme__calc"
    for rel, text in {**h.REPO, "tests/test_calc.py": old_test}.items():
        (mirror / rel).parent.mkdir(parents=True, exist_ok=True)
        (mirror / rel).write_text(text)
    git(mirror, "init", "-q")
    git(mirror, "add", "-A")
    git(mirror, "commit", "-qm", "base")
    base = git(mirror, "rev-parse", "HEAD")
    (mirror / "calc" / "ops.py").write_text(h.OPS_FIXED)
    git(mirror, "commit", "-qam", "the fix (future history)")
    return base


def test_import_swebench_instance_and_grade(tmp_path: Path, h, env_cache: Path, bwrap_ready,
                                            capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    repos, out = tmp_path / "repos", tmp_path / "suite"
    inst, old_test = raw_instance(h)
    inst["base_commit"] = make_mirror(repos, h, old_test)
    missing = {**inst, "instance_id": "other__x-2", "repo": "other/x"}
    instances = tmp_path / "instances.jsonl"
    instances.write_text(json.dumps(inst) + "\n" + json.dumps(missing) + "\n")

    with pytest.raises(SystemExit) as info:
        cli.main(["tasks", "import", "swebench", str(instances), "--repos", str(repos),
                  "--out", str(out), "--json"])
    assert info.value.code == 1  # one instance had no mirror
    report = json.loads(capsys.readouterr().out)
    assert report["imported"] == ["acme__calc-1"]
    (failed,) = report["failed"]
    assert failed["id"] == "other__x-2" and "git clone https://github.com/other/x" in failed["reason"]

    task = load_task(out / "acme__calc-1")
    assert not (task.snapshot / ".git").exists()
    assert (task.snapshot / "calc" / "ops.py").read_text() == h.OPS  # base, not the fix
    assert (task.snapshot / "tests" / "test_calc.py").read_text() == old_test
    assert task.hidden_tests == ["tests/test_calc.py"]
    assert task.hidden_test_source("tests/test_calc.py").read_text() == h.HIDDEN["tests/test_calc.py"]
    assert task.metadata.source == "swe-bench" and "acme/calc@1.0" in task.metadata.category
    assert (task.metadata.files_changed, task.metadata.lines_changed) == (1, 2)
    assert task.prompt == inst["problem_statement"] and task.env.system_site_packages

    from atelier.tasks.grade import grade

    assert grade(task, task.gold_patch, cache_dir=str(env_cache)).reward == 1.0
    assert grade(task, "", cache_dir=str(env_cache)).reward == 0.0

    with pytest.raises(TaskError, match="already exists"):
        import_instance(parse_instance(inst), repos, out)
    report = import_file(instances, repos, out, overwrite=True)
    assert report["imported"] == ["acme__calc-1"]


def test_import_swebench_bad_base_commit(tmp_path: Path, h) -> None:
    repos = tmp_path / "repos"
    inst, old_test = raw_instance(h)
    make_mirror(repos, h, old_test)
    inst["base_commit"] = "0" * 40
    path = tmp_path / "i.json"
    path.write_text(json.dumps([inst]))
    report = import_file(path, repos, tmp_path / "out")
    assert report["imported"] == [] and "fetch" in report["failed"][0]["reason"]


# --- Harbor ---------------------------------------------------------------------


def test_dockerfile_classification() -> None:
    simple = "# base\nFROM python:3.11-slim\nWORKDIR /app\nCOPY greet.py /app/greet.py\n"
    assert dockerfile_needs(simple) is None
    assert dockerfile_needs("FROM ubuntu:24.04\n") is None
    assert dockerfile_needs("FROM --platform=linux/amd64 ghcr.io/x/debian:12\nCOPY . .\n") is None
    assert dockerfile_needs(simple + "RUN pip install \\\n    numpy\n") == "line 5: RUN pip install numpy"
    assert "not a python/ubuntu/debian" in dockerfile_needs("FROM node:20\n")
    assert dockerfile_needs("ENV X=1\nFROM python:3.12\n").startswith("line 1: ENV")
    assert dockerfile_needs("# nothing\n") == "the Dockerfile is empty"
    assert dockerfile_workdir(simple) == "/app"
    assert dockerfile_workdir("FROM python\nWORKDIR /srv/code/\n") == "/srv/code"


def test_rewrite_paths_whole_components_only() -> None:
    script = "cd /app && cat /app/x /application /tests/t.py > /logs/verifier/reward.txt; ls my/app"
    out = rewrite_paths(script, {"/app": "/ws", "/tests": "/ws/tests", "/logs/verifier": "/tmp/l"})
    assert out == "cd /ws && cat /ws/x /application /ws/tests/t.py > /tmp/l/reward.txt; ls my/app"


GREET = "def greet(name):\n    return 'hi'\n"
TEST_SH = """#!/bin/bash
cd /app
if python -c "from greet import greet; assert greet('bob') == 'hello bob'"; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
SOLVE_SH = """#!/bin/bash
cat > /app/greet.py <<'END'
def greet(name):
    return 'hello ' + name
END
"""


def make_harbor_task(root: Path, dockerfile: str | None) -> Path:
    files = {"instruction.md": "greet() should return 'hello NAME'.\n",
             "task.toml": 'version = "1.0"\n[metadata]\ncategory = "programming"\n'
                          "[verifier]\ntimeout_sec = 30.0\n",
             "environment/greet.py": GREET, "tests/test.sh": TEST_SH, "solution/solve.sh": SOLVE_SH}
    if dockerfile is not None:
        files["environment/Dockerfile"] = dockerfile
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_import_harbor_tasks(tmp_path: Path, env_cache: Path, bwrap_ready, capsys) -> None:
    from atelier.tasks.grade import grade

    src, out = tmp_path / "harbor", tmp_path / "suite"
    make_harbor_task(src / "greet", "FROM python:3.11-slim\nWORKDIR /app\nCOPY greet.py /app/\n")
    make_harbor_task(src / "needs-image", "FROM python:3.11\nRUN apt-get install -y jq\n")
    (src / "no-solution" / "instruction.md").parent.mkdir(parents=True)
    (src / "no-solution" / "instruction.md").write_text("x")

    report = import_dir(src, out)
    assert report["imported"] == ["greet"]
    assert report["needs_docker"] == [{"id": "needs-image",
                                       "reason": "environment/Dockerfile line 2: RUN apt-get install -y jq"}]
    (failed,) = report["failed"]
    assert failed["id"] == "no-solution" and "missing tests/test.sh" in failed["reason"]

    task = load_task(out / "greet")
    assert task.fail_to_pass == [NODE] and task.metadata.source == "harbor"
    assert task.metadata.category == "programming" and task.prompt.startswith("greet()")
    assert sorted(task.hidden_tests) == ["tests/test.sh", "tests/test_harbor_verifier.py"]
    assert not (task.snapshot / "Dockerfile").exists()
    assert (task.snapshot / "greet.py").read_text() == GREET
    assert "+    return 'hello ' + name" in task.gold_patch
    assert grade(task, task.gold_patch, cache_dir=str(env_cache)).reward == 1.0
    empty = grade(task, "", cache_dir=str(env_cache))
    assert empty.reward == 0.0 and empty.tests[NODE] == "failed"

    with pytest.raises(SystemExit) as info:
        cli.main(["tasks", "import", "harbor", str(src / "needs-image"), "--out", str(out)])
    assert info.value.code == 0
    assert "NEEDS DOCKER needs-image: environment/Dockerfile line 2: RUN" in capsys.readouterr().out


# --- SWE-bench environments -----------------------------------------------------
def test_declared_requirements_from_the_repository_files(tmp_path: Path) -> None:
    from atelier.tasks.declared_deps import declared_requirements

    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "calc"\ndependencies = ["attrs>=20", "tomli; python_version < \'3.11\'"]\n'
        '[project.optional-dependencies]\ntest = ["hypothesis"]\ndocs = ["sphinx"]\n')
    (tmp_path / "requirements-test.txt").write_text(
        "# pins\npytest-mock==3.12  # comment\n-r requirements.txt\n-e .\nhttps://x/y.whl\n")
    got = declared_requirements(tmp_path)
    assert got.name == "calc" and got.sources == ["pyproject.toml", "requirements-test.txt"]
    assert got.requirements == ["attrs>=20", "tomli; python_version < '3.11'", "hypothesis", "pytest-mock==3.12"]
    assert got.skipped == ["requirements-test.txt: -r requirements.txt", "requirements-test.txt: -e .",
                           "requirements-test.txt: https://x/y.whl"]

    cfg_only = tmp_path / "cfg"
    cfg_only.mkdir()
    (cfg_only / "setup.cfg").write_text("[metadata]\nname = calc\n[options]\ninstall_requires =\n"
                                        "    six\n    attrs  # why\n[options.extras_require]\ntesting = pytest-cov\n")
    got = declared_requirements(cfg_only)
    assert got.requirements == ["six", "attrs", "pytest-cov"] and got.sources == ["setup.cfg"]

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "setup.py").write_text("from setuptools import setup\nsetup(install_requires=['six'])\n")
    got = declared_requirements(legacy)
    assert got.setup_py_only and got.requirements == []


def test_swebench_environment_from_declared_needs_or_the_env_spec(tmp_path: Path, h) -> None:
    from atelier.tasks.swebench import instance_env, load_env_specs

    inst = parse_instance(raw_instance(h)[0])
    base = tmp_path / "base"
    (base / "src" / "calc").mkdir(parents=True)
    (base / "pyproject.toml").write_text(
        '[project]\nname = "calc"\ndependencies = ["attrs>=20", "calc-plugins", "tomli; python_version < \'3.0\'"]\n'
        '[tool.pytest.ini_options]\npythonpath = ["tests"]\n')
    env, note = instance_env(inst, base, {})
    assert env.requirements == ["attrs>=20", "calc-plugins"]     # marker false for this Python: dropped
    assert note == "env: declared in pyproject.toml"

    spec_file = tmp_path / "envs.toml"
    spec_file.write_text('["acme/calc@1.0"]\nrequirements = ["attrs==23.1.0"]\n'
                         '["acme/calc"]\nrequirements = ["attrs"]\npython = "3.11"\n')
    specs = load_env_specs(spec_file)
    env, note = instance_env(inst, base, specs)
    assert env.requirements == ["attrs==23.1.0"] and note == "env: --env-spec [acme/calc@1.0]"
    other = parse_instance(raw_instance(h, version="2.0")[0])
    assert instance_env(other, base, specs)[0].requirements == ["attrs"]   # the repository-wide entry

    spec_file.write_text('["acme/calc"]\nrequirement = ["attrs"]\n')
    with pytest.raises(TaskError, match=r"\['acme/calc'\] requirements: Field required"):
        load_env_specs(spec_file)
    spec_file.write_text("not toml [")
    with pytest.raises(TaskError, match="cannot read the env spec"):
        load_env_specs(spec_file)


def test_swebench_import_keeps_an_src_layout_importable(tmp_path: Path, h) -> None:
    """The task's test command puts src/ on the path, keeping the project's own pythonpath."""
    repos = tmp_path / "repos"
    inst, old_test = raw_instance(h)
    mirror = repos / "acme__calc"
    for rel, text in {**h.REPO, "tests/test_calc.py": old_test}.items():
        (mirror / "src" / rel if rel.startswith("calc/") else mirror / rel).parent.mkdir(parents=True, exist_ok=True)
        (mirror / "src" / rel if rel.startswith("calc/") else mirror / rel).write_text(text)
    (mirror / "pyproject.toml").write_text('[project]\nname = "calc"\ndependencies = []\n'
                                           '[tool.pytest.ini_options]\npythonpath = ["tests"]\n')
    git(mirror, "init", "-q")
    git(mirror, "add", "-A")
    git(mirror, "commit", "-qm", "base")
    inst["base_commit"] = git(mirror, "rev-parse", "HEAD")
    inst["patch"] = inst["patch"].replace("a/calc/", "a/src/calc/").replace("b/calc/", "b/src/calc/")
    task = import_instance(parse_instance(inst), repos, tmp_path / "out")
    assert "pythonpath=tests src" in task.test_command or "pythonpath='tests src'" in task.test_command, \
        task.test_command
    assert task.env.requirements == [] and "declared in pyproject.toml" in task.metadata.category
