"""N trainer ranks as Ray actors in a placement group: `launch_ray(target, world, ...)`.

One actor per rank, each in its own bundle of a placement group (`{"CPU":
cpus_per_rank, "GPU": gpus_per_rank}`; strategy SPREAD by default, so ranks
land on different nodes when the cluster has them, STRICT_SPREAD to insist).
Each actor sets torchrun's environment variables for its rank and calls
`target()`, the same program a local rank runs (for `atelier train`, rank 0
is the RL driver, and with `launcher = "ray"` its `RayBackend` places the
rollout and inference actors in the same cluster, on any node). `target`
must be importable where the actors run (a module-level function, or a
`functools.partial` of one): Ray sends it by reference. The rendezvous is
rank 0's node address and a port rank 0's actor found free there.

Requirements, as for the Ray rollout path: the run directory (and the delta
chain) on storage every node mounts, the same atelier on every node.

Failures: the driver waits on every rank's result. A rank that raises, or
whose actor dies (`kill -9`, a lost node: `RayActorError`), ends the wait;
the other rank actors are killed and `RankFailed` names the rank, as the
local launcher does. Collectives inside the ranks keep their timeouts.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from atelier.train.ranks import RankFailed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote(max_restarts=0)
class RankActor:
    """One trainer rank in a Ray worker process."""

    def address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, target: Callable[[], Any], env: dict[str, str]) -> Any:
        os.environ.update(env)
        return target()


def connect(address: str | None = None) -> None:
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or "auto", include_dashboard=False, log_to_driver=True)
    except (ConnectionError, RuntimeError):
        if address:
            raise
        ray.init(include_dashboard=False, log_to_driver=True)


def launch_ray(target: Callable[[], Any], world: int, *, cpus_per_rank: float = 1.0, gpus_per_rank: float = 0.0,
               strategy: str = "SPREAD", address: str | None = None, threads: int = 1,
               what: str = "training") -> tuple[Any, list[str]]:
    """Run `target()` on `world` rank actors; return rank 0's result and the node each rank ran on."""
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
        refs = []
        for r, actor in enumerate(actors):
            env = {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": addr, "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)}
            refs.append(actor.run.remote(target, env))
        results = _wait_all(refs, what=what)
        return results[0], nodes
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
                             hint="fix the cause shown above, then run the same command again to continue"
                             ) from None
    return ray.get(refs)
