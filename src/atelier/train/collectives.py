"""What the ranks of a step compute together: sums and maxima of metrics, a barrier, the
global gradient norm; and a collective's failure (a dead or hung rank) named as such.

Every function is the identity (or nothing) on one rank, so the trainers call
them unconditionally.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from atelier.train.ranks import DistributedError, Ranks


def all_reduce_sum(values: list[float], ranks: Ranks) -> list[float]:
    if not ranks.sharded:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ranks.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(values: list[float], ranks: Ranks) -> list[float]:
    if not ranks.sharded:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ranks.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier(ranks: Ranks) -> None:
    if ranks.sharded:
        dist.barrier()


def clip_grad_norm(params, max_norm: float) -> float:
    """Global gradient norm (across shards and ranks) and clipping; DTensor-aware."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


@contextlib.contextmanager
def named_failure(what: str) -> Iterator[None]:
    """Turn a collective's failure (a dead or hung rank) into a `DistributedError` that says so."""
    try:
        yield
    except (RuntimeError, TimeoutError) as exc:
        text = str(exc)
        markers = ("Connection closed", "Connection reset", "connection", "timed out", "Timed out",
                   "Timeout", "Broken pipe", "NCCL communicator", "peer")
        if any(m in text for m in markers):
            raise DistributedError(f"{what}: another rank died or stopped answering ({text.splitlines()[0]})",
                                   hint="the whole job stops; run the same command again to continue it") from exc
        raise
