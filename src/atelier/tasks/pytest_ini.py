"""A repository's own pytest settings, and the command a release task runs.

`read_ini(root)` reads the file pytest itself would take in the repository
root, in pytest's order: `pytest.ini`, `.pytest.ini`, `pyproject.toml` with
`[tool.pytest.ini_options]`, `tox.ini` with `[pytest]`, `setup.cfg` with
`[tool:pytest]`. It returns the two settings the command depends on,
`addopts` and `pythonpath`, as lists of arguments.

`test_command(root, src_layout)` is `python -m pytest` plus, where needed:
- for an `src/` layout, `--rootdir=. -o pythonpath=…` that keeps the
  project's own `pythonpath` entries (`pythonpath = src tests` must not lose
  `tests`) and adds `src`; nothing when the project already lists `src`;
- `-o addopts=…` without the options of plugins a task environment does not
  install: coverage (`--cov…`, `--no-cov…`) and xdist (`-n N`,
  `--numprocesses`, `--dist`, `--maxprocesses`). They only report or
  distribute; without the plugin pytest refuses to start. Every other
  option (doctest, import mode, strictness) is kept as written.

`idle_plugin_args(*roots)` switches off (`-p no:NAME`) the plugins of the
shared task environment that a repository never mentions: hypothesis's
plugin costs about 1.4 CPU-seconds per pytest start there, pytest-benchmark's
about 0.3, more than a small suite's own tests. A test that does not use a
plugin runs the same without it; any file that names it keeps it on.

Not covered: plugins named elsewhere (`-p name` in addopts stays), and
settings of a configuration file outside the repository root.
"""

from __future__ import annotations

import configparser
import os
import shlex
from pathlib import Path

from atelier.compat import tomllib

_PLUGIN_FLAGS = ("--cov", "--no-cov")
"""Option prefixes dropped as a single argument (`--cov=pkg`, `--no-cov-on-fail`)."""
_WITH_VALUE = {"--cov", "--cov-report", "--cov-config", "--cov-fail-under", "--cov-context",
               "-n", "--numprocesses", "--dist", "--maxprocesses"}
"""Options that take their value as the next argument when written without `=`."""


def _ini_section(path: Path, section: str) -> dict[str, str] | None:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(path.read_text(encoding="utf-8", errors="replace"))
    except configparser.Error:
        return None
    return dict(parser[section]) if parser.has_section(section) else None


def _args(value: object) -> list[str]:
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError:
            return value.split()
    return []


def read_ini(root: Path) -> dict[str, list[str]] | None:
    """{"addopts": [...], "pythonpath": [...]} from the pytest configuration
    file pytest would use in `root`, or None when there is none."""
    for name, section in (("pytest.ini", "pytest"), (".pytest.ini", "pytest"),
                          ("pyproject.toml", None), ("tox.ini", "pytest"),
                          ("setup.cfg", "tool:pytest")):
        path = root / name
        if not path.is_file():
            continue
        if section is None:
            try:
                data = tomllib.loads(path.read_text(encoding="utf-8", errors="replace"))
            except tomllib.TOMLDecodeError:
                continue
            values = data.get("tool", {}).get("pytest", {}).get("ini_options")
            if not isinstance(values, dict):
                continue
        else:
            values = _ini_section(path, section)
            if values is None:
                if name.endswith("pytest.ini"):  # pytest takes it even without the section
                    return {"addopts": [], "pythonpath": []}
                continue
        return {"addopts": _args(values.get("addopts")), "pythonpath": _args(values.get("pythonpath"))}
    return None


def strip_plugin_options(args: list[str]) -> list[str]:
    """`args` without coverage and xdist options (pure)."""
    out: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
            if not arg.startswith("-"):
                continue
        name = arg.split("=", 1)[0]
        if name.startswith(_PLUGIN_FLAGS) or name in _WITH_VALUE or (
                name.startswith("-n") and not name.startswith("--") and name[2:].isalnum()):
            skip_value = "=" not in arg and name in _WITH_VALUE
            continue
        out.append(arg)
    return out


IDLE_PLUGINS = {"hypothesispytest": "hypothesis", "benchmark": "benchmark"}
"""Entry-point name of a plugin of the task environment → the word whose
absence from every file of a repository lets it be switched off."""
_SCANNED = (".py", ".cfg", ".toml", ".ini", ".txt")
_NOT_SCANNED_DIRS = {".git", ".hg", ".tox", ".nox", ".venv", "__pycache__", "node_modules"}


def idle_plugin_args(*roots: Path) -> list[str]:
    """`-p no:NAME` for each plugin in `IDLE_PLUGINS` that no source,
    configuration or requirements file under `roots` mentions."""
    unseen = dict(IDLE_PLUGINS)
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _NOT_SCANNED_DIRS]
            for name in filenames:
                if unseen and name.endswith(_SCANNED):
                    text = (Path(dirpath) / name).read_text(encoding="utf-8", errors="replace").lower()
                    unseen = {k: w for k, w in unseen.items() if w not in text}
    return [arg for name in sorted(unseen) for arg in ("-p", f"no:{name}")]


def command_for(ini: dict[str, list[str]] | None, src_layout: bool,
                extra: list[str] | None = None) -> str:
    """The pytest command for a repository with these settings (pure)."""
    argv = ["python", "-m", "pytest", *(extra or [])]
    ini = ini or {"addopts": [], "pythonpath": []}
    if src_layout:
        argv.append("--rootdir=.")
        paths = [p.rstrip("/") for p in ini["pythonpath"]]
        if "src" not in paths and "./src" not in paths:
            argv += ["-o", "pythonpath=" + " ".join([*ini["pythonpath"], "src"])]
    kept = strip_plugin_options(ini["addopts"])
    if kept != ini["addopts"]:
        argv += ["-o", "addopts=" + shlex.join(kept)]
    return shlex.join(argv)


def test_command(root: Path, src_layout: bool, also: tuple[Path, ...] = ()) -> str:
    """The pytest command for the repository at `root` (plugins idle in
    `root` and every tree of `also` switched off)."""
    return command_for(read_ini(root), src_layout, idle_plugin_args(root, *also))


test_command.__test__ = False  # type: ignore[attr-defined]  # not a test, whatever its name
