"""Building mutation tasks: run a repository's tests, apply candidate
mutations from `atelier.tasks.mutate`, keep those that its tests catch, and
write each as a standard task directory (`atelier.tasks.writer`).

See `atelier.tasks.mutate` for what the operators cover and how candidates
are kept or dropped.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Sequence

from atelier.errors import AtelierError
from atelier.sandbox import SandboxError, create_sandbox
from atelier.sandbox.base import SandboxConfig
from atelier.tasks.envs import ensure_python_env, env_mounts, env_python
from atelier.tasks.junit import JUnitError, parse_junit
from atelier.tasks.mutate import (
    Mutation,
    _count_changed_lines,
    _interleave,
    _pick_group,
    apply_mutations,
    enumerate_mutations,
    gold_patch,
    terse_prompt,
)
from atelier.tasks.pytest_ini import test_command as pytest_test_command
from atelier.tasks.schema import PythonEnv, TaskMetadata, TaskSpec, node_file
from atelier.tasks.writer import write_task


class TestRunError(RuntimeError):
    """The test runner gave no usable result (no report, internal error)."""

    __test__ = False  # not a pytest test class


class MutationBuildError(AtelierError):
    """The repository cannot yield mutation tasks (e.g. no test passes on it)."""


# --- running tests ----------------------------------------------------------------

def run_pytest_local(repo_dir: Path, timeout: float = 300.0, python: str = sys.executable) -> dict[str, str]:
    """Run the repository's pytest suite in a subprocess on this host (no
    sandbox) and return test id -> status. Raises `TimeoutError` past
    `timeout` (the whole process group is killed) and `TestRunError` when
    pytest wrote no report or stopped with an internal or usage error."""
    repo_dir = Path(repo_dir)
    with tempfile.TemporaryDirectory(prefix="atelier-junit-") as tmp:
        report = Path(tmp) / "junit.xml"
        paths = [str(repo_dir)] + ([str(repo_dir / "src")] if (repo_dir / "src").is_dir() else [])
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [
            python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
            "--continue-on-collection-errors", f"--junitxml={report}",
        ]
        proc = subprocess.Popen(
            cmd, cwd=repo_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise TimeoutError(f"pytest ran past {timeout:g}s") from None
        if proc.returncode not in (0, 1) or not report.exists():
            raise TestRunError(f"pytest exited {proc.returncode} with no usable report: {output[-500:]}")
        try:
            statuses = dict(parse_junit(report.read_text()))
        except JUnitError as e:
            raise TestRunError(str(e)) from None
    if not statuses:
        raise TestRunError("pytest reported no tests")
    return statuses


def sandbox_pytest_runner(backend: str = "bwrap", timeout: float = 300.0) -> Runner:
    """A `run_tests` that runs the repository's pytest suite in a fresh sandbox
    (no network, nothing of the host writable), with the same environment
    grading uses: a venv of this Python that sees its site-packages, and the
    tasks' own test command (`task_test_command`)."""
    venv = ensure_python_env(PythonEnv(python=f"{sys.version_info.major}.{sys.version_info.minor}",
                                       system_site_packages=True))
    config = SandboxConfig(backend=backend, ro_mounts=env_mounts(venv), output_limit_bytes=16 * 2**20)

    def run(repo_dir: Path) -> dict[str, str]:
        report = "/tmp/atelier-mutate-junit.xml"
        argv = [env_python(venv), *shlex.split(task_test_command(repo_dir))[1:], "-q", "-p", "no:cacheprovider",
                "-o", "junit_family=xunit1", "--continue-on-collection-errors", f"--junitxml={report}"]
        env = {"PYTHONDONTWRITEBYTECODE": "1"}  # as grading runs it: no PYTHONPATH (a test that
        # starts `python -m pkg` passes here only if it passes at grading)
        with create_sandbox(repo_dir, config) as sb:
            res = sb.exec(argv, timeout=timeout, env=env)
            if res.timed_out:
                raise TimeoutError(f"pytest ran past {timeout:g}s")
            xml = sb.exec(["cat", report])
        if res.exit_code not in (0, 1) or xml.exit_code != 0:
            raise TestRunError(f"pytest exited {res.exit_code} with no usable report: "
                               f"{(res.stdout + res.stderr)[-500:]}")
        try:
            statuses = dict(parse_junit(xml.stdout))
        except (JUnitError, SandboxError) as e:
            raise TestRunError(str(e)) from None
        if not statuses:
            raise TestRunError("pytest reported no tests")
        return statuses

    return run


def task_test_command(repo_dir: Path) -> str:
    """The pytest command of a repository's mutation tasks, also used to find
    them: `atelier.tasks.pytest_ini.test_command` (an `src/` layout gets
    `src` on pytest's pythonpath, so grading imports the mutated package
    rather than nothing; idle environment plugins are off)."""
    return pytest_test_command(Path(repo_dir), src_layout=(Path(repo_dir) / "src").is_dir())


# --- building tasks ---------------------------------------------------------------

_IGNORE = shutil.ignore_patterns(
    ".git", ".hg", ".venv", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache",
    ".ruff_cache", ".tox", ".nox", "node_modules", "*.egg-info",
)
_NOT_SOURCE_DIRS = {"tests", "test", "testing", "docs", "doc", "examples", "build", "dist", "venv", "site-packages"}
_NOT_SOURCE_FILES = {"conftest.py", "setup.py", "noxfile.py", "fabfile.py"}


def source_files(root: Path) -> list[str]:
    """Repository-relative POSIX paths of the Python files worth mutating."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _NOT_SOURCE_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py") or name in _NOT_SOURCE_FILES:
                continue
            if name.startswith("test_") or name.endswith("_test.py"):
                continue
            found.append(PurePosixPath(Path(dirpath, name).relative_to(root)).as_posix())
    return sorted(found)


@dataclass
class Dropped:
    mutations: list[str]
    reason: str


@dataclass
class BuildReport:
    repo: str
    out: str
    seed: int
    requested: int
    candidates: int = 0
    clean_passing: int = 0
    test_runs: int = 0
    tasks: list[str] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


Runner = Callable[[Path], dict[str, str]]
Outcome = tuple[list[str], list[str]]  # fail_to_pass, pass_to_pass


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8")  # bytes: keep \r\n exactly


def _try(work: Path, files: dict[str, str], muts: Sequence[Mutation], run: Runner,
         clean: set[str], report: BuildReport) -> Outcome | str:
    """Apply, test and restore; the F2P/P2P split, or why the candidate is dropped."""
    mutated = apply_mutations(files, muts)
    changed = sorted({m.path for m in muts})
    for path in changed:
        try:
            ast.parse(mutated[path])
        except (SyntaxError, ValueError):
            return "syntax error"
    try:
        for path in changed:
            (work / path).write_bytes(mutated[path].encode())
        report.test_runs += 1
        statuses = run(work)
    except TimeoutError:
        return "timeout"
    except TestRunError as e:
        return f"test run failed: {str(e)[:200]}"
    finally:
        for path in changed:
            (work / path).write_bytes(files[path].encode())
    broken = sorted(t for t in clean if statuses.get(t) != "passed")
    if not broken:
        return "no test broke"
    return broken, sorted(clean - set(broken))


def _write_task(out: Path, work: Path, repo_name: str, files: dict[str, str], muts: Sequence[Mutation],
                outcome: Outcome, seed: int) -> str:
    """Write one task in the standard layout (`atelier.tasks.writer`): the
    mutated repository is the base state, the original code is the gold fix,
    and the files of the target tests are hidden tests (restored at grading)."""
    f2p, p2p = outcome
    key = "|".join(sorted(f"{m.path}:{m.start}:{m.end}:{m.mutated}" for m in muts))
    task_id = f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', repo_name)}-mut-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    mutated = apply_mutations(files, muts)
    changed = sorted({m.path for m in muts})
    patch = gold_patch({p: mutated[p] for p in changed}, {p: files[p] for p in changed})
    test_files = sorted({node_file(t) for t in f2p})
    spec = TaskSpec(
        id=task_id,
        prompt=terse_prompt(muts, f2p),
        env=PythonEnv(python=f"{sys.version_info.major}.{sys.version_info.minor}",
                      system_site_packages=True),
        test_command=task_test_command(work),
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        metadata=TaskMetadata(source="mutation", category=",".join(sorted({m.operator for m in muts})),
                              files_changed=len(changed), lines_changed=_count_changed_lines(patch)),
    )
    with tempfile.TemporaryDirectory(prefix="atelier-mutant-") as tmp:
        base = Path(tmp) / "repo"
        shutil.copytree(work, base, ignore=_IGNORE, symlinks=True)
        for path in changed:
            (base / path).write_bytes(mutated[path].encode())
        task = write_task(out / task_id, spec, base, {t: _read(work / t) for t in test_files}, patch,
                          overwrite=True)
    # What was mutated, for people reading the suite (outside repo/: never shown to the agent).
    (task.root / "mutations.json").write_text(json.dumps(
        {"seed": seed, "mutations": [{"operator": m.operator, "path": m.path, "line": m.line,
                                      "function": m.function} for m in muts]}, indent=2) + "\n")
    return task_id


class _Memo:
    """Test outcomes by key, appended to a JSON-lines file as they come (a
    torn last line from a crash is ignored); no file: remembers nothing."""

    def __init__(self, path: Path | None):
        self.path, self.data = path, {}
        if path is not None and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.data[item["key"]] = item["value"]

    def get(self, key: str):
        return self.data.get(key)

    def put(self, key: str, value) -> None:
        if self.path is None:
            return
        self.data[key] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "value": value}) + "\n")

    def attempt(self, muts: Sequence[Mutation], run: Callable[[], Outcome | str]) -> Outcome | str:
        key = "|".join(sorted(f"{m.path}:{m.start}:{m.end}:{m.mutated}" for m in muts))
        known = self.get(key)
        if known is not None:
            return known if isinstance(known, str) else (known[0], known[1])
        outcome = run()
        if outcome not in ("timeout",) and not (isinstance(outcome, str) and outcome.startswith("test run failed")):
            self.put(key, outcome if isinstance(outcome, str) else [outcome[0], outcome[1]])
        return outcome


def _clean_tests(repo: Path, work: Path, run: Runner, clean_runs: int, recorded: _Memo,
                 report: BuildReport) -> set[str]:
    """The tests that passed in every one of `clean_runs` runs of the clean copy (from the memo
    when it holds them)."""
    runs = recorded.get("clean")
    if runs is None or len(runs) != max(1, clean_runs):
        runs = [run(work) for _ in range(max(1, clean_runs))]
        report.test_runs += len(runs)
        recorded.put("clean", runs)
    clean = {t for t, s in runs[0].items() if s == "passed" and all(r.get(t) == "passed" for r in runs)}
    report.clean_passing = len(clean)
    if not clean:
        raise MutationBuildError(f"no test passes on the clean copy of {repo}",
                                 hint="mutation tasks need a repository whose own tests pass")
    return clean


def _keep(group: Sequence[Mutation], outcome: Outcome | str, out: Path, work: Path, name: str,
          files: dict[str, str], seed: int, accept: Callable[[str], str | None] | None,
          report: BuildReport) -> None:
    """A tested group becomes a task (unless `accept` refuses it), or is dropped with its reason."""
    if isinstance(outcome, str):
        report.dropped.append(Dropped([m.label for m in group], outcome))
        return
    task_id = _write_task(out, work, name, files, group, outcome, seed)
    refused = accept(str(out / task_id)) if accept is not None else None
    if refused is None:
        report.tasks.append(task_id)
    else:
        shutil.rmtree(out / task_id, ignore_errors=True)
        report.dropped.append(Dropped([m.label for m in group], refused))


def build_mutation_tasks(
    repo: Path, out: Path, n: int, seed: int = 0, run_tests: Runner | None = None, *,
    max_k: int = 3, clean_runs: int = 2, max_attempts: int | None = None,
    memo: Path | None = None, accept: Callable[[str], str | None] | None = None,
    on_progress: Callable[[BuildReport], None] | None = None,
) -> BuildReport:
    """Write up to `n` mutation tasks of `repo` under `out` (one directory each:
    `task.toml`, `repo/`, `tests/`, `gold.patch`) and `out/build_report.json`.

    `run_tests(repo_dir) -> {test_id: status}` runs the suite in a directory
    (default: `run_pytest_local`); it may raise `TimeoutError` or
    `TestRunError`. The clean repository is tested `clean_runs` times and only
    tests that passed every time count. Each task draws its size k from 1..max_k;
    every member of a combination broke a test alone first. At most
    `max_attempts` (default 20 n) single candidates are tested.

    Resuming (`memo`): a JSON-lines file of every test outcome (the clean
    runs, each candidate's F2P/P2P split or drop reason). A second build with
    the same repository, seed and memo replays them instead of running tests,
    so it reaches the same candidates in the same order, and a crash costs
    only the runs not yet recorded. `accept(task_dir) -> None | reason` is
    called on each written task (e.g. to validate it); a reason drops the task
    (its directory is removed) and it does not count towards `n`.
    `on_progress(report)` is called after every tested candidate.
    """
    # One loop whose state (pool, pending, want, exhausted, rng) fixes the seeded order of the
    # candidates that a memo replays; what a step does with a group or a candidate is a function below.
    repo, out = Path(repo).resolve(), Path(out)
    run = run_tests or run_pytest_local
    rng = random.Random(seed)
    report = BuildReport(repo=str(repo), out=str(out), seed=seed, requested=n)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="atelier-mutate-") as tmp:
        work = Path(tmp) / repo.name
        shutil.copytree(repo, work, ignore=_IGNORE, symlinks=True)
        recorded = _Memo(memo)
        clean = _clean_tests(repo, work, run, clean_runs, recorded, report)
        files = {path: _read(work / path) for path in source_files(work)}
        candidates = _interleave([m for p, t in files.items() for m in enumerate_mutations(t, p)], rng)
        report.candidates = len(candidates)
        mutated_files = len({m.path for m in candidates})

        pool: list[tuple[Mutation, Outcome]] = []  # validated singles not yet used
        pending = iter(candidates)
        attempts, budget = 0, max_attempts if max_attempts is not None else 20 * n
        want, exhausted = rng.randint(1, max_k), False
        while len(report.tasks) < n:
            spread = not exhausted and want <= mutated_files  # wait for other files while it may pay
            group = _pick_group([m for m, _ in pool], pool[-1][0], want, rng, spread) if pool else None
            if group is not None:
                outcomes = dict(pool)
                pool = [(m, o) for m, o in pool if m not in group]
                outcome: Outcome | str = outcomes[group[0]] if len(group) == 1 else recorded.attempt(
                    group, lambda: _try(work, files, group, run, clean, report))
                _keep(group, outcome, out, work, repo.name, files, seed, accept, report)
                want = rng.randint(1, max_k)
                continue
            candidate = next(pending, None) if attempts < budget else None
            if candidate is None:
                if not pool:
                    break
                if exhausted:
                    want = 1  # spend what is left one by one
                exhausted = True  # first try the drawn size without the one-file-each rule
                continue
            attempts += 1
            result = recorded.attempt((candidate,),
                                      lambda: _try(work, files, (candidate,), run, clean, report))
            if isinstance(result, str):
                report.dropped.append(Dropped([candidate.label], result))
            else:
                pool.append((candidate, result))
            if on_progress is not None:
                on_progress(report)
    (out / "build_report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report
