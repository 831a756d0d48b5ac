"""What a repository says it needs, read from its files without running them.

`declared_requirements(root)` collects requirement strings from, in order:
`pyproject.toml` (`[project] dependencies` and the test extras of
`[project.optional-dependencies]`), `setup.cfg` (`[options] install_requires`
and the test extras of `[options.extras_require]`) and requirements files
that name tests (`requirements.txt`, `requirements-test.txt`,
`requirements-dev.txt`, `test-requirements.txt`, `dev-requirements.txt`,
`requirements/test.txt`, `requirements/dev.txt`). Lines that point
elsewhere (`-r`, `-e`, `-c`, URLs, local paths) are skipped and named in
`skipped`, never guessed at. `setup.py` is code: it is not run, and a
repository that declares its needs only there is reported as such, so the
caller can ask for an explicit list instead.
"""

from __future__ import annotations

import configparser
from dataclasses import dataclass, field
from pathlib import Path

from atelier.compat import tomllib

TEST_EXTRAS = ("test", "tests", "testing", "dev")
REQUIREMENTS_FILES = ("requirements.txt", "requirements-test.txt", "requirements-dev.txt",
                      "test-requirements.txt", "dev-requirements.txt", "requirements/test.txt",
                      "requirements/dev.txt")


@dataclass
class Declared:
    requirements: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)     # files the requirements came from
    skipped: list[str] = field(default_factory=list)     # lines that were not plain requirements
    name: str | None = None                               # the project's own name, when declared
    setup_py_only: bool = False                           # needs declared only in setup.py (not run)


def declared_requirements(root: Path) -> Declared:
    out = Declared()
    _from_pyproject(root / "pyproject.toml", out)
    _from_setup_cfg(root / "setup.cfg", out)
    for rel in REQUIREMENTS_FILES:
        if (root / rel).is_file():
            _from_requirements_file(root / rel, rel, out)
    out.requirements = list(dict.fromkeys(r for r in out.requirements if r))
    out.setup_py_only = (root / "setup.py").is_file() and not out.sources
    return out


def _from_pyproject(path: Path, out: Declared) -> None:
    if not path.is_file():
        return
    try:
        project = tomllib.loads(path.read_text(encoding="utf-8")).get("project", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        out.skipped.append("pyproject.toml (not valid TOML)")
        return
    found = list(project.get("dependencies", []) or [])
    extras = project.get("optional-dependencies", {}) or {}
    found += [r for e in TEST_EXTRAS for r in extras.get(e, []) or []]
    out.name = out.name or project.get("name")
    if found or "dependencies" in project:
        out.sources.append("pyproject.toml")
        out.requirements += [str(r).strip() for r in found]


def _from_setup_cfg(path: Path, out: Declared) -> None:
    if not path.is_file():
        return
    cfg = configparser.ConfigParser(interpolation=None)
    try:
        cfg.read_string(path.read_text(encoding="utf-8"))
    except (configparser.Error, UnicodeDecodeError):
        out.skipped.append("setup.cfg (not readable)")
        return
    found = _lines(cfg.get("options", "install_requires", fallback=""))
    if cfg.has_section("options.extras_require"):
        found += [r for e in TEST_EXTRAS for r in _lines(cfg.get("options.extras_require", e, fallback=""))]
    out.name = out.name or cfg.get("metadata", "name", fallback=None)
    if found or cfg.has_option("options", "install_requires"):
        out.sources.append("setup.cfg")
        out.requirements += found


def _from_requirements_file(path: Path, rel: str, out: Declared) -> None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        out.skipped.append(f"{rel} (not readable)")
        return
    found = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-") or "://" in line or line.startswith((".", "/")):
            out.skipped.append(f"{rel}: {line}")
            continue
        found.append(line)
    out.sources.append(rel)
    out.requirements += found


def _lines(value: str) -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in value.splitlines() if ln.split("#", 1)[0].strip()]
