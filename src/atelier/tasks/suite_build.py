"""Build a suite spec (`atelier.tasks.suite`) into a suite directory.

Example: `atelier tasks build --suite atelier-bench --out suites/bench`.

Per entry:
- release: fetch both sdists (cached, unpacked, under `<cache>/sdists/`),
  build the task (`atelier.tasks.release`), then validate it: the gold patch
  graded `spec.runs` times must pass every time and the empty patch must fail
  (`atelier.tasks.validate.check_task`).
- mutation: fetch the sdist, run `build_mutation_tasks` with the entry's seed
  and count, and validate every task it writes the same way (a task whose
  gold does not pass every run is dropped and does not count; the builder
  tries the next candidate).
- Every validation drop is reported with the flags of each grading (reward,
  error, `tampered` and its reasons, `tamper_suspect`, whether the canaries
  came out right), and kept in the state so a resumed build reports it too:
  a gold patch the grader wrongly calls `tampered` is a false positive of the
  grader, and must not pass for a bad candidate.

Guarantees, so that a build can be stopped and run again:
- A task is built and validated in `<out>/.atelier-build/staging/` and only
  then renamed into `<out>/<id>` (same file system: atomic). A crash leaves
  no half task in `<out>`; a task directory there is built and validated, and
  a second run skips it.
- Mutation test outcomes are appended to a memo as they come
  (`build_mutation_tasks(memo=…)`), so a resumed entry replays them and
  reaches the same candidates without running their tests again.
- A release entry dropped for a reason of its own (no changelog entry, no
  failing test, gold flaky at validation) is recorded in
  `<out>/.atelier-build/state.json` and not tried again unless
  `retry_dropped`; an error of the infrastructure (network, environment) is
  reported and retried on the next run.
- Entries run in `jobs` threads; state writes and progress calls hold one lock.

Crash consistency (the rule of `atelier.fsio`): a task's commit point is the
rename of its validated directory into `<out>`; everything it owns is inside
that directory. What comes after is rebuilt on resume: a task found in
`<out>` whose state line was never written gets it then, `index.toml` is
rewritten from the tasks present, and `build-report.json` describes the
latest run. The staging directory is wiped at the start, and the mutation memo
is a cache whose torn last line is ignored. Every file is written through
`atomic_write`. The named crash points (`tasks_build.after_task`,
`after_state`, `after_entry`, `before_index`, `after_index`) are tested in
turn: a resumed build ends with the tasks, index and state of an
uninterrupted one.

The result: `<out>/index.toml` (every task built so far, with its split),
`<out>/build-report.json` (built, kept, dropped with reasons and grade flags,
errors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Literal

from atelier.config import dump_config
from atelier.fsio import atomic_write, crash_point
from atelier.tasks import release
from atelier.tasks.loader import INDEX_FILE, SuiteIndex, load_task
from atelier.tasks.mutation_tasks import MutationBuildError, build_mutation_tasks, sandbox_pytest_runner
from atelier.tasks.release import _canon, download_sdist
from atelier.tasks.schema import TaskError
from atelier.tasks.suite import MutationEntry, ReleaseEntry, Spec, atelier_cache
from atelier.tasks.validate import check_task, grade_flags, reason

WORK = ".atelier-build"
REPORT = "build-report.json"


@dataclasses.dataclass
class EntryResult:
    key: str
    kind: str
    split: str
    built: list[str] = dataclasses.field(default_factory=list)
    """Tasks built and validated in this run."""
    kept: list[str] = dataclasses.field(default_factory=list)
    """Tasks already there from an earlier run."""
    dropped: list[dict] = dataclasses.field(default_factory=list)
    """{"what": task or candidate, "reason": why}: release drops and tasks
    that failed validation. A validation drop also carries what each grading
    gave (`atelier.tasks.validate.grade_flags`: "tampered", "tamper_suspect",
    "grades" with each run's reward, error, tamper reasons and canary check),
    so a grader false positive (a gold patch graded `tampered`) shows in the
    report instead of hiding as a dropped candidate."""
    candidates_dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    """Mutation candidates dropped while searching, counted by reason."""
    error: str | None = None
    """An infrastructure error; the entry is retried on the next run."""
    fail_to_pass: int | None = None
    pass_to_pass: int | None = None

    @property
    def tasks(self) -> list[str]:
        return [*self.kept, *self.built]


@dataclasses.dataclass
class SuiteBuild:
    suite: str
    out: str
    entries: list[EntryResult]

    def to_json(self) -> dict:
        splits: dict[str, int] = {}
        for e in self.entries:
            splits[e.split] = splits.get(e.split, 0) + len(e.tasks)
        return {
            "suite": self.suite, "out": self.out,
            "built": sum(len(e.built) for e in self.entries),
            "kept": sum(len(e.kept) for e in self.entries),
            "dropped": sum(len(e.dropped) for e in self.entries),
            "errors": sum(e.error is not None for e in self.entries),
            "splits": splits,
            "entries": [dataclasses.asdict(e) for e in self.entries],
        }


Progress = Callable[[int, str], None]
"""(units done since the last call, a status line)."""


def plan(spec: Spec, only: Literal["release", "mutation"] | None = None,
         limit: int | None = None) -> tuple[list[ReleaseEntry], list[tuple[MutationEntry, int]]]:
    """The entries a build covers: `only` one kind; `limit` keeps the first
    `limit` release entries and at most `limit` mutation tasks in all."""
    releases = [] if only == "mutation" else list(spec.spec.release)
    mutations: list[tuple[MutationEntry, int]] = []
    if only != "release":
        left = limit if limit is not None else None
        for m in spec.spec.mutation:
            count = m.count if left is None else min(m.count, left)
            if count > 0:
                mutations.append((m, count))
            if left is not None:
                left -= count
    if limit is not None:
        releases = releases[:limit]
    return releases, mutations


def planned_units(spec: Spec, only=None, limit=None) -> int:
    """Progress total: one per release entry, one per mutation task asked for."""
    releases, mutations = plan(spec, only, limit)
    return len(releases) + sum(c for _, c in mutations)


class _State:
    """`<out>/.atelier-build/state.json`: final drops and mutation task lists."""

    def __init__(self, out: Path):
        self.path = out / WORK / "state.json"
        self.lock = threading.Lock()
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            self.data = {}

    def get(self, key: str) -> dict:
        with self.lock:
            return dict(self.data.get(key, {}))

    def put(self, key: str, value: dict) -> None:
        with self.lock:
            self.data[key] = value
            atomic_write(self.path, json.dumps(self.data, indent=1, sort_keys=True) + "\n")


class _Sources:
    """Unpacked sdists under `<cache>/sdists/<name>-<version>`, fetched once."""

    def __init__(self, cache: Path):
        self.root = cache / "sdists"
        self.locks: dict[str, threading.Lock] = {}
        self.guard = threading.Lock()

    def get(self, package: str, version: str) -> Path:
        name = f"{_canon(package)}-{version}"
        with self.guard:
            lock = self.locks.setdefault(name, threading.Lock())
        with lock:
            dest = self.root / name
            if dest.is_dir():
                return dest
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".dl-", dir=self.root) as tmp:
                os.replace(download_sdist(package, version, Path(tmp)), dest)
            return dest


def _validation_drop(task_dir: Path, runs: int, backend: str, envs: Path) -> dict | None:
    """None when the task is valid, else its drop record: {"reason", and the
    flags of every grading (`grade_flags`)}."""
    try:
        check = check_task(load_task(task_dir), runs, backend=backend, cache_dir=str(envs))
    except TaskError as exc:
        return {"reason": f"validation: {exc.message}", "tampered": False, "tamper_suspect": False,
                "grades": []}
    why = reason(check)
    return None if why is None else {"reason": f"validation: {why}", **grade_flags(check)}


def _done(task_dir: Path) -> bool:
    if not (task_dir / "task.toml").is_file():
        return False
    try:
        load_task(task_dir)
    except TaskError:
        shutil.rmtree(task_dir, ignore_errors=True)  # not ours to trust: rebuild it
        return False
    return True


class _Builder:
    def __init__(self, spec: Spec, out: Path, *, backend: str, cache: Path, retry_dropped: bool,
                 progress: Progress):
        self.spec, self.out, self.backend = spec, out, backend
        self.envs = cache / "envs"
        self.sources = _Sources(cache)
        self.state = _State(out)
        self.retry_dropped = retry_dropped
        self.lock = threading.Lock()
        self._progress = progress
        self.staging = out / WORK / "staging"

    def progress(self, n: int, msg: str) -> None:
        with self.lock:
            self._progress(n, msg)

    def release(self, entry: ReleaseEntry) -> EntryResult:
        res = EntryResult(entry.key, "release", entry.split)
        final = self.out / entry.task_id
        try:
            if _done(final):
                res.kept.append(entry.task_id)
                if self.state.get(entry.key) != {"tasks": [entry.task_id]}:  # killed before its state
                    self.state.put(entry.key, {"tasks": [entry.task_id]})
                return res
            known = self.state.get(entry.key)
            if known.get("dropped") and not self.retry_dropped:
                res.dropped.append({"what": entry.task_id, **known.get("drop", {"reason": known["dropped"]})})
                return res
            if entry.old_dir is not None:
                old, new = self.spec.local(entry.old_dir), self.spec.local(entry.new_dir)
            else:
                self.progress(0, f"{entry.task_id}: fetching sources")
                old = self.sources.get(entry.package, entry.from_version)
                new = self.sources.get(entry.package, entry.to_version)
            stage = self.staging / entry.task_id
            shutil.rmtree(stage, ignore_errors=True)
            report = release.build_release_task(
                old, new, stage, package=entry.package, old_version=entry.from_version,
                new_version=entry.to_version, requirements=entry.requirements,
                runner=release.sandbox_runner(self.backend, str(self.envs)), runs=self.spec.spec.runs,
                timeout_s=entry.timeout_s, select=entry.tests or None,
                progress=lambda msg: self.progress(0, msg))
            res.fail_to_pass, res.pass_to_pass = report.fail_to_pass, report.pass_to_pass
            drop = None if report.dropped is None else {"reason": report.dropped}
            if drop is None:
                self.progress(0, f"{entry.task_id}: validating")
                drop = _validation_drop(stage / entry.task_id, self.spec.spec.runs, self.backend, self.envs)
            if drop is not None:
                res.dropped.append({"what": entry.task_id, **drop})
                self.state.put(entry.key, {"dropped": drop["reason"], "drop": drop})
            else:
                os.replace(stage / entry.task_id, final)  # the task's commit point
                crash_point("tasks_build.after_task")
                res.built.append(entry.task_id)
                self.state.put(entry.key, {"tasks": [entry.task_id]})
                crash_point("tasks_build.after_state")
            shutil.rmtree(stage, ignore_errors=True)
        except TaskError as exc:
            res.error = exc.message
        except Exception as exc:  # noqa: BLE001 - one entry's crash must not stop the suite
            res.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.progress(1, f"{entry.task_id}: " + ("built" if res.built else "kept" if res.kept
                                                     else "error" if res.error else "dropped"))
        return res

    def mutation(self, entry: MutationEntry, count: int) -> EntryResult:
        # Long on purpose: `accept` and `on_progress` are closures over this entry's result and counters,
        # handed to build_mutation_tasks; the batch edge (the broad except) belongs with them.

        res = EntryResult(entry.key, "mutation", entry.split)
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", entry.key).strip("-")
        done_units = 0
        try:
            known = self.state.get(entry.key)
            if (known.get("complete") and known.get("count", 0) >= count
                    and all(_done(self.out / t) for t in known.get("tasks", []))):
                res.kept = list(known["tasks"])[:count]
                res.candidates_dropped = known.get("candidates_dropped", {})
                res.dropped = list(known.get("dropped", []))
                done_units = count
                return res
            repo = (self.spec.local(entry.path) if entry.path is not None
                    else self.sources.get(entry.package, entry.version))

            def accept(task_dir: str) -> str | None:
                nonlocal done_units
                path = Path(task_dir)
                final = self.out / path.name
                if _done(final):
                    res.kept.append(path.name)
                else:
                    self.progress(0, f"{entry.package}: validating {path.name}")
                    drop = _validation_drop(path, self.spec.spec.runs, self.backend, self.envs)
                    if drop is not None:
                        res.dropped.append({"what": path.name, **drop})
                        return drop["reason"]
                    os.replace(path, final)  # the task's commit point
                    crash_point("tasks_build.after_task")
                    res.built.append(path.name)
                    self.state.put(entry.key, {"count": count, "tasks": res.tasks, "complete": False,
                                               "dropped": res.dropped})
                    crash_point("tasks_build.after_state")
                done_units += 1
                self.progress(1, f"{entry.package}: {len(res.tasks)}/{count} mutation tasks")
                return None

            def on_progress(report) -> None:
                self.progress(0, f"{entry.package}: {len(res.tasks)}/{count} tasks, "
                                 f"{report.test_runs} test runs")

            stage = self.staging / slug
            shutil.rmtree(stage, ignore_errors=True)
            report = build_mutation_tasks(
                repo, stage, n=count, seed=entry.seed, max_k=entry.max_mutations,
                run_tests=sandbox_pytest_runner(self.backend, entry.timeout_s),
                max_attempts=entry.max_attempts, memo=self.out / WORK / "memo" / f"{slug}.jsonl",
                accept=accept, on_progress=on_progress)
            for d in report.dropped:
                if not d.reason.startswith("validation:"):  # those are in res.dropped already
                    res.candidates_dropped[d.reason] = res.candidates_dropped.get(d.reason, 0) + 1
            shutil.rmtree(stage, ignore_errors=True)
            self.state.put(entry.key, {"count": count, "tasks": res.tasks, "complete": True,
                                       "candidates_dropped": res.candidates_dropped,
                                       "dropped": res.dropped})
            crash_point("tasks_build.after_entry")
        except (TaskError, MutationBuildError) as exc:
            res.error = exc.message
        except Exception as exc:  # noqa: BLE001
            res.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.progress(max(0, count - done_units), f"{entry.package}: {len(res.tasks)} mutation tasks")
        return res


def build_suite(spec: Spec, out: str | Path, *, only: Literal["release", "mutation"] | None = None,
                limit: int | None = None, jobs: int = 1, backend: str = "bwrap",
                cache: str | Path | None = None, retry_dropped: bool = False,
                progress: Progress = lambda n, msg: None) -> SuiteBuild:
    """Build (or resume building) `spec` into `out`; see the module docstring."""
    if jobs < 1:
        raise TaskError(f"--jobs must be at least 1, got {jobs}", hint="use --jobs 1")
    if limit is not None and limit < 1:
        raise TaskError(f"--limit must be at least 1, got {limit}", hint="leave it out to build everything")
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    builder = _Builder(spec, out, backend=backend, cache=Path(cache) if cache else atelier_cache(),
                       retry_dropped=retry_dropped, progress=progress)
    shutil.rmtree(builder.staging, ignore_errors=True)  # beyond the last commit: a killed run's leftovers
    releases, mutations = plan(spec, only, limit)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(builder.release, e) for e in releases]
        futures += [pool.submit(builder.mutation, e, c) for e, c in mutations]
        results = [f.result() for f in futures]
    build = SuiteBuild(spec.spec.name, str(out), results)
    crash_point("tasks_build.before_index")
    write_index(spec, out, builder.state)
    crash_point("tasks_build.after_index")
    atomic_write(out / REPORT, json.dumps(build.to_json(), indent=2) + "\n")
    return build


def write_index(spec: Spec, out: Path, state: _State | None = None) -> list[str]:
    """`<out>/index.toml`: every task of the spec built so far, with its split."""
    state = state or _State(out)
    tasks: dict[str, str] = {}
    for r in spec.spec.release:
        if (out / r.task_id / "task.toml").is_file():
            tasks[r.task_id] = r.split
    for m in spec.spec.mutation:
        for t in state.get(m.key).get("tasks", []):
            if (out / t / "task.toml").is_file():
                tasks.setdefault(t, m.split)
    index = SuiteIndex(name=spec.spec.name, tasks=list(tasks), splits=tasks)
    atomic_write(out / INDEX_FILE, dump_config(index))
    return list(tasks)


def summarize_drops(entries: Iterable[EntryResult]) -> list[str]:
    """One line per drop or error, for people."""
    lines = []
    for e in entries:
        for d in e.dropped:
            flag = " [gold graded TAMPERED: a false positive of the grader]" if d.get("tampered") else ""
            lines.append(f"dropped {d['what']}: {d['reason']}{flag}")
        if e.candidates_dropped:
            counts = ", ".join(f"{n} x {why}" for why, n in sorted(e.candidates_dropped.items(),
                                                                   key=lambda kv: -kv[1]))
            lines.append(f"{e.key}: candidates dropped while searching: {counts}")
        if e.error:
            lines.append(f"error in {e.key} (retried next run): {e.error}")
    return lines
