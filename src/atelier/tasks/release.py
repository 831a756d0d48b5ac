"""Release-diff tasks: two consecutive releases of a pure-Python package.

Example: `atelier tasks build release-diff --package cachetools --from 5.1.0
--to 5.2.0 --out suites/release` (or `--old-dir A --new-dir B`).

- Base (`repo/`) is the older release as its sdist ships it (minus
  `*.egg-info`, `PKG-INFO` and caches), its own tests included.
- The gold patch is the diff of every non-test file, old → new, made by
  `atelier.sandbox.diff.unified_diff` (git-apply tested).
- Hidden tests are the newer release's test files: everything under a
  `tests/` or `test/` directory, `test_*.py`, `*_test.py`, `conftest.py`.
- The newer tests run three times against base and three times against base
  + gold, each run in a fresh sandbox with the task's environment and
  `--continue-on-collection-errors` (a new test module that cannot import at
  base still lets the others run; its tests count as failing there).
  FAIL_TO_PASS: failed, errored or absent in all three base runs and passed in
  all three gold runs. PASS_TO_PASS: passed in all six. A test whose status
  changes across the three runs of one side is flaky and in neither list.
- The prompt is the newer release's changelog entry, heading stripped, as
  the maintainers wrote it (`atelier.tasks.changelog.changelog_entry`, pure).
- The environment is `PythonEnv(python="3.11", system_site_packages=True)`
  with the new release's `Requires-Dist` (PKG-INFO; requirements behind an
  `extra` other than test/tests/testing are left out, other markers are
  evaluated for 3.11) pinned to what pip resolves today.
- The test command is `atelier.tasks.pytest_ini.test_command` of the new
  release: src-layouts get `src` added to the project's own `pythonpath`,
  coverage/xdist options are left out of its `addopts` (the task
  environment has neither plugin), and environment plugins that neither
  release mentions are switched off (`pytest_ini.idle_plugin_args`).

A candidate without a changelog entry, without a changed non-test file, or
without any FAIL_TO_PASS test is dropped with that reason; nothing is
invented. Not covered: packages with compiled extensions, packages that need
their installed metadata (`importlib.metadata.version`) at import time (their
tests fail on both sides and the candidate is dropped), and test dependencies
that are not declared in a test extra.
"""

from __future__ import annotations

import dataclasses
import email.parser
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Callable

from packaging.requirements import InvalidRequirement, Requirement

from atelier.compat import tomllib
from atelier.sandbox import SandboxError, create_sandbox
from atelier.sandbox.diff import unified_diff
from atelier.sandbox.fsutil import entry_beneath
from atelier.tasks import pytest_ini
from atelier.tasks.changelog import changelog_entry
from atelier.tasks.envs import ensure_env, env_mounts, env_python
from atelier.tasks.grade import EXIT_MEANING, _restore_tests, test_argv
from atelier.tasks.junit import JUnitError, parse_junit
from atelier.tasks.schema import PythonEnv, Task, TaskError, TaskLimits, TaskMetadata, TaskSpec, node_file
from atelier.tasks.writer import write_task

RUNS = 3
PYTHON = "3.11"
TEST_EXTRAS = ("test", "tests", "testing")
_SKIP_DIRS = {".git", ".hg", ".tox", ".nox", ".venv", "__pycache__", ".pytest_cache",
              ".mypy_cache", ".ruff_cache", "build", "dist"}
_TEST_DIRS = {"tests", "test"}
CHANGELOG_NAMES = ("CHANGES", "CHANGELOG", "HISTORY", "NEWS", "RELEASE_NOTES", "RELEASES")
DOCS_CHANGELOG_NAMES = ("VERSIONS", "WHATSNEW", "WHATS_NEW", "RELEASE", "NEWS")
DOCS_DEPTH = 3


# --- files --------------------------------------------------------------------
def is_test_path(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    name = parts[-1]
    return (any(p in _TEST_DIRS for p in parts[:-1]) or name == "conftest.py"
            or (name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))))


def is_test_module(rel: str) -> bool:
    name = PurePosixPath(rel).name
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def release_files(root: Path) -> list[str]:
    """Repository paths of a release's files, without packaging leftovers."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        rel_dir = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix()
            if rel == "PKG-INFO" or name.endswith((".pyc", ".pyo")):
                continue
            found.append(rel)
    return found


def release_diff(old: Path, new: Path, paths: list[str]) -> str:
    """A `git apply`-able diff of `paths` from `old` to `new`."""
    old_fd = os.open(old, os.O_RDONLY | os.O_DIRECTORY)
    new_fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return unified_diff(paths, lambda p: entry_beneath(old_fd, p), lambda p: entry_beneath(new_fd, p))
    finally:
        os.close(old_fd)
        os.close(new_fd)


def find_changelog(root: Path) -> list[Path]:
    """Changelog candidates, most likely first: the root, then `docs/` and
    `doc/`, then their subdirectories down to `DOCS_DEPTH` levels
    (`docs/source/changes.rst`, `docs/src/markdown/about/changelog.md`)."""
    def named(p: Path, in_docs: bool) -> bool:
        stem = p.name.split(".")[0].upper().replace("-", "_")
        return p.is_file() and (stem in CHANGELOG_NAMES or (in_docs and (
            stem.startswith(("CHANGE", "HISTORY")) or stem in DOCS_CHANGELOG_NAMES)))

    found = [p for p in sorted(root.iterdir()) if named(p, False)]
    deeper: list[Path] = []
    for top in (root / "docs", root / "doc"):
        if not top.is_dir():
            continue
        found += [p for p in sorted(top.iterdir()) if named(p, True)]
        for dirpath, dirnames, filenames in os.walk(top):
            depth = len(Path(dirpath).relative_to(top).parts)
            dirnames[:] = sorted(d for d in dirnames if depth < DOCS_DEPTH and not d.startswith(("_", ".")))
            if depth:
                deeper += [p for name in sorted(filenames) if named(p := Path(dirpath) / name, True)]
    return found + deeper


def read_metadata(root: Path) -> dict[str, list[str]]:
    """PKG-INFO headers (name → values), {} when there is none."""
    for p in (root / "PKG-INFO", *sorted(root.glob("*.egg-info/PKG-INFO")),
              *sorted(root.glob("src/*.egg-info/PKG-INFO"))):
        if p.is_file():
            msg = email.parser.Parser().parsestr(p.read_text(encoding="utf-8", errors="replace"),
                                                 headersonly=True)
            out: dict[str, list[str]] = {}
            for k, v in msg.items():
                out.setdefault(k.lower(), []).append(str(v))
            return out
    return {}


def local_field(root: Path, field: str) -> str | None:
    """`field` ("name" or "version") from PKG-INFO, else pyproject's [project]."""
    meta = read_metadata(root)
    if meta.get(field):
        return meta[field][0]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        try:
            value = tomllib.loads(pyproject.read_text()).get("project", {}).get(field)
        except tomllib.TOMLDecodeError:
            value = None
        if isinstance(value, str):
            return value
    return None


def runtime_requirements(requires_dist: list[str], python: str = PYTHON,
                         exclude: str = "") -> list[str]:
    """`Requires-Dist` values worth installing: no extras except the test ones,
    other markers evaluated for `python`, none named `exclude` (the package)."""
    out = []
    for spec in requires_dist:
        try:
            req = Requirement(spec)
        except InvalidRequirement:
            continue
        if _canon(req.name) == _canon(exclude):
            continue
        if req.marker is not None:
            env = {"python_version": python, "python_full_version": python + ".0", "extra": ""}
            if not req.marker.evaluate(env) and not any(
                    req.marker.evaluate({**env, "extra": e}) for e in TEST_EXTRAS):
                continue
        req.marker = None
        out.append(str(req))
    return sorted(dict.fromkeys(out))


def pin_requirements(requirements: list[str]) -> list[str]:
    """Each requirement pinned (`name==version`) to what pip resolves now."""
    if not requirements:
        return []
    with tempfile.TemporaryDirectory(prefix="atelier-pin-") as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--disable-pip-version-check", "--report", str(report), *requirements],
            capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not report.is_file():
            raise TaskError(f"cannot resolve the requirements {', '.join(requirements)}: "
                            + (proc.stderr.strip().splitlines() or ["pip failed"])[-1],
                            hint="check the network, or pass --no-deps")
        data = json.loads(report.read_text())
    versions = {_canon(i["metadata"]["name"]): i["metadata"]["version"] for i in data["install"]}

    pinned = []
    for spec in requirements:
        req = Requirement(spec)
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        pinned.append(f"{req.name}{extras}=={versions[_canon(req.name)]}")
    return pinned


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- sources ------------------------------------------------------------------
def download_sdist(package: str, version: str, dest: Path) -> Path:
    """The unpacked source distribution of `package==version` from PyPI.
    Only the package itself is refused as a wheel (`--no-binary NAME`): its
    build backend, which pip needs to read the sdist's metadata, may come as
    a wheel, which is far cheaper than building setuptools from source."""
    dl = dest / "download"
    dl.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", package, "--no-deps",
             "--disable-pip-version-check", "--quiet", f"{package}=={version}", "-d", str(dl)],
            capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise TaskError(f"pip download {package}=={version} took over 600 s",
                        hint="check the network") from None
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        if "No matching distribution" in out or "Could not find a version" in out:
            raise TaskError(f"PyPI has no source distribution of {package}=={version}",
                            hint=f"check the name and version: pip index versions {package}")
        tail = "\n".join(out.strip().splitlines()[-5:])
        raise TaskError(f"pip download {package}=={version} failed:\n{tail}",
                        hint="check the network and the package name")
    archives = [p for p in dl.iterdir() if p.name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".zip"))]
    if not archives:
        raise TaskError(f"pip download {package}=={version} gave no sdist archive",
                        hint="the release may ship only wheels; use --old-dir/--new-dir")
    return unpack(archives[0], dest / "src")


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack an sdist; its single top directory when it has one."""
    dest.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(dest)
    else:
        with tarfile.open(archive) as tf:
            tf.extractall(dest, filter="data")
    entries = list(dest.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else dest


# --- test runs ----------------------------------------------------------------
Statuses = dict[str, str]
Runner = Callable[[Task, str], Statuses]
"""(probe task, patch) → {node id: status} of one run of the hidden test modules."""


def sandbox_runner(backend: str = "bwrap", cache_dir: str | None = None) -> Runner:
    """Run the probe task's test modules in a fresh sandbox, as `grade` would."""
    def run(task: Task, patch: str) -> Statuses:
        venv = ensure_env(task, cache_dir)
        config = task.limits.sandbox_config(backend=backend, ro_mounts=env_mounts(venv) if venv else [],
                                            output_limit_bytes=64 * 2**20)
        with create_sandbox(task.snapshot, config) as sb:
            if patch.strip():
                applied = sb.exec(["git", "apply", "--whitespace=nowarn", "-"], stdin=patch.encode(),
                                  timeout=60)
                if not applied.ok:
                    raise TestRunFailed("the gold patch does not apply: "
                                        + (applied.stderr or applied.stdout).strip()[-500:])
            _restore_tests(sb, task)
            junit = ".atelier-probe-junit.xml"
            run_ = sb.exec(test_argv(task, env_python(venv) if venv else None, junit),
                           timeout=task.limits.timeout_s, env={"PYTHONDONTWRITEBYTECODE": "1"})
            tail = (run_.stdout + run_.stderr).strip()[-800:]
            if run_.timed_out:
                raise TestRunFailed(f"the test run timed out after {task.limits.timeout_s:g} s")
            if run_.exit_code not in (0, 1):
                raise TestRunFailed(f"pytest exited {run_.exit_code} "
                                    f"({EXIT_MEANING.get(run_.exit_code, 'unknown')}): {tail}")
            try:
                results = parse_junit(sb.read_file(junit), known_files=task.test_files())
            except (JUnitError, SandboxError) as exc:
                raise TestRunFailed(f"no readable result file ({exc}): {tail}") from None
        return dict(results)

    return run


class TestRunFailed(RuntimeError):
    """A probe run that gave no trustworthy results."""

    __test__ = False


def split_tests(base: list[Statuses], gold: list[Statuses],
                modules: list[str] | None = None) -> tuple[list[str], list[str], list[str]]:
    """(FAIL_TO_PASS, PASS_TO_PASS, flaky) from the runs of each side (pure).
    Absent from a run means not run (its module failed to import). With
    `modules`, ids in other files are left out: JUnit names an inherited test
    method by the file that defines it (`tests/__init__.py::LRUTest::t`),
    an id pytest cannot select."""
    names = sorted({t for r in [*base, *gold] for t in r
                    if modules is None or node_file(t) in modules})
    f2p, p2p, flaky = [], [], []
    for t in names:
        b = {r.get(t, "absent") for r in base}
        g = {r.get(t, "absent") for r in gold}
        if len(b) > 1 or len(g) > 1:
            flaky.append(t)
        elif g == {"passed"} and b <= {"failed", "error", "absent"}:
            f2p.append(t)
        elif g == {"passed"} and b == {"passed"}:
            p2p.append(t)
    return f2p, p2p, flaky


# --- building -----------------------------------------------------------------
@dataclasses.dataclass
class ReleaseReport:
    package: str
    old_version: str
    new_version: str
    task_id: str
    task_dir: str | None = None
    dropped: str | None = None
    """Why no task was written."""
    fail_to_pass: int = 0
    pass_to_pass: int = 0
    flaky: list[str] = dataclasses.field(default_factory=list)
    files_changed: int = 0
    test_runs: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def drop(self, reason: str) -> ReleaseReport:
        """No task: say why."""
        self.dropped = reason
        return self


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "pkg"


def build_release_task(old_dir: str | Path, new_dir: str | Path, out: str | Path, *,
                       package: str | None = None, old_version: str | None = None,
                       new_version: str | None = None, requirements: list[str] | None = None,
                       runner: Runner | None = None, runs: int = RUNS, timeout_s: float = 600.0,
                       progress: Callable[[str], None] = lambda msg: None,
                       overwrite: bool = False, select: list[str] | None = None) -> ReleaseReport:
    """Build one task from two release directories into `out/<id>`.

    `requirements` None means: the new release's runtime requirements,
    pinned (needs the network when there are any); pass [] for none.
    `select` (globs of repository paths) keeps only those test modules for
    the probe runs, FAIL_TO_PASS and PASS_TO_PASS (a slow or flaky module
    left out); every new test file is still hidden and restored at grading.
    """
    old, new = Path(old_dir).resolve(), Path(new_dir).resolve()
    for label, d in (("old", old), ("new", new)):
        if not d.is_dir():
            raise TaskError(f"the {label} release directory {d} does not exist",
                            hint="pass the unpacked source of each release")
    meta = read_metadata(new)
    package = package or local_field(new, "name") or new.name
    old_version = old_version or local_field(old, "version")
    new_version = new_version or local_field(new, "version")
    if not old_version or not new_version:
        raise TaskError(f"cannot tell the version of {old if not old_version else new}",
                        hint="it has no PKG-INFO or pyproject [project].version; pass --from and --to")
    task_id = _slug(f"{package}-{old_version}-to-{new_version}")
    report = ReleaseReport(package, old_version, new_version, task_id)
    if (Path(out) / task_id).exists() and not overwrite:
        raise TaskError(f"task {task_id}: {Path(out) / task_id} already exists",
                        hint="choose another --out, remove the old task, or pass --overwrite")
    logs = find_changelog(new)
    entry = next((e for p in logs if (e := changelog_entry(p.read_text(encoding="utf-8", errors="replace"),
                                                           new_version))), None)
    if entry is None:
        looked = ", ".join(p.relative_to(new).as_posix() for p in logs) or "no changelog file found"
        return report.drop(f"no changelog entry for {new_version} ({looked})")
    old_files, new_files = release_files(old), release_files(new)
    source_paths = sorted({p for p in [*old_files, *new_files] if not is_test_path(p)})
    gold = release_diff(old, new, source_paths)
    if not gold.strip():
        return report.drop(f"no non-test file changed between {old_version} and {new_version}")
    hidden = {p: (new / p).read_bytes() for p in new_files if is_test_path(p)}
    modules = sorted(p for p in hidden if is_test_module(p)
                     and (not select or any(fnmatch.fnmatchcase(p, g) for g in select)))
    if not modules:
        return report.drop(f"the {new_version} release ships no test modules"
                           + (f" matching {', '.join(select)}" if select else ""))
    changed = sorted({line.split(" b/", 1)[-1] for line in gold.splitlines()
                      if line.startswith("diff --git ")})
    report.files_changed = len(changed)
    if requirements is None:
        requirements = pin_requirements(runtime_requirements(meta.get("requires-dist", []),
                                                             exclude=package))
    test_command = pytest_ini.test_command(new, src_layout=(old / "src").is_dir(), also=(old,))
    spec = TaskSpec(
        id=task_id, prompt=entry,
        env=PythonEnv(python=PYTHON, requirements=requirements, system_site_packages=True),
        hidden_tests=sorted(hidden), test_command=test_command,
        metadata=TaskMetadata(source="release-diff", category="release",
                              files_changed=len(changed), lines_changed=_changed_lines(gold)),
        limits=TaskLimits(timeout_s=timeout_s))
    release = _Release(old, spec, gold, hidden, modules)
    return _probe_and_write(release, report, Path(out), runner or sandbox_runner(), runs, progress, overwrite)


@dataclasses.dataclass
class _Release:
    """What a release task is built from: the old release, the spec so far, the gold diff, the
    new release's test files (hidden) and the test modules its probe runs."""

    old: Path
    spec: TaskSpec
    gold: str
    hidden: dict[str, bytes]
    modules: list[str]


def _probe_and_write(release: _Release, report: ReleaseReport, out: Path, run: Runner, runs: int,
                     progress: Callable[[str], None], overwrite: bool) -> ReleaseReport:
    """The new release's tests `runs` times on the old code and on the gold patch: the tests
    that fail before and pass after are FAIL_TO_PASS; with any, the task is written."""
    old, spec, gold, hidden, modules = release.old, release.spec, release.gold, release.hidden, release.modules
    with tempfile.TemporaryDirectory(prefix="atelier-release-") as tmp:
        base = Path(tmp) / "repo"
        shutil.copytree(old, base, symlinks=True,
                        ignore=lambda d, names: [n for n in names if n in _SKIP_DIRS
                                                 or n.endswith((".egg-info", ".pyc"))
                                                 or (Path(d) == old and n == "PKG-INFO")])
        tests = Path(tmp) / "tests"
        for rel, data in hidden.items():
            (tests / rel).parent.mkdir(parents=True, exist_ok=True)
            (tests / rel).write_bytes(data)
        probe = Task(**spec.model_dump(exclude={"test_command"}),
                     test_command=spec.test_command + " --continue-on-collection-errors",
                     root=Path(tmp), snapshot=base, gold_patch=gold)
        probe = probe.model_copy(update={"fail_to_pass": modules})
        sides: dict[str, list[Statuses]] = {"base": [], "gold": []}
        for side, patch in (("base", ""), ("gold", gold)):
            for i in range(runs):
                progress(f"{spec.id}: running the {report.new_version} tests on {side} ({i + 1}/{runs})")
                try:
                    sides[side].append(run(probe, patch))
                except TestRunFailed as exc:
                    return report.drop(f"{side} run {i + 1}: {exc}")
                report.test_runs += 1
        f2p, p2p, flaky = split_tests(sides["base"], sides["gold"], modules)
        report.fail_to_pass, report.pass_to_pass, report.flaky = len(f2p), len(p2p), flaky
        if not f2p:
            return report.drop(f"no test fails at {report.old_version} and passes at {report.new_version} "
                               f"({len(p2p)} pass on both, {len(flaky)} flaky)")
        spec = spec.model_copy(update={"fail_to_pass": f2p, "pass_to_pass": p2p})
        task = write_task(out / spec.id, spec, base, hidden, gold, overwrite=overwrite)
    report.task_dir = str(task.root)
    return report


def build_from_pypi(package: str, old_version: str, new_version: str, out: str | Path,
                    **kw) -> ReleaseReport:
    """Download both sdists from PyPI and build the task."""
    progress = kw.get("progress", lambda msg: None)
    with tempfile.TemporaryDirectory(prefix="atelier-sdist-") as tmp:
        progress(f"downloading {package}=={old_version} and {package}=={new_version}")
        old = download_sdist(package, old_version, Path(tmp) / "old")
        new = download_sdist(package, new_version, Path(tmp) / "new")
        return build_release_task(old, new, out, package=package, old_version=old_version,
                                  new_version=new_version, **kw)


def _changed_lines(patch: str) -> int:
    return sum(1 for line in patch.splitlines()
               if line[:1] in "+-" and not line.startswith(("+++ ", "--- ")))
