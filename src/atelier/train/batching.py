"""A step's samples spread over ranks and micro-batches (pure).

`balanced_partition(lengths, world)` packs a step's samples into per-rank
lists of nearly equal token counts (longest first onto the lightest rank, the
report's global sequence packing); `micro_batches` then cuts each rank's list
into micro-batches, and every rank runs the *same number* of forward/backward
passes (FSDP's collectives need that), padding with empty micro-batches whose
loss mask is all zero (`step_plan`).
"""

from __future__ import annotations


def balanced_partition(lengths: list[int], world: int) -> list[list[int]]:
    """Indices per rank, longest first onto the rank with the fewest tokens (ties: lowest rank).

    Deterministic, so every rank computes the same partition from the same batch.
    """
    loads = [0] * world
    parts: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        parts[r].append(i)
        loads[r] += lengths[i]
    return [sorted(p) for p in parts]


def micro_batches(indices: list[int], size: int, count: int) -> list[list[int]]:
    """`indices` cut into `count` micro-batches of at most `size`; the tail ones may be empty."""
    out = [indices[i:i + size] for i in range(0, len(indices), size)]
    if len(out) > count:
        raise ValueError(f"{len(indices)} samples do not fit {count} micro-batches of {size}")
    return out + [[] for _ in range(count - len(out))]


def step_plan(lengths: list[int], world: int, rank: int, micro_batch: int) -> list[list[int]]:
    """This rank's micro-batches (indices into the step's samples); the same count on every rank."""
    parts = balanced_partition(lengths, world)
    count = max(1, max(-(-len(p) // micro_batch) for p in parts))
    return micro_batches(parts[rank], micro_batch, count)
