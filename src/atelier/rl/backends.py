"""The one-process rollout backend: a thread pool over one local engine.

Rollout threads call `engine.generate` concurrently; the engine batches them
(continuous batching) on its own scheduler thread. `update_weights(version)`
reads the newest published weights from the `WeightSync` reader and hands
them to the engine, which swaps them in between two decode steps: rollouts
in flight continue on the new weights and each token keeps the version that
produced it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from atelier.inference.models import open_model
from atelier.rl.config import TrainConfig
from atelier.rl.env import Environment
from atelier.rl.reconciler import DoneCallback
from atelier.rl.weight_sync import WeightSync


class LocalBackend:
    def __init__(self, env: Environment, engine, reader: WeightSync, workers: int) -> None:
        self.env, self.engine, self.reader = env, engine, reader
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout")
        self.sync_seconds = 0.0
        self._speculated = {"speculative_steps": 0, "drafted": 0, "accepted": 0}

    @property
    def version(self) -> int:
        return self.engine.version

    def submit(self, slot_id: str, task: Any, seed: int, done: DoneCallback) -> None:
        def work() -> None:
            try:
                traj = self.env.rollout(task, self.engine, seed)
            except Exception as exc:  # the batch edge: one rollout's failure is recorded, not raised
                done(slot_id, None, exc)
            else:
                done(slot_id, traj, None)

        self.pool.submit(work)

    def update_weights(self, version: int) -> None:
        latest = self.reader.latest()
        if latest is None or latest[1] != version:
            raise RuntimeError(f"weights of version {version} were not published (have {latest and latest[1]})")
        self.engine.update_weights(latest[0], version)

    def speculation(self) -> dict[str, Any] | None:
        """The engine's speculative decoding since the last call (drafted and accepted tokens,
        acceptance): how well the MTP heads still guess the policy as RL moves it. None when the
        engine does not speculate."""
        stats = getattr(self.engine, "stats", None)
        if not getattr(self.engine, "speculates", False) or stats is None:
            return None
        now = {k: stats[k] for k in self._speculated}
        delta = {k: now[k] - self._speculated[k] for k in now}
        self._speculated = now
        delta["acceptance"] = delta["accepted"] / delta["drafted"] if delta["drafted"] else None
        return delta

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()


def make_backend(config: TrainConfig, env, model_path: Path, version: int, reader: WeightSync,
                 chain_root: Path | None, work_dir: Path | None = None):
    """The rollout backend `config.launcher` selects: threads over one engine here, or Ray actors
    (`atelier.rl.ray_backend`, Ray being an optional dependency)."""
    if config.launcher == "ray":
        from atelier.rl.ray_backend import RayBackend

        return RayBackend(config, model_path, version, chain_root=chain_root, reader=reader)
    return LocalBackend(env, open_rollout_engine(config, model_path, version, work_dir), reader,
                        config.rollout.workers)


def open_rollout_engine(config: TrainConfig, model_path: Path, version: int, work_dir: Path | None = None):
    """The engine `config.inference` selects, at policy `version` (vLLM keeps its server log in `work_dir`)."""
    engine = open_model(model_path, inference=config.inference, version=version, name=model_path.name,
                        work_dir=work_dir, max_batch=max(8, config.rollout.workers),
                        prefix_cache_tokens=config.rollout.prefix_cache_tokens, dtype=config.rollout.dtype,
                        kv_cache_tokens=config.rollout.kv_cache_tokens,
                        batch_invariant=config.rollout.batch_invariant)
    if config.inference.engine == "vllm" and config.inference.vllm.url:
        try:  # re-attach: the server may hold weights of another run or of a step past the checkpoint
            engine.load_model_weights(version)
        except BaseException:
            engine.close()
            raise
    return engine
