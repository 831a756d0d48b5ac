"""The Ray backend of an RL run: inference and environments as Ray actors.

Ray is imported by three modules only: this one (the rollouts and inference of
the RL run), `atelier.train.launch_ray` (trainer ranks as Ray actors) and
`atelier.sandbox.ray_pool` (sandboxes on Ray worker nodes).

- `InferenceActor` holds the engine `config.inference` selects: a
  `LocalEngine` (continuous batching) or a `VLLMEngine`, whose vLLM server
  the actor starts on its node (one server per run); it is a threaded
  actor, so many `generate` calls block inside it at once and the engine
  batches them. Weights arrive either through the object store
  (in-process sync) or, with `sync.kind = "delta"`, by the actor rebuilding
  them itself from the delta chain on shared storage — the cluster path:
  only a few bytes of control message cross Ray per step.
- `RolloutActor`s each hold an environment and a `RemoteTokenModel`, a
  `TokenModel` whose `generate` is a call to the inference actor; the
  harness cannot tell the difference.
- The driver process keeps the trainer and the reconciler; `RayBackend`
  implements the reconciler's `RolloutBackend` by submitting rollouts to the
  actors and reporting each result from a waiting thread.

Failures (`remote_failure`, the one place Ray's errors are sorted): an actor
or node that dies, an object lost, a worker killed for memory (`RayError`s
other than a task error; actors restart up to twice) become an `InfraError`
of that one rollout: retried, never scored. A rollout that raises inside an
actor reaches the reconciler as its own exception, the worker's traceback
attached (`remote_traceback`), and is sorted like a local one: an infra
failure is retried, a bug stops the run. `RemoteTokenModel` applies the same
rule to the engine calls a rollout makes, so the harness sees an
`InfraError` when the inference actor is gone.

Multi-node: start Ray on each node (`ray start --head` on one, `ray start
--address=HEAD:6379` on the others), put the run directory (or at least
`sync.dir`) on storage every node mounts, use `sync.kind = "delta"`, and run
`atelier train RECIPE --set launcher=ray` on the head node; the driver joins
the running cluster (`ray.init(address="auto")`) when one exists.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayError, RayTaskError
from transformers import AutoTokenizer

from atelier.errors import AtelierError, InfraError
from atelier.harness.trajectory import Trajectory
from atelier.inference.types import Generation, SamplingParams
from atelier.rl.backends import open_rollout_engine
from atelier.rl.config import TrainConfig
from atelier.rl.env import make_environment
from atelier.rl.reconciler import DoneCallback
from atelier.rl.weight_sync import DeltaChainWeightSync


class RayLaunchError(AtelierError):
    """Ray could not start or reach its actors."""


def remote_failure(exc: BaseException) -> BaseException:
    """What the exception of a Ray call means to `atelier.failures` (see the module docstring)."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, RayError):   # the task itself called a dead actor
            return remote_failure(cause)
        if isinstance(cause, BaseException):
            try:
                cause.remote_traceback = getattr(exc, "traceback_str", None) or str(exc)
            except AttributeError:        # an exception type that takes no attributes
                pass
            return cause
        return exc                        # the cause could not be rebuilt here: a bug to read
    if isinstance(exc, RayError):
        infra = InfraError(f"ray: {type(exc).__name__}: {str(exc)[:500]}")
        infra.__cause__ = exc
        return infra
    return exc


@ray.remote(num_cpus=0, max_restarts=2)
class InferenceActor:
    def __init__(self, config_json: str, model_path: str, version: int) -> None:

        torch.set_num_threads(1)
        config = TrainConfig.model_validate_json(config_json)
        # The engine config.inference selects: the built-in one, or a vLLM server this actor
        # starts and supervises on its node (one server per inference actor).
        self.engine = open_rollout_engine(config, Path(model_path), version)
        self.chain = None

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return self.engine.generate(prompt_ids, params)

    def update_weights(self, state_dict: dict, version: int) -> int:
        self.engine.update_weights(state_dict, version)
        return self.engine.version

    def update_from_chain(self, root: str, version: int) -> int:
        if self.chain is None:
            self.chain = DeltaChainWeightSync(root)
        latest = self.chain.latest()
        if latest is None or latest[1] != version:
            raise RuntimeError(f"delta chain at {root} has step {latest and latest[1]}, expected {version}")
        self.engine.update_weights(latest[0], version)
        return self.engine.version

    def version(self) -> int:
        return self.engine.version

    def close(self) -> None:
        self.engine.close()


class RemoteTokenModel:
    """A `TokenModel` that generates on an `InferenceActor`."""

    def __init__(self, actor, model_path: str, name: str) -> None:
        self.actor, self.name = actor, name
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        try:
            return ray.get(self.actor.generate.remote(prompt_ids, params))
        except RayError as exc:
            raise remote_failure(exc) from None


@ray.remote(num_cpus=0, max_restarts=2)
class RolloutActor:
    def __init__(self, config_json: str, inference, model_path: str) -> None:
        config = TrainConfig.model_validate_json(config_json)
        self.env = make_environment(config.env, config.rollout, config.shaping, config.seed)
        self.model = RemoteTokenModel(inference, model_path, Path(model_path).name)

    def rollout(self, task: Any, seed: int) -> dict:
        return self.env.rollout(task, self.model, seed).to_dict()


class RayBackend:
    """`RolloutBackend` over Ray actors; see the module docstring."""

    def __init__(self, config: TrainConfig, model_path: Path, version: int, chain_root: Path | None = None,
                 reader=None, actors: int = 2) -> None:
        if not ray.is_initialized():
            try:
                ray.init(address="auto", include_dashboard=False, log_to_driver=False)
            except (ConnectionError, RuntimeError):
                ray.init(include_dashboard=False, log_to_driver=False)
        workers = config.rollout.workers
        self.chain_root, self.reader = chain_root, reader
        self._version = version
        self.inference = InferenceActor.options(max_concurrency=workers + 4).remote(
            config.model_dump_json(), str(model_path), version)
        n = max(1, min(actors, workers))
        per_actor = -(-workers // n)
        self.actors = [RolloutActor.options(max_concurrency=per_actor).remote(
            config.model_dump_json(), self.inference, str(model_path)) for _ in range(n)]
        self._next = 0
        self.waiters = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ray-rollout")

    @property
    def version(self) -> int:
        return self._version

    def submit(self, slot_id: str, task: Any, seed: int, done: DoneCallback) -> None:
        actor = self.actors[self._next % len(self.actors)]
        self._next += 1
        ref = actor.rollout.remote(task, seed)

        def wait() -> None:
            try:
                traj = Trajectory.from_dict(ray.get(ref))
            except Exception as exc:  # the batch edge: the reconciler sorts it (atelier.failures)
                done(slot_id, None, remote_failure(exc))
            else:
                done(slot_id, traj, None)

        self.waiters.submit(wait)

    def update_weights(self, version: int) -> None:
        if self.chain_root is not None:
            ray.get(self.inference.update_from_chain.remote(str(self.chain_root), version))
        else:
            state_dict, step = self.reader.latest()
            if step != version:
                raise RuntimeError(f"weights of version {version} were not published (have {step})")
            ray.get(self.inference.update_weights.remote(state_dict, version))
        self._version = version

    def close(self) -> None:
        self.waiters.shutdown(wait=False, cancel_futures=True)
        for actor in [*self.actors, self.inference]:
            ray.kill(actor)
