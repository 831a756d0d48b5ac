"""Import Harbor (Terminal-Bench 2) task directories as atelier tasks.

A Harbor task::

    my-task/
      instruction.md       the prompt
      task.toml            [verifier] timeout_sec, [metadata] category …
      environment/         Dockerfile (maybe) and the files it copies
      tests/test.sh        the verifier; writes /logs/verifier/reward.txt
      solution/solve.sh    the reference solution (a script, not a diff)

What is imported. Only tasks that need no custom image: no
`environment/Dockerfile`, or one whose instructions are only `FROM` a
python/ubuntu/debian image, `WORKDIR` and `COPY` (`dockerfile_needs`, pure).
A `docker-compose.yaml`, a `RUN`, an `ENV` or another base image means the
task needs its image; such tasks are listed under `needs_docker` in the
report with the line that decided it, never dropped silently.

How it maps onto our format, which grades pytest node ids:

- `repo/` = the files of `environment/` (Dockerfile and compose files left
  out), standing for the container's `WORKDIR` (default `/app`). `COPY`
  destinations are not interpreted: files are assumed to land in WORKDIR.
- Hidden tests = every file of `tests/` (at `tests/…`) plus a generated
  `tests/test_harbor_verifier.py`, whose one test (the task's only
  fail_to_pass) runs `bash tests/test.sh` with Harbor's paths rewritten
  (`/logs/verifier` → a fresh temp dir, `/tests` → `<workspace>/tests`,
  WORKDIR → the workspace) and asserts the reward it wrote
  (`reward.txt`, or `reward.json`'s "reward") is 1.
- Gold = the diff `solution/solve.sh` leaves in a sandbox over `repo/`
  (same path rewriting, `/solution` → a copy of `solution/` under `/tmp`).
  A solve.sh that fails or changes nothing makes the import fail.
- Environment: the host interpreter with system site-packages. Sandboxes
  have no network, so a test.sh that installs tools (`apt-get`, `uv`,
  `curl`) fails: run `atelier tasks validate` on the imported suite.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from atelier.compat import tomllib
from atelier.sandbox.base import SandboxConfig
from atelier.sandbox.factory import create_sandbox
from atelier.tasks.schema import PythonEnv, Task, TaskError, TaskLimits, TaskMetadata, TaskSpec
from atelier.tasks.stats import patch_stats
from atelier.tasks.writer import write_task

WRAPPER = "tests/test_harbor_verifier.py"
NODE = f"{WRAPPER}::test_harbor_verifier"
SIMPLE_BASES = ("python", "ubuntu", "debian")
COMPOSE = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
DEFAULT_TIMEOUT_S = 600.0


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """`(line number, INSTRUCTION, arguments)` of a Dockerfile, continuation
    lines joined, comments and blank lines dropped (pure)."""
    out, buf, start = [], "", 0
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1].rstrip() + " "
            continue
        buf += stripped
        word, _, args = buf.partition(" ")
        out.append((start, word.upper(), args.strip()))
        buf = ""
    if buf:
        word, _, args = buf.partition(" ")
        out.append((start, word.upper(), args.strip()))
    return out


def dockerfile_needs(text: str) -> str | None:
    """Why this Dockerfile needs its own image, or None when it is only
    `FROM` a python/ubuntu/debian base plus `WORKDIR`/`COPY` (pure)."""
    instructions = dockerfile_instructions(text)
    if not instructions:
        return "the Dockerfile is empty"
    for n, word, args in instructions:
        if word == "FROM":
            image = [a for a in args.split() if not a.startswith("--")][0] if args else ""
            name = image.split("@")[0].split(":")[0].rsplit("/", 1)[-1]
            if not name.startswith(SIMPLE_BASES):
                return f"line {n}: FROM {image} is not a python/ubuntu/debian base image"
        elif word not in ("WORKDIR", "COPY"):
            return f"line {n}: {word} {args}"[:200]
    return None


def dockerfile_workdir(text: str) -> str:
    """The last `WORKDIR` (absolute), else "/app" (pure)."""
    workdir = "/app"
    for _, word, args in dockerfile_instructions(text):
        if word == "WORKDIR" and args.startswith("/"):
            workdir = args.rstrip("/") or "/"
    return workdir


def rewrite_paths(script: str, mapping: dict[str, str]) -> str:
    """Replace each absolute path prefix (`/app`, `/tests` …) where it stands
    as a whole path component, longest first (pure)."""
    for old in sorted(mapping, key=len, reverse=True):
        script = re.sub(rf"(?<![\w./-]){re.escape(old)}(?![\w.-])", lambda _m, o=old: mapping[o], script)
    return script


def wrapper_source(workdir: str, timeout_s: float) -> str:
    """The generated pytest file that runs the Harbor verifier."""
    return _WRAPPER_TEMPLATE.replace("@WORKDIR@", repr(workdir)).replace("@TIMEOUT@", repr(timeout_s))


_WRAPPER_TEMPLATE = '''"""Harbor verifier as one pytest test (generated by atelier's Harbor importer).

Runs tests/test.sh with Harbor's paths rewritten to the workspace and a
fresh log directory, then asserts the reward it wrote is 1.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

WORKDIR = @WORKDIR@
TIMEOUT_S = @TIMEOUT@


def _rewrite(script, mapping):
    for old in sorted(mapping, key=len, reverse=True):
        script = re.sub(r"(?<![\\w./-])" + re.escape(old) + r"(?![\\w.-])",
                        lambda _m, o=old: mapping[o], script)
    return script


def _reward(logs):
    txt, js = Path(logs, "reward.txt"), Path(logs, "reward.json")
    if txt.is_file():
        return float(txt.read_text().strip())
    if js.is_file():
        return float(json.loads(js.read_text())["reward"])
    return None


def test_harbor_verifier():
    root = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        logs = os.path.join(tmp, "logs", "verifier")
        os.makedirs(logs)
        script = Path(root, "tests", "test.sh").read_text()
        script = _rewrite(script, {"/logs/verifier": logs, "/tests": root + "/tests", WORKDIR: root})
        path = os.path.join(tmp, "test.sh")
        Path(path).write_text(script)
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        proc = subprocess.run(["bash", path], cwd=root, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        reward = _reward(logs)
        out = (proc.stdout + proc.stderr)[-3000:]
        assert reward is not None, f"test.sh (exit {proc.returncode}) wrote no reward\\n{out}"
        assert reward == 1, f"reward {reward} (test.sh exit {proc.returncode})\\n{out}"
'''


def task_id(name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")
    return clean or "harbor-task"


# --- I/O ------------------------------------------------------------------
def harbor_dirs(path: str | Path) -> list[Path]:
    root = Path(path)
    if (root / "instruction.md").is_file():
        return [root]
    dirs = sorted(p.parent for p in root.glob("*/instruction.md"))
    if not dirs:
        raise TaskError(f"no Harbor tasks in {path}",
                        hint="pass a task directory (with instruction.md) or a directory of them")
    return dirs


def needs_docker(src: Path) -> str | None:
    """Why the Harbor task at `src` needs its image, or None."""
    env = src / "environment"
    for name in COMPOSE:
        if (env / name).is_file():
            return f"environment/{name}: multi-container tasks need Docker"
    if (env / "Dockerfile").is_file():
        why = dockerfile_needs((env / "Dockerfile").read_text(encoding="utf-8"))
        return f"environment/Dockerfile {why}" if why else None
    return None


def _read_config(src: Path, tid: str) -> dict[str, Any]:
    path = src / "task.toml"
    if not path.is_file():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise TaskError(f"harbor task {tid}: task.toml is not valid TOML: {exc}",
                        hint=f"fix {path}") from None


def import_task(src: str | Path, out_dir: str | Path, *, backend: str = "bwrap",
                overwrite: bool = False) -> Task:
    """Import one Harbor task (one that needs no image) as `out_dir/<id>`."""
    src = Path(src)
    tid = task_id(src.name)
    for rel in ("instruction.md", "tests/test.sh", "solution/solve.sh"):
        if not (src / rel).is_file():
            raise TaskError(f"harbor task {tid}: missing {rel}",
                            hint="a Harbor task needs instruction.md, tests/test.sh and solution/solve.sh")
    config = _read_config(src, tid)
    timeout = float(config.get("verifier", {}).get("timeout_sec") or DEFAULT_TIMEOUT_S)
    dockerfile = src / "environment" / "Dockerfile"
    workdir = dockerfile_workdir(dockerfile.read_text(encoding="utf-8")) if dockerfile.is_file() else "/app"
    hidden: dict[str, bytes | str] = {
        f"tests/{p.relative_to(src / 'tests').as_posix()}": p.read_bytes()
        for p in sorted((src / "tests").rglob("*")) if p.is_file()}
    hidden[WRAPPER] = wrapper_source(workdir, timeout)
    with tempfile.TemporaryDirectory(prefix="atelier-harbor-") as tmp:
        repo = Path(tmp) / "repo"
        if (src / "environment").is_dir():
            shutil.copytree(src / "environment", repo, symlinks=True,
                            ignore=shutil.ignore_patterns("Dockerfile", *COMPOSE))
        else:
            repo.mkdir()
        gold = solution_diff(src, repo, workdir, backend=backend, timeout_s=timeout, tid=tid)
        stats = patch_stats(gold)
        category = str(config.get("metadata", {}).get("category") or "terminal")
        spec = TaskSpec(
            id=tid, prompt=(src / "instruction.md").read_text(encoding="utf-8"),
            env=PythonEnv(python=f"{sys.version_info.major}.{sys.version_info.minor}",
                          system_site_packages=True),
            fail_to_pass=[NODE],
            metadata=TaskMetadata(source="harbor", category=category,
                                  files_changed=stats.files, lines_changed=stats.lines),
            limits=TaskLimits(timeout_s=timeout + 60))
        return write_task(Path(out_dir) / tid, spec, repo, hidden, gold, overwrite=overwrite)


def solution_diff(src: Path, repo: Path, workdir: str, *, backend: str = "bwrap",
                  timeout_s: float = DEFAULT_TIMEOUT_S, tid: str = "?") -> str:
    """Run `solution/solve.sh` in a sandbox over `repo` and return its diff."""
    sol = "/tmp/atelier-solution"
    config = SandboxConfig(backend=backend, timeout_s=timeout_s, env={"PYTHONDONTWRITEBYTECODE": "1"})
    with create_sandbox(repo, config) as sb:
        root = sb.exec(["pwd"], timeout=30).stdout.strip()
        for p in sorted((src / "solution").rglob("*")):
            if p.is_file():
                dest = f"{sol}/{p.relative_to(src / 'solution').as_posix()}"
                data = p.read_bytes()
                if p.name == "solve.sh":
                    data = rewrite_paths(data.decode("utf-8"), {workdir: root, "/solution": sol}).encode()
                sb.exec(["sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"', "sh", dest],
                        stdin=data, timeout=30)
        run = sb.exec(["bash", f"{sol}/solve.sh"], timeout=timeout_s)
        if not run.ok:
            tail = (run.stdout + run.stderr).strip()[-1500:]
            why = "timed out" if run.timed_out else f"exit {run.exit_code}"
            raise TaskError(f"harbor task {tid}: solution/solve.sh failed ({why}):\n{tail}",
                            hint="the sandbox has no network; a solve.sh that installs packages cannot run")
        diff = sb.diff()
    if not diff.strip():
        raise TaskError(f"harbor task {tid}: solution/solve.sh changed no file in the workspace",
                        hint=f"its effects must land under {workdir} (the task's WORKDIR)")
    return diff


def import_dir(path: str | Path, out_dir: str | Path, *, backend: str = "bwrap",
               overwrite: bool = False) -> dict:
    """Import every Harbor task under `path`: `{"imported": [ids],
    "needs_docker": [{"id", "reason"}], "failed": [{"id", "reason"}]}`."""
    report: dict = {"imported": [], "needs_docker": [], "failed": []}
    for src in harbor_dirs(path):
        tid = task_id(src.name)
        why = needs_docker(src)
        if why is not None:
            report["needs_docker"].append({"id": tid, "reason": why})
            continue
        try:
            task = import_task(src, out_dir, backend=backend, overwrite=overwrite)
        except TaskError as exc:
            report["failed"].append({"id": tid, "reason": str(exc)})
            continue
        report["imported"].append(task.id)
    return report
