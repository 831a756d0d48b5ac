"""Grade a patch or a sandbox's final state against a task's hidden tests:
the one grading path of `atelier tasks grade`/`validate`, evaluation, RL
rewards and gold replays.

How (`grade`): a fresh sandbox from the task's snapshot (or a fork of the
agent's live sandbox) gets the patch (`git apply` inside), then every test
file the task relies on is put back to the task's version (an agent that
edited a hidden or target test gets it restored, one that added or replaced
it by a directory or link gets it removed first), every pytest control file
is reset (`restore_pytest_control`), the hidden tests and a canary module
with fresh random names are copied in, and pytest runs under the reporter.

The result channel. The code under test runs in the same interpreter as the
tests, so it can reach anything a file-based report relies on (the old JUnit
file was rewritten by an exit hook; a dozen lines in the package made pytest
record failures as passes). So:
- the test process is `python -I -c BOOTSTRAP`: the reporter's source and
  the run's configuration, with a fresh nonce, arrive on stdin and stdin is
  then closed; nothing of it is on the command line, in the environment or in
  a file;
- results travel on the stdout pipe the grader opened before the process
  started; the reporter moves it to a private descriptor before any project
  code is imported and points descriptor 1 at stderr. The grader collects the
  bytes as they arrive (`on_output`), so no file the tested process could see
  or rewrite is ever read back, and bytes once written cannot be taken back;
- each record carries the nonce, a sequence number and the pid, and a closing
  record is written only after `pytest.main` returned. A missing or short
  stream is `tampered` (reward 0), not an infrastructure error;
- canaries (must pass, must fail, must error; pytest and unittest) have
  fresh random names in a module at a random path; a wrong outcome is
  `tampered`;
- the reporter guards the identity of pytest's call/report/skip machinery,
  pluggy's hook calling, unittest's run and assertion methods, `sys.exit`,
  `os._exit`, `atexit` and their `sys.modules` entries, before and after
  every test; test machinery is imported from the environment before the
  workspace is on `sys.path` (`-I`), so a `pytest.py` or `unittest.py` in
  the workspace shadows nothing; `sitecustomize`, `usercustomize`, `.pth`
  files and PYTHONPATH of the workspace are never read;
- outcome-deciding hooks implemented by files the patch changed, skips raised
  from them, and a phase that raised yet was reported passed are `tampered`;
- the static screen (`atelier.tasks.screen`) records `tamper_suspect`
  findings; they do not change the reward.
What each check proves is in `atelier.tasks.tamper`.

Not defended: the code under test shares the interpreter's memory with the
reporter. A patch written against this reporter in particular can find the
nonce and the channel (walking `gc` objects or frames, `/proc/self/fd`) and
forge a whole consistent stream, canaries included, or restore every
guarded object before each check. Such a patch needs that machinery in the
package; the static screen flags the usual ways (`gc`, `ctypes`,
`/proc/self`, `_pytest`), but not code assembled at run time. Isolation of
the outcome from the code under test would need the tests in a second
process, which pytest does not do. The sandbox bounds the damage: no network,
nothing of the host writable, the environment read-only. Also not defended:
a patch that makes the run hang until the timeout gets an infrastructure
error (excluded and retried, not scored 0) unless its stream already shows
tampering; a patch that stops pytest before the tests run (collection or
usage error) scores 0 as a plain error, since such a run can earn nothing,
and canaries and the session's closing are only checked when pytest ran the
tests (exit 0 or 1).

What counts (`score`, pure): the statuses the grader built from the stream.
Printed "PASSED" lines count for nothing. No stream, zero tests, or a target
test absent is a grading error with reward 0, never a pass; a skipped target
test counts as failed; pytest's exit code must agree with the results
(canaries included). reward = 1.0 only when every fail_to_pass and every
pass_to_pass test passed, nothing was tampered and there was no error.

Out of memory. The memory limit is part of the task, like its timeout.
A test run killed for passing the sandbox's memory limit
(`ExecResult.oom_killed`: a memory cgroup's count, or the sandbox's own
memory watchdog, see `atelier.sandbox.memory`) is judged against a
reference: the task's gold patch (the unchanged snapshot when it has none),
graded once in a fresh sandbox with the same configuration (cached per
task and limit for the process's life):
- the reference runs without being killed: the limit is enough for the
  task, so the patch brought the run past it. That is the patch's failure:
  reward 0, `oom_killed=True`, an `error` starting "out of memory", never
  infrastructure. (Were it infra, a policy could dodge every negative
  reward by allocating until killed: infra samples are retried, then
  dropped.)
- the reference is killed too: the limit is not the patch's doing (too low
  for the task, or the host short of memory): `SandboxOutOfMemory`, an
  infrastructure failure (`atelier.failures`), retried and never scored.
- the host's OOM killer, not the sandbox's limit, killed it
  (`ExecResult.host_oom_killed`, see `memory.attribute_kill`): the host was
  short of memory, not the patch's doing: `SandboxOutOfMemory`, infra.
- the patch is the reference itself (`atelier tasks validate` grading the
  gold): reward 0 with that error, so validation says the task's limit is
  too low.
Where only RLIMIT_AS bounds a process, an allocation past it fails inside
the process (`MemoryError`): the test fails like any other, reward 0.
An agent's own command killed for memory is neither: its tool result says
so and the episode goes on (`harness.tools.shell`).

A timeout of the test run is an infrastructure error (`infra_error=True`):
the trainer excludes and retries it rather than scoring 0 (docs/pitfalls.md),
unless the stream already proves tampering, or it is complete (the process
hung after pytest returned: the results stand).

The stream is collected through `Sandbox.exec(on_output=...)`. A Ray-placed
sandbox hands back at most `output_limit_bytes` of it (about 4,000 tests at
the default 1 MiB); grading a fork of one with a larger selection reads as a
short stream. `grade` of a patch always grades in a local sandbox.

Not covered: plugins named in `pyproject.toml` or `setup.cfg` are not reset
(they hold package metadata a real fix may change); a plugin of a changed
file that hooks outcomes is `tampered`, one of an unchanged file is trusted.

`test_argv` (pytest with `--junitxml`) is the previous path, kept for the
release builder's probe runs of upstream code and for `benchmarks/grading.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import secrets
import shlex
from pathlib import Path
from typing import Iterable, Sequence

from atelier.failures import OUT_OF_MEMORY
from atelier.sandbox import Sandbox, SandboxError, SandboxOutOfMemory, create_sandbox
from atelier.tasks import reporter
from atelier.tasks import tamper as tamper_mod
from atelier.tasks.envs import ensure_env, env_mounts, env_python
from atelier.tasks.junit import Status
from atelier.tasks.pytest_ini import read_ini
from atelier.tasks.schema import Task, TaskError
from atelier.tasks.screen import is_test_file, screen_patch
from atelier.tasks.tamper import TAMPERED, Canaries, make_canaries, read_stream, verdict

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
    tampered: bool = False
    """The run shows the code under test interfered with the tests or their
    reporting (`tamper` says how); the reward is 0 and `error` starts with
    "tampered: "."""
    tamper: list[str] = dataclasses.field(default_factory=list)
    tamper_suspect: list[str] = dataclasses.field(default_factory=list)
    """Static screen findings on the patch (`atelier.tasks.screen`): recorded,
    never a failure by themselves."""
    canaries_ok: bool | None = None
    """Whether every canary got the outcome it must (a wrong one is also a
    `tamper` reason naming it); None when they were not checked: pytest did
    not run the tests (exit other than 0 or 1) or the run never got that far
    (`atelier.tasks.tamper.verdict` decides both)."""
    oom_killed: bool = False
    """The test run was killed for passing the sandbox's memory limit, under
    which the task's reference runs: the patch's failure (reward 0, `error`
    starts "out of memory"; see the module docstring)."""

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("log_tail")
        return out


# --- pure -----------------------------------------------------------------
def score(fail_to_pass: Iterable[str], pass_to_pass: Iterable[str],
          results: dict[str, Status] | None, exit_code: int | None, *,
          timed_out: bool = False, timeout_s: float | None = None,
          log_tail: str = "", error: str | None = None, tamper: Sequence[str] = (),
          suspect: Sequence[str] = (), others: dict[str, str] | None = None) -> GradeResult:
    """Decide the reward from the structured results and the exit code.
    `others`: statuses of tests that are not targets (the canaries), which
    the exit code must agree with too; `tamper`: reasons the run cannot be
    trusted, which make it `tampered`."""
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
                           log_tail, bool(tamper), list(tamper), list(suspect))

    if error is not None:
        return result(error)
    if tamper:
        return result(TAMPERED + "; ".join(tamper[:3]) + (f" (+{len(tamper) - 3} more)" if len(tamper) > 3 else ""))
    if timed_out:
        return result(f"infrastructure: the test run timed out after {timeout_s:g} s", infra=True)
    if results is None:
        return result(f"the test run left no results (exit {exit_code}): "
                      "the suite did not run to the end, so nothing counts as passed")
    if not results:
        why = f": {EXIT_MEANING[exit_code]}" if exit_code in EXIT_MEANING else ""
        return result(f"the results list zero tests (exit {exit_code}{why})")
    missing = [n for n in [*f2p, *p2p] if n not in results]
    if missing:
        return result(f"{len(missing)} target test(s) missing from the results: "
                      + ", ".join(missing[:5]))
    bad = any(s in ("failed", "error") for s in [*results.values(), *(others or {}).values()])
    if exit_code == 0 and bad:
        return result("pytest exited 0 but the results show failures: the run is not trustworthy")
    if exit_code == 1 and not bad:
        return result("pytest exited 1 but the results show no failure: the run is not trustworthy")
    if exit_code not in (0, 1):
        return result(f"pytest exited {exit_code} ({EXIT_MEANING.get(exit_code, 'unknown')})")
    return result()


def test_argv(task: Task, python: str | None, junit_path: str) -> list[str]:
    """The previous test command: JUnit XML to a file (the release builder's
    probe and the grading benchmark only)."""
    argv = shlex.split(task.test_command)
    if python and argv and argv[0] in ("python", "python3"):
        argv[0] = python
    return [*argv, "-p", "no:cacheprovider", f"--junitxml={junit_path}",
            "-o", "junit_family=xunit1", *task.fail_to_pass, *task.pass_to_pass]


test_argv.__test__ = False  # type: ignore[attr-defined]


def reporter_run(task: Task, python: str | None, canaries: Canaries,
                 nonce: str) -> tuple[list[str], bytes]:
    """The argv and stdin of a graded run: `python -I -c BOOTSTRAP`, fed the
    reporter's source and its configuration. The task's command must be
    `python -m pytest ARGS` or `pytest ARGS`."""
    argv = shlex.split(task.test_command)
    if len(argv) >= 3 and argv[1:3] == ["-m", "pytest"] and posixpath.basename(argv[0]).startswith("python"):
        interpreter = python if python and argv[0] in ("python", "python3") else argv[0]
        script, rest = None, argv[3:]
    elif argv and posixpath.basename(argv[0]) == "pytest":
        interpreter = python or "python3"
        script, rest = (posixpath.join(posixpath.dirname(python), "pytest") if python else argv[0]), argv[1:]
    else:
        raise TaskError(f"task {task.id}: test_command {task.test_command!r} is not pytest",
                        hint="grading runs `python -m pytest ARGS` or `pytest ARGS` under its reporter")
    args = [*rest, "-p", "no:cacheprovider", "--maxfail=0",
            *task.fail_to_pass, *task.pass_to_pass, *canaries.expected]
    config = {"nonce": nonce, "module": f"_{secrets.token_hex(6)}", "args": args, "script": script,
              "canary_file": canaries.path,
              "canary_functions": list(canaries.functions)}
    payload = json.dumps({"source": REPORTER_SOURCE, "config": config}).encode()
    return [interpreter, "-I", "-c", reporter.BOOTSTRAP], payload


REPORTER_SOURCE = Path(reporter.__file__).read_text(encoding="utf-8")
STREAM_LIMIT = 64 * 2**20
"""Bytes of result stream kept; a flood past it is tampering."""


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
    diff: str | None = None
    if sandbox is not None and set(mounts) <= set(sandbox.config.ro_mounts):
        diff = sandbox.diff()
        sb = sandbox.fork()
    else:
        if sandbox is not None:  # it cannot see the env: carry its changes over
            patch = sandbox.diff()
        sb = create_sandbox(task.snapshot, task.limits.sandbox_config(backend=backend,
                                                                      ro_mounts=mounts))
    with sb:
        return grade_in(sb, task, patch or "", python, diff=diff)


def grade_in(sb: Sandbox, task: Task, patch: str, python: str | None, *,
             diff: str | None = None, reference: bool = False) -> GradeResult:
    """Apply, restore, run and score inside `sb` (which this changes).
    `diff`: how the workspace already differs from the snapshot (a fork of
    a live sandbox); default: `patch`. `reference`: `patch` is the one an
    out-of-memory kill is judged against (see the module docstring)."""
    timeout = task.limits.timeout_s or sb.config.timeout_s
    f2p, p2p = task.fail_to_pass, task.pass_to_pass
    changes = diff if diff is not None else patch
    suspect = screen_patch(changes)
    if patch.strip():
        applied = sb.exec(["git", "apply", "--whitespace=nowarn", "-"], stdin=patch.encode(),
                          timeout=60)
        if not applied.ok:
            why = (applied.stderr or applied.stdout).strip()[-2000:]
            return score(f2p, p2p, None, None, timeout_s=timeout, suspect=suspect,
                         error=f"the patch does not apply: {why}")
    try:
        restored = _restore_tests(sb, task)
        canaries = _place_canaries(sb, task)
    except SandboxError as exc:
        return score(f2p, p2p, None, None, timeout_s=timeout, suspect=suspect,
                     error=f"could not restore the test files: {exc.message}")
    nonce = secrets.token_hex(16)
    argv, stdin = reporter_run(task, python, canaries, nonce)
    chunks: list[bytes] = []
    size = [0]

    def collect(stream: str, chunk: bytes) -> None:
        if stream == "stdout" and size[0] <= STREAM_LIMIT:
            size[0] += len(chunk)
            chunks.append(chunk)

    run = sb.exec(argv, timeout=timeout, env={"PYTHONDONTWRITEBYTECODE": "1"}, stdin=stdin,
                  on_output=collect)
    tail = run.stderr[-4000:]
    if run.host_oom_killed:
        raise SandboxOutOfMemory(
            f"task {task.id}: the test run was killed by the host's OOM killer, not for the "
            "sandbox's own limit: not the patch's doing; not scored",
            hint="an infrastructure failure: retried; the host is short of memory")
    if run.oom_killed:
        is_reference = reference or patch.strip() == reference_patch(task).strip()
        if not is_reference and not reference_fits(sb, task, python):
            raise SandboxOutOfMemory(
                f"task {task.id}: the test run was killed for passing the sandbox's memory limit "
                f"({sb.config.memory_mb} MiB), and so is the task's gold patch: the limit is not "
                "the patch's doing; not scored",
                hint="an infrastructure failure: retried; raise the task's `limits.memory_mb`")
        whose = "the task's own reference patch" if is_reference else "the patch"
        result = score(f2p, p2p, None, run.exit_code, timeout_s=timeout, log_tail=tail, suspect=suspect,
                       error=f"{OUT_OF_MEMORY}{whose} made the test run pass the sandbox's memory "
                             f"limit of {sb.config.memory_mb} MiB"
                             + ("" if is_reference else ", under which the gold patch's run fits"))
        return dataclasses.replace(result, oom_killed=True)
    if not chunks and run.exit_code in (126, 127):  # the shell's "cannot run" / "not found"
        return score(f2p, p2p, None, run.exit_code, timeout_s=timeout, log_tail=tail, suspect=suspect,
                     error=f"could not start the test command {argv[0]} (exit {run.exit_code})")
    stream = read_stream(b"".join(chunks), nonce, complete=not run.timed_out)
    if size[0] > STREAM_LIMIT:
        stream.problems.append(f"the result stream passed {STREAM_LIMIT} bytes: flooded")
    finished = stream.last("end") is not None
    found = verdict(stream, process_exit=None if run.timed_out else run.exit_code,
                    canaries=canaries, changed=tamper_mod.changed_paths(changes), restored=restored)
    results = None if found.results is None else {
        k: v for k, v in found.results.items() if k not in canaries.expected}
    others = {k: v for k, v in (found.results or {}).items() if k in canaries.expected}
    result = score(f2p, p2p, results, found.exit_code, timed_out=run.timed_out and not finished,
                   timeout_s=timeout, log_tail=tail, tamper=found.tamper, suspect=suspect,
                   others=others)
    return dataclasses.replace(result, canaries_ok=found.canaries_ok)


def reference_patch(task: Task) -> str:
    """What an out-of-memory kill is judged against: the gold patch, or no
    change where the task has none."""
    return task.gold_patch or ""


_REFERENCE_FITS: dict[tuple[str, str, int, tuple[str, ...]], bool] = {}


def reference_fits(sb: Sandbox, task: Task, python: str | None) -> bool:
    """Whether the reference patch's test run stays under `sb`'s memory
    limit: graded once in a fresh sandbox with `sb`'s configuration, then
    remembered for this task and limit."""
    key = (task.id, str(task.snapshot), sb.config.memory_mb, tuple(sb.config.ro_mounts))
    if key not in _REFERENCE_FITS:
        with create_sandbox(task.snapshot, sb.config) as ref:
            result = grade_in(ref, task, reference_patch(task), python, reference=True)
        _REFERENCE_FITS[key] = not result.oom_killed
    return _REFERENCE_FITS[key]


def _place_canaries(sb: Sandbox, task: Task) -> Canaries:
    """Write a canary module with fresh names next to the first target test;
    no unittest canaries where the task switches pytest's unittest support off."""
    addopts = (read_ini(task.snapshot) or {}).get("addopts", [])
    with_unittest = "no:unittest" not in " ".join([task.test_command, *addopts])
    files = [t.split("::", 1)[0] for t in [*task.fail_to_pass, *task.pass_to_pass]] or task.test_files()
    files = [f for f in files if is_test_file(f)] or files  # beside a test module, not a doctest's
    canaries = make_canaries(files, secrets.token_hex(16), with_unittest=with_unittest)
    sb.write_bytes(canaries.path, canaries.source.encode())  # a fresh name: nothing to remove
    return canaries


def _restore_tests(sb: Sandbox, task: Task) -> set[str]:
    """Put every hidden and target test file back to the task's version,
    then the files that steer pytest (`restore_pytest_control`); returns
    every path put back or removed."""
    for rel in task.test_files():
        source = task.hidden_test_source(rel)
        if rel not in task.hidden_tests:
            source = task.snapshot / rel
        sb.exec(["rm", "-rf", "--", rel], timeout=60)
        sb.write_bytes(rel, source.read_bytes())
    removed = restore_pytest_control(sb, task)
    return {*task.test_files(), *pytest_control_files(task), *removed}


PYTEST_CONTROL = ("conftest.py", "pytest.ini", ".pytest.ini", "tox.ini")
"""File names that change what pytest does, wherever they lie."""


def pytest_control_files(task: Task) -> dict[str, Path]:
    """The task's own control files: repository path → host file (a hidden
    test wins over the snapshot's file of the same path)."""
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
