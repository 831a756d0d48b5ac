"""Suite specs: which real packages, releases and settings a benchmark is built
from, committed as TOML (package names and versions, never third-party code).

Example (`suites/atelier-bench.toml`)::

    name = "atelier-bench"
    version = "0"

    [[release]]                 # one release-diff task: split "test"
    package = "cachetools"
    from_version = "5.1.0"
    to_version = "5.2.0"
    tests = ["tests/test_cached.py"]   # optional: only these test modules (globs)
    fail_to_pass = 10                  # optional: as measured when added
    pass_to_pass = 96

    [[mutation]]                # up to `count` mutation tasks: split "train"
    package = "toolz"
    version = "0.12.1"
    seed = 0
    count = 120

An entry names a PyPI release (sdists fetched by `pip download`), or local
directories relative to the spec file (`old_dir`/`new_dir` for a release,
`path` for a mutation source), which is what the tests use.

`resolve_spec(name_or_path)` finds a spec: a path to a `.toml` file, or the
name of one under the repository's `suites/` directory; an unknown name is a
`SuiteError` that lists the known ones. Building is `atelier.tasks.suite_build`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, model_validator

from atelier.config import AtelierConfig, ConfigError, load_config
from atelier.tasks.release import _slug
from atelier.tasks.schema import TaskError

SUITES_DIR = Path(__file__).resolve().parents[3] / "suites"
"""The committed specs of a source checkout (an editable install finds them)."""

_VERSION = r"^[0-9A-Za-z][0-9A-Za-z.+!_-]*$"
_PACKAGE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class SuiteError(TaskError):
    """A suite spec that cannot be found or read as written."""


class ReleaseEntry(AtelierConfig):
    """Two consecutive releases of one package → one release-diff task."""

    package: str = Field(pattern=_PACKAGE)
    """The package's PyPI name."""
    from_version: str = Field(pattern=_VERSION)
    """The older release: the task's base."""
    to_version: str = Field(pattern=_VERSION)
    """The newer release: its code is the gold patch, its tests the hidden tests."""
    old_dir: Optional[str] = None
    """Unpacked older release, relative to the spec file, instead of PyPI."""
    new_dir: Optional[str] = None
    """Unpacked newer release, relative to the spec file, instead of PyPI."""
    tests: list[str] = Field(default_factory=list)
    """Test modules to run (globs of repository paths); empty: all of them."""
    requirements: Optional[list[str]] = None
    """Pinned requirements; None: the new release's, resolved at build time."""
    timeout_s: float = Field(300.0, gt=0)
    """Wall-clock limit of one graded test run."""
    split: Literal["test", "train", "dev"] = "test"
    """The suite split the task goes to."""
    fail_to_pass: Optional[int] = Field(None, ge=1)
    """Informational: FAIL_TO_PASS count when the entry was validated."""
    pass_to_pass: Optional[int] = Field(None, ge=0)
    """Informational: PASS_TO_PASS count when the entry was validated."""

    @model_validator(mode="after")
    def _dirs_together(self) -> "ReleaseEntry":
        if (self.old_dir is None) != (self.new_dir is None):
            raise ValueError("old_dir and new_dir go together (both local, or neither: PyPI)")
        return self

    @property
    def task_id(self) -> str:
        return _slug(f"{self.package}-{self.from_version}-to-{self.to_version}")

    @property
    def key(self) -> str:
        return f"release:{self.package}=={self.from_version}->{self.to_version}"


class MutationEntry(AtelierConfig):
    """One real repository → up to `count` mutation tasks."""

    package: str = Field(pattern=_PACKAGE)
    """The package's name (its PyPI name with `version`)."""
    version: Optional[str] = Field(None, pattern=_VERSION)
    """The PyPI release whose sdist is mutated (with `path`, informational)."""
    path: Optional[str] = None
    """A local repository, relative to the spec file, instead of PyPI."""
    seed: int = 0
    """Seeds the mutation search."""
    count: int = Field(ge=1)
    """Tasks built at most."""
    max_attempts: Optional[int] = Field(None, ge=1)
    """Single candidates tested at most (default: 20 × count)."""
    timeout_s: float = Field(120.0, gt=0)
    """Wall-clock limit of one graded test run."""
    split: Literal["test", "train", "dev"] = "train"
    """The suite split the tasks go to."""
    max_mutations: int = Field(3, ge=1)
    """Mutations combined in one task at most (its size is drawn from 1..this).
    Combinations spread over files; 1 keeps every task inside one source file."""

    @model_validator(mode="after")
    def _source(self) -> "MutationEntry":
        if (self.version is None) == (self.path is None):
            raise ValueError("give exactly one of version (a PyPI release) or path (a local repository)")
        return self

    @property
    def key(self) -> str:
        source = self.version if self.path is None else f"path:{self.path}"
        size = "" if self.max_mutations == 3 else f":max_mutations={self.max_mutations}"
        return f"mutation:{self.package}=={source}:seed={self.seed}{size}"


class SuiteSpec(AtelierConfig):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The suite's name (its directory's name by default)."""
    version: str = "0"
    """The spec's version."""
    description: str = ""
    """What the suite is, for people."""
    runs: int = Field(3, ge=1)
    """Probe runs per side for release diffs, and gold grading runs at validation."""
    release: list[ReleaseEntry] = Field(default_factory=list)
    """Release-diff entries, each a `[[release]]` table."""
    mutation: list[MutationEntry] = Field(default_factory=list)
    """Mutation entries, each a `[[mutation]]` table."""

    @model_validator(mode="after")
    def _unique(self) -> "SuiteSpec":
        seen: set[str] = set()
        for entry in [*self.release, *self.mutation]:
            if entry.key in seen:
                raise ValueError(f"entry {entry.key} is listed twice")
            seen.add(entry.key)
        return self


class Spec:
    """A loaded spec and the file it came from (local paths are relative to it)."""

    def __init__(self, spec: SuiteSpec, path: Path):
        self.spec, self.path = spec, path

    def local(self, rel: str) -> Path:
        return (self.path.parent / rel).resolve()


def known_suites() -> list[str]:
    return sorted(p.stem for p in SUITES_DIR.glob("*.toml")) if SUITES_DIR.is_dir() else []


def resolve_spec(name_or_path: str | os.PathLike) -> Spec:
    """The spec at a path, or the committed spec of that name."""
    text = str(name_or_path)
    path = Path(text)
    if not path.is_file():
        if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", text) and (SUITES_DIR / f"{text}.toml").is_file():
            path = SUITES_DIR / f"{text}.toml"
        else:
            known = known_suites()
            raise SuiteError(f"unknown suite {text!r}: neither a spec file nor a known suite name",
                             hint="known suites: " + (", ".join(known) or "none")
                             + "; or pass the path of a spec .toml")
    return load_spec(path)


def load_spec(path: str | os.PathLike) -> Spec:
    path = Path(path).resolve()
    try:
        spec = load_config(SuiteSpec, path)
    except ConfigError as exc:
        raise SuiteError(f"suite spec {path.name}: {exc.message}",
                         hint=exc.hint or "see atelier.tasks.suite for the spec format") from None
    if not spec.release and not spec.mutation:
        raise SuiteError(f"suite spec {path.name} lists no entries",
                         hint="add [[release]] or [[mutation]] tables")
    loaded = Spec(spec, path)
    for entry in spec.release:
        for rel in (entry.old_dir, entry.new_dir):
            if rel is not None and not loaded.local(rel).is_dir():
                raise SuiteError(f"suite spec {path.name}: {entry.key}: directory {rel} not found "
                                 f"(relative to {path.parent})",
                                 hint="local directories are relative to the spec file")
    for m in spec.mutation:
        if m.path is not None and not loaded.local(m.path).is_dir():
            raise SuiteError(f"suite spec {path.name}: {m.key}: directory {m.path} not found "
                             f"(relative to {path.parent})",
                             hint="local directories are relative to the spec file")
    return loaded


def atelier_cache() -> Path:
    """`$ATELIER_CACHE`, else `~/.cache/atelier` (envs live in its `envs/`)."""
    base = os.environ.get("ATELIER_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "atelier"
