"""Real tasks as an RL environment: the agent harness in a sandbox, graded by hidden tests.

One rollout: `atelier.harness.episode.run_and_grade` (the same episode and
grade as evaluation: sandbox over the snapshot with the task's venv, the
agent loop with the policy's engine, the final diff graded in a fresh
sandbox), then shaping.

Infrastructure vs policy vs bug (`atelier.failures`): what
`GradedEpisode.infra_error` names (an episode that ended on an
infrastructure failure, a test run that timed out) and a sandbox that
cannot be created raise `InfraError` — retried by the reconciler and never
scored. A malformed tool call, a patch that does not apply or failing tests
are the policy's: scored (0 plus penalties) and trained on. Any other
exception propagates: a bug, which stops the run.

The trainer recomputes logprobs at the rollout temperature without top-p,
so the agent samples at `rollout.temperature` with top_p = 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from atelier.errors import InfraError
from atelier.harness.episode import run_and_grade
from atelier.harness.trajectory import Trajectory
from atelier.rl.config import RolloutConfig, TasksEnvConfig
from atelier.rl.shaping import ShapingConfig, shape_trajectory
from atelier.sandbox import SandboxError
from atelier.tasks import Task, load_suite, load_task
from atelier.tasks.schema import TaskError


class TaskEnvironment:
    def __init__(self, cfg: TasksEnvConfig, rollout: RolloutConfig, shaping: ShapingConfig) -> None:
        self.cfg, self.rollout_cfg, self.shaping = cfg, rollout, shaping
        source = Path(cfg.suite)
        if (source / "task.toml").exists():
            if cfg.split is not None:
                raise TaskError(f"{source} is a single task, so it has no split {cfg.split!r}",
                                hint="point env.tasks.suite at a suite directory, or remove env.tasks.split")
            self._tasks = [load_task(source)]
        else:
            self._tasks = load_suite(source, split=cfg.split)
        if cfg.tasks is not None:
            known, wanted = {task.id for task in self._tasks}, set(cfg.tasks)
            missing = sorted(wanted - known)
            if missing:
                where = f"split {cfg.split!r} of {source}" if cfg.split is not None else str(source)
                raise TaskError(f"env.tasks.tasks names tasks not in {where}: {', '.join(missing)}",
                                hint="known ids: " + ", ".join(sorted(known)))
            self._tasks = [task for task in self._tasks if task.id in wanted]
        self.agent = cfg.agent   # top_p = 1 is checked by the config (TasksEnvConfig)

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def category(self, task: Task) -> str:
        return task.metadata.category

    def _agent_config(self, seed: int):
        sampling = self.agent.sampling.model_copy(update={
            "temperature": self.rollout_cfg.temperature, "max_tokens": self.rollout_cfg.max_tokens, "seed": seed})
        return self.agent.model_copy(update={"sampling": sampling})

    def rollout(self, task: Task, model, seed: int) -> Trajectory:
        try:
            episode = run_and_grade(task, model, self._agent_config(seed), backend=self.cfg.backend,
                                    env_cache=self.cfg.env_cache or None)
        except SandboxError as exc:
            raise InfraError(f"sandbox: {exc.message}") from exc
        if episode.infra_error is not None:
            raise InfraError(episode.infra_error)
        traj, result = episode.trajectory, episode.grade
        traj.timings.update(episode_s=round(episode.episode_s, 4), grade_s=round(episode.grade_s, 4))
        fractions = dict(traj.reward_parts)
        shape_trajectory(traj, result.reward, self.shaping, applied=not result.error)
        traj.reward_parts.update({"pass": float(result.reward >= 1.0), **fractions})
        if result.error:
            traj.limits["grade_error"] = result.error[:500]
        return traj
