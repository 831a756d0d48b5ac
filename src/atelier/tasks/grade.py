"""Grade a patch or a sandbox's final state against a task's hidden tests.

How (`grade`): a fresh sandbox from the task's snapshot (or a fork of the
agent's live sandbox) gets the patch (`git apply` inside), then every test
file the task relies on is put back to the task's version (an agent that
edited a hidden or target test gets it restored, one that added or replaced
it by a directory or link gets it removed first), the hidden tests are copied
in, and the tests run with `--junitxml` to a random path under the sandbox's
`/tmp`, outside the workspace, read back with `cat`.

What counts (`score`, pure): only the JUnit XML. Printed "PASSED" lines
count for nothing. No result file, a file with zero tests, or a target test
absent from it is a grading error with reward 0, never a pass; a skipped
target test counts as failed; pytest's exit code must agree with the XML
(exit 0 with failures, exit 1 without any, or any other exit code is an
error). reward = 1.0 only when every fail_to_pass and every pass_to_pass
test passed and there was no error.

A timeout of the test run is an infrastructure error (`infra_error=True`):
the trainer excludes and retries it rather than scoring 0 (see PITFALLS).

Files that steer pytest itself are put back too (`restore_pytest_control`):
every `conftest.py`, `pytest.ini`, `.pytest.ini` and `tox.ini` in the
workspace is reset to the task's version (hidden test, else snapshot), and
one the task does not have (an agent's new `conftest.py` that rewrites
reports) is removed before the run; the cache provider is off
(`-p no:cacheprovider`), so no state carries over from the agent's runs.

Not covered: plugins named in `pyproject.toml` or `setup.cfg` (they hold
package metadata a real fix may change, so they are not reset), a module on
the test path that patches pytest when imported, and reading the argv for the
result path. Such patches are caught only when they lose tests or contradict
the exit code.
"""

from __future__ import annotations

import dataclasses
import secrets
import shlex
from pathlib import Path
from typing import Iterable

from atelier.sandbox import Sandbox, SandboxError, create_sandbox
from atelier.tasks.envs import ensure_env, env_mounts, env_python
from atelier.tasks.junit import JUnitError, Status, parse_junit
from atelier.tasks.schema import Task, TaskError

EXIT_MEANING = {2: "interrupted, e.g. a collection error", 3: "internal error",
                4: "usage error, e.g. a test id that does not exist", 5: "no tests collected"}


@dataclasses.dataclass(frozen=True)
class Fraction:
    passed: int
    total: int


@dataclasses.dataclass(frozen=True)
class GradeResult:
    reward: float
    fail_to_pass: Fraction
    pass_to_pass: Fraction
    tests: dict[str, str]
    """Every test in the results (and every target missing from them, as
    "missing") with its status."""
    error: str | None = None
    """Why the results could not be trusted (the reward is then 0)."""
    infra_error: bool = False
    """The failure was the infrastructure's (a timeout), not the patch's:
    exclude the sample and retry instead of scoring it."""
    exit_code: int | None = None
    timeout_s: float | None = None
    """The limit the test run had."""
    log_tail: str = ""

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("log_tail")
        return out


# --- pure -----------------------------------------------------------------
def score(fail_to_pass: Iterable[str], pass_to_pass: Iterable[str],
          results: dict[str, Status] | None, exit_code: int | None, *,
          timed_out: bool = False, timeout_s: float | None = None,
          log_tail: str = "", error: str | None = None) -> GradeResult:
    """Decide the reward from the structured results and the exit code."""
    f2p, p2p = list(fail_to_pass), list(pass_to_pass)
    tests: dict[str, str] = dict(results or {})
    for node in [*f2p, *p2p]:
        tests.setdefault(node, "missing")

    def frac(nodes: list[str]) -> Fraction:
        return Fraction(sum(tests[n] == "passed" for n in nodes), len(nodes))

    def result(reason: str | None = None, infra: bool = False) -> GradeResult:
        f, p = frac(f2p), frac(p2p)
        ok = reason is None and f.passed == f.total and p.passed == p.total
        return GradeResult(1.0 if ok else 0.0, f, p, tests, reason, infra, exit_code, timeout_s,
                           log_tail)

    if error is not None:
        return result(error)
    if timed_out:
        return result(f"infrastructure: the test run timed out after {timeout_s:g} s", infra=True)
    if results is None:
        return result(f"the test run left no result file (exit {exit_code}): "
                      "the suite did not run to the end, so nothing counts as passed")
    if not results:
        return result(f"the result file lists zero tests (exit {exit_code})")
    missing = [n for n in [*f2p, *p2p] if n not in results]
    if missing:
        return result(f"{len(missing)} target test(s) missing from the results: "
                      + ", ".join(missing[:5]))
    bad = any(s in ("failed", "error") for s in results.values())
    if exit_code == 0 and bad:
        return result("pytest exited 0 but the results show failures: the run is not trustworthy")
    if exit_code == 1 and not bad:
        return result("pytest exited 1 but the results show no failure: the run is not trustworthy")
    if exit_code not in (0, 1):
        return result(f"pytest exited {exit_code} ({EXIT_MEANING.get(exit_code, 'unknown')})")
    return result()


def test_argv(task: Task, python: str | None, junit_path: str) -> list[str]:
    """The test command with result options and the target node ids."""
    argv = shlex.split(task.test_command)
    if python and argv and argv[0] in ("python", "python3"):
        argv[0] = python
    return [*argv, "-p", "no:cacheprovider", f"--junitxml={junit_path}",
            "-o", "junit_family=xunit1", *task.fail_to_pass, *task.pass_to_pass]


# --- I/O ------------------------------------------------------------------
def grade(task: Task, patch: str | None = None, *, sandbox: Sandbox | None = None,
          backend: str = "bwrap", cache_dir: str | None = None) -> GradeResult:
    """Grade `patch` (text; empty or None = no change) or the final state of
    the live `sandbox` (forked, never changed), never both."""
    if patch is not None and sandbox is not None:
        raise TaskError("grade() takes a patch or a sandbox, not both",
                        hint="grade the sandbox, or its diff() as a patch")
    venv = ensure_env(task, cache_dir)
    mounts = env_mounts(venv) if venv else []
    python = env_python(venv) if venv else None
    if sandbox is not None and set(mounts) <= set(sandbox.config.ro_mounts):
        sb = sandbox.fork()
    else:
        if sandbox is not None:  # it cannot see the env: carry its changes over
            patch = sandbox.diff()
        sb = create_sandbox(task.snapshot, task.limits.sandbox_config(backend=backend,
                                                                      ro_mounts=mounts))
    with sb:
        return grade_in(sb, task, patch or "", python)


def grade_in(sb: Sandbox, task: Task, patch: str, python: str | None) -> GradeResult:
    """Apply, restore, run and score inside `sb` (which this changes)."""
    timeout = task.limits.timeout_s or sb.config.timeout_s
    f2p, p2p = task.fail_to_pass, task.pass_to_pass
    if patch.strip():
        applied = sb.exec(["git", "apply", "--whitespace=nowarn", "-"], stdin=patch.encode(),
                          timeout=60)
        if not applied.ok:
            why = (applied.stderr or applied.stdout).strip()[-2000:]
            return score(f2p, p2p, None, None, timeout_s=timeout,
                         error=f"the patch does not apply: {why}")
    try:
        _restore_tests(sb, task)
    except SandboxError as exc:
        return score(f2p, p2p, None, None, timeout_s=timeout,
                     error=f"could not restore the test files: {exc.message}")
    junit = f"/tmp/atelier-junit-{secrets.token_hex(8)}.xml"
    run = sb.exec(test_argv(task, python, junit), timeout=timeout,
                  env={"PYTHONDONTWRITEBYTECODE": "1"})
    tail = (run.stdout + run.stderr)[-4000:]
    if run.timed_out:
        return score(f2p, p2p, None, run.exit_code, timed_out=True, timeout_s=timeout, log_tail=tail)
    read = sb.exec(["cat", junit], timeout=60)
    if read.truncated:
        return score(f2p, p2p, None, run.exit_code, timeout_s=timeout, log_tail=tail,
                     error="the result file is larger than the sandbox's output limit")
    if read.exit_code != 0:
        return score(f2p, p2p, None, run.exit_code, timeout_s=timeout, log_tail=tail)
    try:
        results = parse_junit(read.stdout, known_files=task.test_files())
    except JUnitError as exc:
        return score(f2p, p2p, None, run.exit_code, timeout_s=timeout, log_tail=tail,
                     error=str(exc))
    return score(f2p, p2p, results, run.exit_code, timeout_s=timeout, log_tail=tail)


def _restore_tests(sb: Sandbox, task: Task) -> None:
    """Put every hidden and target test file back to the task's version,
    then the files that steer pytest (`restore_pytest_control`)."""
    for rel in task.test_files():
        source = task.hidden_test_source(rel)
        if rel not in task.hidden_tests:
            source = task.snapshot / rel
        sb.exec(["rm", "-rf", "--", rel], timeout=60)
        sb.write_bytes(rel, source.read_bytes())
    restore_pytest_control(sb, task)


PYTEST_CONTROL = ("conftest.py", "pytest.ini", ".pytest.ini", "tox.ini")
"""File names that change what pytest does, wherever they lie."""


def pytest_control_files(task: Task) -> dict[str, Path]:
    """The task's own control files: repository path → host file (a hidden
    test wins over the snapshot's file of the same path)."""
    import os

    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(task.snapshot):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            if name in PYTEST_CONTROL:
                path = Path(dirpath, name)
                found[path.relative_to(task.snapshot).as_posix()] = path
    for rel in task.hidden_tests:
        if Path(rel).name in PYTEST_CONTROL:
            found[rel] = task.hidden_test_source(rel)
    return found


def restore_pytest_control(sb: Sandbox, task: Task) -> list[str]:
    """Reset the workspace's pytest control files to the task's and remove
    those it does not have; returns the removed paths."""
    own = pytest_control_files(task)
    names: list[str] = []
    for name in PYTEST_CONTROL:
        names += ["-o", "-name", name] if names else ["-name", name]
    listed = sb.exec(["find", ".", "-path", "./.git", "-prune", "-o", "(", *names, ")", "-print0"],
                     timeout=60)
    if listed.exit_code != 0:
        raise SandboxError(f"cannot list pytest control files: {listed.stderr.strip()[-300:]}")
    present = {p.removeprefix("./") for p in listed.stdout.split("\0") if p}
    removed = sorted(present - set(own))
    if removed:
        sb.exec(["rm", "-rf", "--", *removed], timeout=60)
    for rel, source in own.items():
        sb.exec(["rm", "-rf", "--", rel], timeout=60)
        sb.write_bytes(rel, source.read_bytes())
    return removed
