"""The task format: what `task.toml` may say, and the loaded `Task`.

A task is a directory::

    my-task/
      task.toml    id, prompt, [env], hidden_tests, fail_to_pass, pass_to_pass,
                   test_command, [metadata], [limits]
      repo/        the repository at its base state (no history: no `.git`,
                   or a `.git` holding exactly one commit)
      tests/       the hidden tests, at their paths in the repository
                   (`tests/tests/test_x.py` is copied to `tests/test_x.py`)
      gold.patch   the reference fix, a `git apply`-able diff; never shown

Example `task.toml`::

    id = "calc-add"
    prompt = "add() subtracts; make it add."
    hidden_tests = ["tests/test_calc.py"]
    fail_to_pass = ["tests/test_calc.py::test_add"]
    pass_to_pass = ["tests/test_calc.py::test_sub"]

    [env]
    kind = "python"
    python = "3.11"
    requirements = ["attrs==23.2.0"]

    [metadata]
    source = "mutation"
    category = "wrong-operator"
    files_changed = 1
    lines_changed = 1

    [limits]
    timeout_s = 120

Every model forbids unknown keys, so a typo fails at load time with the key
named (see `atelier.tasks.loader`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import Field

from atelier.config import AtelierConfig
from atelier.errors import AtelierError
from atelier.sandbox.base import SandboxConfig


class TaskError(AtelierError):
    """A task or suite that cannot be loaded or graded as written."""


class PythonEnv(AtelierConfig):
    """A virtual environment built once outside the sandbox (with network) and
    mounted read-only into it; see `atelier.tasks.envs`."""

    kind: Literal["python"] = "python"
    """The environment's kind: a virtual environment."""
    python: str = Field(pattern=r"^3\.\d+$")
    """The interpreter's `major.minor`, e.g. "3.11"; pinned so gold stays green."""
    requirements: list[str] = Field(default_factory=list)
    """pip requirement specifiers; pin them (`pkg==1.2.3`). pytest is added."""
    system_site_packages: bool = False
    """See the base interpreter's packages too (then pytest need not be
    installed when the base has it, which works offline)."""


class NoEnv(AtelierConfig):
    """No environment is built: tests run with whatever `python` the sandbox has."""

    kind: Literal["none"]
    """The environment's kind: none."""


Env = Annotated[Union[PythonEnv, NoEnv], Field(discriminator="kind")]


class TaskMetadata(AtelierConfig):
    source: str = "unknown"
    """Where the task came from: "release-diff", "mutation", "swe-bench" …"""
    category: str = "unknown"
    """A label the curriculum and the reports group tasks by."""
    files_changed: int = Field(0, ge=0)
    """Files the gold patch changes."""
    lines_changed: int = Field(0, ge=0)
    """Lines the gold patch changes."""


class TaskLimits(AtelierConfig):
    """The sandbox limits a task may set (a subset of `SandboxConfig`); unset
    fields keep `SandboxConfig`'s defaults. `timeout_s` bounds the test run."""

    timeout_s: Optional[float] = Field(None, gt=0)
    """Wall-clock limit of the graded test run."""
    memory_mb: Optional[int] = Field(None, gt=0)
    """Memory of the whole sandbox."""
    max_processes: Optional[int] = Field(None, gt=0)
    """Processes and threads at once."""
    disk_mb: Optional[int] = Field(None, gt=0)
    """Bytes that may be written into the workspace and /tmp."""
    max_file_mb: Optional[int] = Field(None, gt=0)
    """Largest file a process may write."""
    cpu_time_s: Optional[int] = Field(None, gt=0)
    """CPU seconds per process."""

    def sandbox_config(self, **extra: object) -> SandboxConfig:
        """A `SandboxConfig` with these limits and `extra` (backend, mounts …)."""
        return SandboxConfig(**self.model_dump(exclude_none=True), **extra)


class TaskSpec(AtelierConfig):
    """What `task.toml` holds."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The task's id (its directory's name in a suite)."""
    prompt: str = Field(min_length=1)
    """What the agent is asked to do."""
    env: Env = Field(default_factory=lambda: NoEnv(kind="none"))
    """How the task's dependencies are provided (`kind = "python"` or `"none"`)."""
    hidden_tests: list[str] = Field(default_factory=list)
    """Paths in the repository; their content lies under the task's `tests/`."""
    fail_to_pass: list[str] = Field(default_factory=list)
    """pytest node ids that fail at base and must pass after the fix."""
    pass_to_pass: list[str] = Field(default_factory=list)
    """pytest node ids that pass at base and must still pass."""
    test_command: str = "python -m pytest"
    """The test runner; node ids and result options are appended. A leading
    `python` means the task environment's interpreter."""
    metadata: TaskMetadata = Field(default_factory=TaskMetadata)
    """Where the task came from and its size."""
    limits: TaskLimits = Field(default_factory=TaskLimits)
    """The sandbox limits of the task's episodes and gradings."""


class Task(TaskSpec):
    """A loaded, validated task (the ARCHITECTURE contract)."""

    root: Path
    """The task directory."""
    snapshot: Path
    """The repository at base state (`root/repo`)."""
    gold_patch: str
    """Never shown to the agent."""

    def hidden_test_source(self, rel: str) -> Path:
        """Where the content of hidden test `rel` lies on the host."""
        return self.root / "tests" / rel

    def test_files(self) -> list[str]:
        """Every file named by a hidden test or a target node id, in order."""
        files = dict.fromkeys(self.hidden_tests)
        for node in [*self.fail_to_pass, *self.pass_to_pass]:
            files.setdefault(node_file(node))
        return list(files)


def node_file(node_id: str) -> str:
    """The file part of a pytest node id (`a/b.py::C::t[x]` → `a/b.py`)."""
    return node_id.split("::", 1)[0]
