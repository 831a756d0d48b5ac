"""Import SWE-bench instances as atelier tasks.

Input: a JSON list or a JSONL file of instances with the official fields
(`instance_id`, `repo`, `base_commit`, `patch`, `test_patch`,
`problem_statement`, `FAIL_TO_PASS`, `PASS_TO_PASS`, `version`,
`environment_setup_commit`). `FAIL_TO_PASS`/`PASS_TO_PASS` are lists, or
JSON-encoded lists as in the official Hugging Face dataset; both are read.

Repositories come from a local mirror directory, never the network:
`REPOS/<owner>__<name>` or `REPOS/<owner>/<name>`, a git clone (bare or not)
that holds `base_commit`. The snapshot is `git archive base_commit`, so it
carries no history (the fix cannot leak through `git log`).

Each instance becomes a task: prompt = `problem_statement`; gold =
`patch`; hidden tests = every file `test_patch` adds or changes, with its
content after `test_patch` is applied on base (the base versions stay in
`repo/`, and grading overwrites them); `fail_to_pass`/`pass_to_pass` as
given; metadata source "swe-bench", category "<repo>@<version>".

Limits, said plainly:

- Only instances whose test ids are pytest node ids (`path.py::name`) are
  importable: Django (`test_x (module.Class)`) and SymPy (`test_x`) use
  their own runners and are refused with that reason. Non-Python
  repositories are refused too.
- The environment: SWE-bench's own per-repository, per-version install
  specs are a table this importer does not ship. Pass yours as
  `--env-spec FILE` (TOML: `["owner/repo@version"]` or `["owner/repo"]`
  tables with `requirements = [...]` and optionally `python = "3.x"`).
  Without an entry, the requirements are what the snapshot declares
  (`atelier.tasks.declared_deps`: pyproject.toml, setup.cfg, requirements
  files; `setup.py` is never run), installed outside the sandbox into the
  cached venv as for every task; the task's category says which it was.
  A repository that declares its needs only in `setup.py` gets no
  requirements and a category that says so: give it an `--env-spec`
  entry. The test command is the repository's own pytest settings with an
  `src/` layout put on the path (`atelier.tasks.pytest_ini`). Validate
  before use: an instance whose tests cannot run here is dropped by
  `atelier tasks validate`, not graded as a failure.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from atelier.compat import tomllib
from atelier.tasks import pytest_ini
from atelier.tasks.declared_deps import declared_requirements
from atelier.tasks.release import runtime_requirements
from atelier.tasks.schema import PythonEnv, Task, TaskError, TaskMetadata, TaskSpec
from atelier.tasks.stats import patch_stats
from atelier.tasks.writer import write_task

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "problem_statement",
            "FAIL_TO_PASS", "PASS_TO_PASS")
HOST_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


class EnvSpec(BaseModel):
    """One `--env-spec` entry: what an instance's tests need installed."""

    model_config = ConfigDict(extra="forbid")
    requirements: list[str]
    python: str = HOST_PYTHON


def load_env_specs(path: str | Path | None) -> dict[str, EnvSpec]:
    """`{"owner/repo@version" or "owner/repo": EnvSpec}` from a TOML file; {} for None."""
    if path is None:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TaskError(f"cannot read the env spec {path}: {exc}",
                        hint='write TOML tables like ["owner/repo@1.2"] with requirements = ["pkg==1.0"]') from None
    specs = {}
    for key, value in data.items():
        try:
            specs[key] = EnvSpec.model_validate(value)
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(p) for p in problem["loc"]) or "entry"
            raise TaskError(f"env spec {path}, [{key!r}] {where}: {problem['msg']}",
                            hint="each entry has requirements = [...] and optionally python = \"3.x\"") from None
    return specs


def instance_env(inst: "Instance", base: Path, specs: dict[str, EnvSpec]) -> tuple[PythonEnv, str]:
    """The instance's environment and a note on where it came from: its
    `--env-spec` entry, else what the snapshot at `base` declares."""
    for key in (f"{inst.repo}@{inst.version}", inst.repo):
        if key in specs:
            spec = specs[key]
            return (PythonEnv(python=spec.python, requirements=spec.requirements, system_site_packages=True),
                    f"env: --env-spec [{key}]")
    declared = declared_requirements(base)
    own_name = declared.name or inst.repo.partition("/")[2]
    requirements = runtime_requirements(declared.requirements, python=HOST_PYTHON, exclude=own_name)
    if declared.sources:
        note = f"env: declared in {', '.join(declared.sources)}"
    elif declared.setup_py_only:
        note = "env: setup.py only (not run), nothing installed; add an --env-spec entry"
    else:
        note = "env: nothing declared"
    return PythonEnv(python=HOST_PYTHON, requirements=requirements, system_site_packages=True), note


@dataclasses.dataclass(frozen=True)
class Instance:
    instance_id: str
    repo: str
    base_commit: str
    patch: str
    test_patch: str
    problem_statement: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    version: str = ""
    environment_setup_commit: str = ""


def parse_test_ids(value: Any, field: str, instance_id: str) -> list[str]:
    """A list of test ids from a list or a JSON-encoded list."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise TaskError(f"instance {instance_id}: {field} is a string but not JSON",
                            hint=f'write {field} as a list, e.g. ["tests/test_x.py::test_y"]') from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TaskError(f"instance {instance_id}: {field} must be a list of test ids",
                        hint=f'write {field} as a list, e.g. ["tests/test_x.py::test_y"]')
    return value


def parse_instance(raw: Any) -> Instance:
    """Check one instance's fields (pure)."""
    if not isinstance(raw, dict):
        raise TaskError(f"an instance is a {type(raw).__name__}, not an object",
                        hint="each instance is a JSON object with the SWE-bench fields")
    iid = str(raw.get("instance_id") or "?")
    missing = [f for f in REQUIRED if f not in raw]
    if missing:
        raise TaskError(f"instance {iid}: missing field(s) {', '.join(missing)}",
                        hint="export instances with the official SWE-bench fields")
    f2p = parse_test_ids(raw["FAIL_TO_PASS"], "FAIL_TO_PASS", iid)
    p2p = parse_test_ids(raw["PASS_TO_PASS"], "PASS_TO_PASS", iid)
    not_pytest = [t for t in [*f2p, *p2p] if "::" not in t]
    if not_pytest:
        raise TaskError(f"instance {iid}: test id {not_pytest[0]!r} is not a pytest node id",
                        hint="only pytest-run repositories are supported (not Django's or SymPy's runners)")
    if not any(p.endswith(".py") for p in patch_files(raw["patch"]) + patch_files(raw["test_patch"])):
        raise TaskError(f"instance {iid}: neither patch nor test_patch touches a .py file",
                        hint="only Python repositories are supported")
    return Instance(iid, raw["repo"], raw["base_commit"], raw["patch"], raw["test_patch"],
                    raw["problem_statement"], f2p, p2p, str(raw.get("version") or ""),
                    str(raw.get("environment_setup_commit") or ""))


def read_instances(text: str) -> list[Any]:
    """Raw instances from a JSON list or JSONL text (pure)."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise TaskError(f"instances file is not valid JSON: {exc}",
                            hint="pass a JSON list or JSONL (one object per line)") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise TaskError(f"instances file, line {n}: not JSON: {exc}",
                                hint="pass a JSON list or JSONL (one object per line)") from None
    return out


def patch_files(patch: str) -> list[str]:
    """Paths a diff leaves in place (added or changed, not deleted), in order (pure)."""
    files: dict[str, None] = {}
    for line in patch.splitlines():
        if line.startswith("+++ ") and not line.startswith("+++ /dev/null"):
            files.setdefault(line[4:].split("\t", 1)[0].removeprefix("b/"))
    return list(files)


def mirror_path(repos_dir: Path, repo: str) -> Path | None:
    owner, _, name = repo.partition("/")
    for candidate in (repos_dir / f"{owner}__{name}", repos_dir / owner / name):
        if candidate.is_dir():
            return candidate
    return None


# --- I/O ------------------------------------------------------------------
def _git(mirror: Path, *args: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(mirror), *args], capture_output=True, timeout=600, **kw)


def import_instance(inst: Instance, repos_dir: str | Path, out_dir: str | Path,
                    *, overwrite: bool = False, env_specs: dict[str, EnvSpec] | None = None) -> Task:
    """Write `inst` as the task `out_dir/<instance_id>` and return it loaded."""
    iid = inst.instance_id
    mirror = mirror_path(Path(repos_dir), inst.repo)
    if mirror is None:
        owner, _, name = inst.repo.partition("/")
        raise TaskError(f"instance {iid}: no mirror of {inst.repo} in {repos_dir}",
                        hint=f"git clone https://github.com/{inst.repo} {Path(repos_dir) / f'{owner}__{name}'}")
    if _git(mirror, "cat-file", "-e", f"{inst.base_commit}^{{commit}}").returncode != 0:
        raise TaskError(f"instance {iid}: base_commit {inst.base_commit} is not in {mirror}",
                        hint=f"update the mirror: git -C {mirror} fetch --all")
    with tempfile.TemporaryDirectory(prefix="atelier-swe-") as tmp:
        base, scratch = Path(tmp) / "base", Path(tmp) / "scratch"
        base.mkdir()
        scratch.mkdir()
        archive = _git(mirror, "archive", "--format=tar", inst.base_commit)
        if archive.returncode != 0:
            raise TaskError(f"instance {iid}: git archive failed: {archive.stderr.decode()[-500:]}",
                            hint=f"check the mirror {mirror}")
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        hidden = _tests_after_patch(inst, base, scratch)
        env, env_note = instance_env(inst, base, env_specs or {})
        spec = TaskSpec(
            id=iid, prompt=inst.problem_statement, env=env,
            fail_to_pass=inst.fail_to_pass,
            pass_to_pass=[t for t in inst.pass_to_pass if t not in inst.fail_to_pass],
            test_command=pytest_ini.test_command(base, src_layout=(base / "src").is_dir()),
            metadata=_metadata(inst, env_note))
        return write_task(Path(out_dir) / iid, spec, base, hidden, inst.patch, overwrite=overwrite)


def _metadata(inst: Instance, env_note: str) -> TaskMetadata:
    s = patch_stats(inst.patch)
    where = f"{inst.repo}@{inst.version}" if inst.version else inst.repo
    return TaskMetadata(source="swe-bench", category=f"{where} ({env_note})",
                        files_changed=s.files, lines_changed=s.lines)


def _tests_after_patch(inst: Instance, base: Path, scratch: Path) -> dict[str, bytes]:
    """The files `test_patch` adds or changes, as they read after it is
    applied on base (applied in `scratch`, holding only those files)."""
    files = patch_files(inst.test_patch)
    for line in inst.test_patch.splitlines():  # the pre-images, for changed files
        if line.startswith("--- a/"):
            rel = line[6:].split("\t", 1)[0]
            if (base / rel).is_file():
                (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
                (scratch / rel).write_bytes((base / rel).read_bytes())
    proc = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=scratch,
                          input=inst.test_patch.encode(), capture_output=True, timeout=120)
    if proc.returncode != 0:
        raise TaskError(f"instance {inst.instance_id}: test_patch does not apply at "
                        f"{inst.base_commit[:12]}: {proc.stderr.decode().strip()[-500:]}",
                        hint="check that base_commit and test_patch belong together")
    return {rel: (scratch / rel).read_bytes() for rel in files if (scratch / rel).is_file()}


def import_file(path: str | Path, repos_dir: str | Path, out_dir: str | Path,
                *, overwrite: bool = False, env_spec: str | Path | None = None) -> dict:
    """Import every instance of `path`; one that fails is reported with its
    reason and the rest go on. `{"imported": [ids], "failed": [{"id", "reason"}]}`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"cannot read instances file {path}: {exc}",
                        hint="pass a JSON list or JSONL of SWE-bench instances") from None
    specs = load_env_specs(env_spec)
    report: dict = {"imported": [], "failed": []}
    for raw in read_instances(text):
        iid = raw.get("instance_id", "?") if isinstance(raw, dict) else "?"
        try:
            task = import_instance(parse_instance(raw), repos_dir, out_dir, overwrite=overwrite, env_specs=specs)
        except TaskError as exc:
            report["failed"].append({"id": iid, "reason": str(exc)})
            continue
        report["imported"].append(task.id)
    return report
