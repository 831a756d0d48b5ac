"""One task, one episode, one grade: the path every user of a task takes.

`run_and_grade(task, model, agent_cfg, backend=, env_cache=)` does, in order:

1. the task's dependency venv (`atelier.tasks.envs.ensure_env`: built once,
   shared read-only by every sandbox);
2. a sandbox over the task's snapshot with that venv mounted and first on
   PATH (`task_sandbox_config`), so the agent's `python` and `pytest` are
   the grader's;
3. `run_in_sandbox`: the agent loop (`run_episode`) in that sandbox; the
   trajectory carries the final diff;
4. `atelier.tasks.grade.grade` of that diff in a *fresh* sandbox (the
   episode's sandbox can have been tampered with).

Its callers: RL rollouts (`atelier.rl.task_env`), evaluation and gold
replays (`atelier.eval.runner`, which `atelier run` uses for both); `atelier
agent` (`atelier.harness.deploy`) has no task to grade and calls
`run_in_sandbox` on the user's repository.

Infrastructure vs policy vs bug (`atelier.failures`): an episode that
ended on an infrastructure failure (the sandbox died, the engine closed:
`exit_reason == "error"`) is not graded, and a grade whose test run timed
out is not trusted; both set `GradedEpisode.infra_error`, and callers
exclude them (RL retries, eval records an infrastructure error). A
malformed call, a patch that does not apply or failing tests are the
policy's: graded, reward 0. Exceptions that escape (a sandbox that cannot
be created, a bug anywhere) propagate to the caller's batch edge, which
sorts them with `atelier.failures.classify`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from atelier.harness.agent import Event, run_episode
from atelier.harness.config import AgentConfig
from atelier.harness.trajectory import Trajectory
from atelier.sandbox import SandboxConfig, create_sandbox
from atelier.sandbox.hostfs import SANDBOX_PATH
from atelier.tasks.envs import ensure_env, env_mounts
from atelier.tasks.grade import GradeResult, grade
from atelier.tasks.schema import Task


@dataclass
class GradedEpisode:
    trajectory: Trajectory
    """`reward` and `reward_parts` (`fail_to_pass`, `pass_to_pass`) set when graded."""
    grade: GradeResult | None
    """None when the episode failed before a grade (see `infra_error`)."""
    episode_s: float
    grade_s: float = 0.0

    @property
    def infra_error(self) -> str | None:
        """Why this attempt says nothing about the policy, or None."""
        traj = self.trajectory
        if traj.exit_reason == "error" or traj.error:
            return f"episode failed: {traj.error or 'error'}"
        if self.grade is not None and self.grade.infra_error:
            return f"grading: {self.grade.error}"
        return None

    @property
    def error_type(self) -> str | None:
        """A short class of `infra_error`: the exception's name, or `GradeTimeout`."""
        if self.grade is not None and self.grade.infra_error:
            return "GradeTimeout"
        if self.infra_error is None:
            return None
        return (self.trajectory.error or "error").split(":", 1)[0].strip() or "error"


def target_fractions(result: GradeResult) -> dict[str, float]:
    """Fractions of target tests passing (1.0 for an empty set)."""
    f, p = result.fail_to_pass, result.pass_to_pass
    return {"fail_to_pass": f.passed / f.total if f.total else 1.0,
            "pass_to_pass": p.passed / p.total if p.total else 1.0}


def task_sandbox_config(task: Task, venv: Path | None, backend: str) -> SandboxConfig:
    """The task's limits, its venv mounted read-only and first on PATH."""
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    if venv is not None:
        env.update({"PATH": f"{venv}/bin:{SANDBOX_PATH}", "VIRTUAL_ENV": str(venv)})
    return task.limits.sandbox_config(backend=backend, ro_mounts=env_mounts(venv) if venv else [], env=env)


def run_in_sandbox(model: Any, source: Path, prompt: str, sandbox_config: SandboxConfig, *,
                   task_id: str, agent_cfg: AgentConfig,
                   on_event: Callable[[Event], None] | None = None) -> Trajectory:
    """`run_episode` in a sandbox over `source`, closed afterwards."""
    with create_sandbox(source, sandbox_config) as sandbox:
        return run_episode(model, sandbox, prompt, task_id=task_id, config=agent_cfg, on_event=on_event)


def run_and_grade(task: Task, model: Any, agent_cfg: AgentConfig, *, backend: str = "bwrap",
                  env_cache: str | Path | None = None,
                  on_event: Callable[[Event], None] | None = None) -> GradedEpisode:
    """Run `model` on `task` and grade the result; see the module docstring."""
    cache = str(env_cache) if env_cache else None
    start = time.monotonic()
    venv = ensure_env(task, cache)  # a lookup once built
    traj = run_in_sandbox(model, task.snapshot, task.prompt, task_sandbox_config(task, venv, backend),
                          task_id=task.id, agent_cfg=agent_cfg, on_event=on_event)
    episode = GradedEpisode(traj, None, episode_s=time.monotonic() - start)
    if episode.infra_error is not None:
        return episode
    graded_at = time.monotonic()
    episode.grade = grade(task, traj.final_diff, backend=backend, cache_dir=cache)
    episode.grade_s = time.monotonic() - graded_at
    traj.reward_parts = target_fractions(episode.grade)
    traj.reward = None if episode.grade.infra_error else episode.grade.reward
    return episode
