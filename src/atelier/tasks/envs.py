"""Dependency environments: one virtual environment per (Python, requirements),
built on the host with network, shared read-only by every sandbox.

`ensure_env(task)` returns the venv directory (None for `kind = "none"`). It
lives at `$ATELIER_CACHE/envs/<hash>` (default `~/.cache/atelier/envs/<hash>`),
the hash covering the Python version, the sorted requirements and
`system_site_packages`; tasks of one repository and version therefore share
one environment instead of an image each. Building: the host interpreter of
that version (the running one, or `pythonX.Y` on PATH) runs `-m venv`, then
`pip install` the requirements plus pytest. pytest is not installed when the
requirements are empty and the venv already imports it (through
`system_site_packages` on a base interpreter that has it): that path needs no
network, which is what the tests use. A `.atelier-complete` marker, written
last, says the venv is whole; a build holds a file lock, so concurrent callers
build once and a half-built directory is rebuilt.

Inside a sandbox the venv is bound read-only at its own path, with the base
interpreter's prefix (`env_mounts`); the test command runs `venv/bin/python`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from atelier.sandbox.hostfs import SYSTEM_TOP
from atelier.tasks.schema import PythonEnv, Task, TaskError

MARKER = ".atelier-complete"
BUILD_TIMEOUT_S = 1800


def cache_root() -> Path:
    base = os.environ.get("ATELIER_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "atelier"
    return root / "envs"


def env_hash(env: PythonEnv) -> str:
    key = json.dumps({"python": env.python, "requirements": sorted(env.requirements),
                      "system_site_packages": env.system_site_packages}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:20]


def ensure_env(task: Task, cache_dir: str | Path | None = None) -> Path | None:
    """The task's venv, built if absent; None when the task builds none."""
    if not isinstance(task.env, PythonEnv):
        return None
    return ensure_python_env(task.env, cache_dir, task_id=task.id)


def ensure_python_env(env: PythonEnv, cache_dir: str | Path | None = None,
                      task_id: str = "?") -> Path:
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = (root / env_hash(env)).resolve()
    if (venv / MARKER).is_file():
        return venv
    with open(root / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / MARKER).is_file():  # built by another process while we waited
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        try:
            _build(env, venv, task_id)
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
    return venv


def env_python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def env_mounts(venv: Path) -> list[str]:
    """Read-only mounts a sandbox needs to run `venv`'s python: the venv and
    its base interpreter's prefix (unless that is a system directory)."""
    info = json.loads((venv / MARKER).read_text())
    mounts = [str(venv)]
    prefix = info["base_prefix"]
    if not any(prefix == top or prefix.startswith(top + "/") for top in SYSTEM_TOP):
        mounts.append(prefix)
    return mounts


def _host_interpreter(version: str, task_id: str) -> str:
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        # The base interpreter, not a venv's: the new venv must not depend on ours.
        return os.path.join(os.path.realpath(sys.base_prefix), "bin", f"python{version}")
    found = shutil.which(f"python{version}")
    if found is None:
        raise TaskError(f"task {task_id}: env.python = {version!r} but no python{version} is on PATH",
                        hint=f"install Python {version} (e.g. pyenv install {version}) or change env.python")
    return found


def _run(argv: list[str], what: str, task_id: str) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TaskError(f"task {task_id}: {what} took over {BUILD_TIMEOUT_S} s",
                        hint="check the network and the requirements") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise TaskError(f"task {task_id}: {what} failed (exit {proc.returncode}):\n{tail}",
                        hint="check env.requirements (pinned, installable for this Python) and the network")
    return proc.stdout


def _build(env: PythonEnv, venv: Path, task_id: str) -> None:
    interpreter = _host_interpreter(env.python, task_id)
    argv = [interpreter, "-m", "venv"]
    if env.system_site_packages:
        argv.append("--system-site-packages")
    _run([*argv, str(venv)], "creating the venv", task_id)
    python = env_python(venv)
    has_pytest = subprocess.run([python, "-c", "import pytest"], capture_output=True).returncode == 0
    packages = list(env.requirements) + ([] if has_pytest and not env.requirements else ["pytest"])
    if packages:
        _run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages],
             "pip install " + " ".join(packages), task_id)
    base = _run([python, "-c", "import sys; print(sys.base_prefix)"], "probing the venv", task_id)
    info = {"python": env.python, "requirements": sorted(env.requirements),
            "system_site_packages": env.system_site_packages,
            "base_prefix": os.path.realpath(base.strip())}
    (venv / MARKER).write_text(json.dumps(info, indent=1) + "\n")
