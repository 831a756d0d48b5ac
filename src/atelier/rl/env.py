"""Environments: where a rollout happens and how it is scored.

`Environment.rollout(task, model, seed) -> Trajectory` runs one episode with
`model` (a `TokenModel`), scores it and returns the trajectory with `reward`
and `reward_parts` set (`reward_parts["pass"]` is 1.0 for a solved task).
An infrastructure failure (sandbox error, engine crash, grading timeout)
raises `InfraError` (or another exception `atelier.failures.is_infra`
accepts): the reconciler retries it and never scores it. Any other exception
is a bug: it stops the run, and the rollout runs again on resume.

Two environments:
- `ToyEnvironment`: single-turn, harness-free, dense learnable reward — the
  fraction of sampled tokens that fall in a target set (the lowest ids of
  the vocabulary). For tests, benchmarks and smoke runs through the same
  trainer, reconciler and engine as real tasks.
- `TaskEnvironment` (`atelier.rl.task_env`): real tasks through the agent
  harness, sandboxes and the grader.

Any other environment comes in through `env.kind = "python"`: a factory named
by import path or file path (`load_factory`), called with the rollout and
shaping configs, the seed and the `[env.python] args`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from atelier.errors import AtelierError, InfraError  # noqa: F401  (environments raise it from here)
from atelier.harness.trajectory import Segment, Trajectory
from atelier.inference.types import SamplingParams, TokenModel
from atelier.rl.config import EnvConfig, RolloutConfig, ToyEnvConfig
from atelier.rl.shaping import ShapingConfig, shape_trajectory
from atelier.rl.task_env import TaskEnvironment


class Environment(Protocol):
    def tasks(self) -> Sequence[Any]:
        """Every task of the epoch, in a fixed order; each has a unique `.id`."""
        ...

    def category(self, task: Any) -> str:
        """A label that groups tasks of similar difficulty (the curriculum's unit)."""
        ...

    def rollout(self, task: Any, model: TokenModel, seed: int) -> Trajectory: ...


@dataclass(frozen=True)
class ToyTask:
    id: str
    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember", "north", "quiet")


class ToyEnvironment:
    """Reward = fraction of sampled tokens whose id is below `target_fraction * vocab`."""

    def __init__(self, cfg: ToyEnvConfig, rollout: RolloutConfig, shaping: ShapingConfig,
                 seed: int = 0) -> None:
        self.cfg, self.rollout_cfg, self.shaping = cfg, rollout, shaping
        rng = random.Random(seed)
        self._tasks = []
        for i in range(cfg.tasks):
            n = rng.randint(1, cfg.prompt_words)
            words = " ".join(rng.choice(WORDS) for _ in range(n))
            self._tasks.append(ToyTask(f"toy-{i:05d}", f"Say something about {words}.", {"words": n}))

    def tasks(self) -> Sequence[ToyTask]:
        return self._tasks

    def category(self, task: ToyTask) -> str:
        return f"words-{task.metadata['words']}"

    def rollout(self, task: ToyTask, model: TokenModel, seed: int) -> Trajectory:
        start = time.perf_counter()
        tok = model.tokenizer
        prompt_ids = chat_prompt_ids(tok, task.prompt)
        params = SamplingParams(max_tokens=self.rollout_cfg.max_tokens,
                                temperature=self.rollout_cfg.temperature, seed=seed)
        started_unix, clock = time.time(), time.perf_counter()
        gen = model.generate(prompt_ids, params)
        generate_s = time.perf_counter() - clock
        env_s = 0.0
        if self.cfg.env_latency_s:  # the environment's share of a rollout (tools, grading)
            u = random.Random(seed).uniform(-1.0, 1.0)
            env_s = self.cfg.env_latency_s * (1.0 + self.cfg.env_latency_spread * u)
            time.sleep(env_s)
        threshold = int(self.cfg.target_fraction * len(tok))
        hits = sum(1 for t in gen.token_ids if t < threshold)
        correctness = hits / max(1, len(gen.token_ids))
        traj = single_turn_trajectory(task.id, task.prompt, model, prompt_ids, gen, gen.text, params,
                                      correctness=correctness, passed=correctness >= 0.5,
                                      shaping=self.shaping, started=start)
        traj.record_generate(started_unix, generate_s, len(prompt_ids), len(gen.token_ids))
        traj.timings["env_s"] = round(env_s, 5)
        return traj


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The token ids of one user message in the model's chat template, ready for the reply."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def single_turn_trajectory(task_id: str, prompt: str, model: TokenModel, prompt_ids: list[int], gen: Any,
                           reply: str, params: SamplingParams, *, correctness: float, passed: bool,
                           shaping: ShapingConfig, started: float) -> Trajectory:
    """The trajectory of a one-turn, tool-free episode, shaped and scored: one
    segment (prompt, then the sampled tokens with their logprobs and versions)."""
    seg = Segment()
    seg.extend_prompt(prompt_ids)
    seg.extend_sampled(gen.token_ids, gen.logprobs, gen.versions, gen.routes)
    traj = Trajectory(task_id=task_id, model=getattr(model, "name", ""), segments=[seg], turns=1,
                      tokens={"prompt": len(prompt_ids), "final_message": len(gen.token_ids)},
                      exit_reason="submitted", messages=[
                          {"role": "user", "content": prompt},
                          {"role": "assistant", "content": reply}])
    shape_trajectory(traj, correctness, shaping)
    traj.reward_parts["pass"] = float(passed)
    traj.wall_s = time.perf_counter() - started
    traj.limits = {"max_tokens": params.max_tokens, "temperature": params.temperature}
    return traj


class EnvironmentFactoryError(AtelierError):
    """`[env.python] factory` cannot be imported, or what it built is not an environment."""


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable named by 'package.module:name' or 'path/to/file.py:name'."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise EnvironmentFactoryError(f"env.python.factory = {spec!r} names no callable",
                                      hint="write 'package.module:make_env' or 'path/to/file.py:make_env'")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            module_name = f"atelier_env_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module   # so its classes pickle (Ray actors, process pools)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except Exception as exc:  # any import failure is the factory's, and the user's to fix
        raise EnvironmentFactoryError(f"cannot import {target!r} for env.python.factory: "
                                      f"{type(exc).__name__}: {exc}",
                                      hint="check the path (relative to the working directory) or that "
                                           "the module is importable (pip install it or set PYTHONPATH)") from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise EnvironmentFactoryError(
            f"{target!r} has no callable {name!r}",
            hint=f"define def {name}(rollout, shaping, seed, **args) returning an environment")
    return factory


def _check_args(factory: Callable[..., Any], spec: str, args: dict[str, Any]) -> None:
    """`[env.python] args` must fit the factory's signature: say which do not, before calling it."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    try:
        signature.bind(rollout=None, shaping=None, seed=0, **args)
    except TypeError as exc:
        accepted = [p for p in signature.parameters if p not in ("rollout", "shaping", "seed")]
        raise EnvironmentFactoryError(
            f"env.python.args do not fit {spec}: {exc}",
            hint=f"its arguments besides rollout, shaping and seed: {', '.join(accepted) or '(none)'}") from None


def make_environment(env: EnvConfig, rollout: RolloutConfig, shaping: ShapingConfig, seed: int):
    if env.kind == "toy":
        return ToyEnvironment(env.toy, rollout, shaping, seed)
    if env.kind == "python":
        factory = load_factory(env.python.factory)
        _check_args(factory, env.python.factory, env.python.args)
        built = factory(rollout=rollout, shaping=shaping, seed=seed, **env.python.args)
        missing = [m for m in ("tasks", "category", "rollout") if not callable(getattr(built, m, None))]
        if missing:
            raise EnvironmentFactoryError(
                f"{env.python.factory} returned {type(built).__name__}, which lacks {', '.join(missing)}",
                hint="return an object with tasks(), category(task) and rollout(task, model, seed)")
        return built

    return TaskEnvironment(env.tasks, rollout, shaping)
