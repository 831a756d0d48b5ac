"""Real tasks as an RL environment: the agent harness in a sandbox, graded by hidden tests.

One rollout: a sandbox created from the task's repository snapshot (with
the task's shared read-only venv mounted), `run_episode` with the policy's
engine, then `atelier.tasks.grade.grade` of the final diff in a *fresh*
sandbox (the episode's sandbox can have been tampered with), then shaping.

Infrastructure vs policy: an episode that ended on an exception (the
sandbox, engine or harness raised: `exit_reason == "error"`) and a grade
with `infra_error` (the test run timed out) raise `InfraError` — retried by
the reconciler and never scored. A malformed tool call, a patch that does
not apply or failing tests are the policy's: scored (0 plus penalties) and
trained on.

The trainer recomputes logprobs at the rollout temperature without top-p,
so the agent samples at `rollout.temperature` with top_p = 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from atelier.harness.trajectory import Trajectory
from atelier.rl.config import RolloutConfig, TasksEnvConfig
from atelier.rl.env import InfraError
from atelier.rl.shaping import ShapingConfig, shape_trajectory
from atelier.tasks import Task, load_suite, load_task
from atelier.tasks.schema import TaskError


class TaskEnvironment:
    def __init__(self, cfg: TasksEnvConfig, rollout: RolloutConfig, shaping: ShapingConfig) -> None:
        from atelier.harness.config import AgentConfig

        self.cfg, self.rollout_cfg, self.shaping = cfg, rollout, shaping
        source = Path(cfg.suite)
        if (source / "task.toml").exists():
            if cfg.split is not None:
                raise TaskError(f"{source} is a single task, so it has no split {cfg.split!r}",
                                hint="point env.tasks.suite at a suite directory, or remove env.tasks.split")
            self._tasks = [load_task(source)]
        else:
            self._tasks = load_suite(source, split=cfg.split)
        agent = AgentConfig.model_validate(cfg.agent)
        if agent.sampling.top_p != 1.0:
            raise TaskError("RL rollouts sample with top_p = 1 (the trainer cannot recompute truncated "
                            f"probabilities); env.tasks.agent sets top_p = {agent.sampling.top_p}",
                            hint="remove env.tasks.agent.sampling.top_p")
        self.agent = agent

    def tasks(self) -> Sequence[Task]:
        return self._tasks

    def category(self, task: Task) -> str:
        return task.metadata.category

    def _agent_config(self, seed: int):
        sampling = self.agent.sampling.model_copy(update={
            "temperature": self.rollout_cfg.temperature, "max_tokens": self.rollout_cfg.max_tokens, "seed": seed})
        return self.agent.model_copy(update={"sampling": sampling})

    def rollout(self, task: Task, model, seed: int) -> Trajectory:
        from atelier.harness.agent import run_episode
        from atelier.sandbox import SandboxError, create_sandbox
        from atelier.sandbox.hostfs import SANDBOX_PATH
        from atelier.tasks.envs import ensure_env, env_mounts
        from atelier.tasks.grade import grade

        cache = self.cfg.env_cache or None
        try:
            venv = ensure_env(task, cache)
            env = {"PYTHONDONTWRITEBYTECODE": "1"}
            if venv is not None:
                env.update({"PATH": f"{venv}/bin:{SANDBOX_PATH}", "VIRTUAL_ENV": str(venv)})
            sb_config = task.limits.sandbox_config(backend=self.cfg.backend,
                                                   ro_mounts=env_mounts(venv) if venv else [], env=env)
            with create_sandbox(task.snapshot, sb_config) as sandbox:
                traj = run_episode(model, sandbox, task.prompt, task_id=task.id,
                                   config=self._agent_config(seed))
        except SandboxError as exc:
            raise InfraError(f"sandbox: {exc.message}") from exc
        if traj.exit_reason == "error" or traj.error:
            raise InfraError(f"episode failed: {traj.error}")
        result = grade(task, traj.final_diff, backend=self.cfg.backend, cache_dir=cache)
        if result.infra_error:
            raise InfraError(f"grading: {result.error}")
        shape_trajectory(traj, result.reward, self.shaping)
        f, p = result.fail_to_pass, result.pass_to_pass
        traj.reward_parts.update({
            "pass": float(result.reward >= 1.0),
            "fail_to_pass": f.passed / f.total if f.total else 1.0,
            "pass_to_pass": p.passed / p.total if p.total else 1.0,
        })
        if result.error:
            traj.limits["grade_error"] = result.error[:500]
        return traj
