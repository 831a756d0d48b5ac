"""Trainer ranks as Ray actors in a placement group: `launch_ray_job(kind, config, run_dir, ...)`.

One actor per rank, each in its own bundle of a placement group (`{"CPU":
cpus_per_rank, "GPU": gpus_per_rank}`; strategy SPREAD by default, so ranks
land on different nodes when the cluster has them, STRICT_SPREAD to insist).
Each actor sets torchrun's environment variables for its rank and runs the
same program as a local rank (`atelier.cli.rank.run_rank`): rank 0 is the RL
driver, and with `launcher = "ray"` its `RayBackend` places the rollout and
inference actors in the same cluster, on any node. The rendezvous is rank 0's
node address and a port rank 0's actor found free there.

Requirements, as for the Ray rollout path: the run directory (and the delta
chain) on storage every node mounts, the same atelier on every node.

Failures: the driver waits on every rank's result. A rank that raises, or
whose actor dies (`kill -9`, a lost node: `RayActorError`), ends the wait;
the other rank actors are killed and `RankFailed` names the rank, as the
local launcher does. Collectives inside the ranks keep their timeouts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from atelier.launch import RankFailed


@ray.remote(max_restarts=0)
class RankActor:
    """One trainer rank in a Ray worker process."""

    def address(self) -> tuple[str, int]:
        from atelier.launch import free_port

        return ray.util.get_node_ip_address(), free_port()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, kind: str, config_json: str, run_dir: str, resume: bool, env: dict[str, str]) -> dict | None:
        os.environ.update(env)
        from atelier.cli.rank import run_rank

        return run_rank(kind, config_json, run_dir, resume=resume, quiet=True)


def connect(address: str | None = None) -> None:
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or "auto", include_dashboard=False, log_to_driver=True)
    except (ConnectionError, RuntimeError):
        if address:
            raise
        ray.init(include_dashboard=False, log_to_driver=True)


def launch_ray_job(kind: str, config, run_dir: Path, *, resume: bool, world: int, cpus_per_rank: float = 1.0,
                   gpus_per_rank: float = 0.0, strategy: str = "SPREAD", address: str | None = None,
                   threads: int = 1) -> dict[str, Any]:
    """Run `world` ranks as actors; return rank 0's result plus the node each rank ran on."""
    connect(address)
    bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
    group = placement_group([dict(bundle) for _ in range(world)], strategy=strategy)
    ray.get(group.ready(), timeout=600)
    actors = [RankActor.options(num_cpus=cpus_per_rank, num_gpus=gpus_per_rank,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(
                                    placement_group=group, placement_group_bundle_index=r)).remote()
              for r in range(world)]
    try:
        addr, port = ray.get(actors[0].address.remote())
        nodes = ray.get([a.node.remote() for a in actors])
        run_dir = str(Path(run_dir).resolve())
        refs = []
        for r, actor in enumerate(actors):
            env = {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": addr, "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)}
            refs.append(actor.run.remote(kind, config.model_dump_json(), run_dir, resume, env))
        results = _wait_all(refs, what=f"atelier {kind} with {world} Ray ranks")
        return {**(results[0] or {}), "rank_nodes": nodes}
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)


def _wait_all(refs: list, what: str) -> list:
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except Exception as exc:   # RayTaskError (the rank raised) or RayActorError (it died)
            rank = refs.index(done[0])
            first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RankFailed(f"{what}: rank {rank} of {len(refs)} failed ({type(exc).__name__}: {first}); "
                             "the other ranks were stopped",
                             hint="fix the cause shown above, then continue with --resume RUN_DIR") from None
    return ray.get(refs)
