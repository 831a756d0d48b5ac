"""The delta chain's two rules as pure functions: which kind of file a publish writes, and which
files a reader reads to reach the newest step.

`atelier.rl.weight_sync.DeltaChainWeightSync` applies them to files on shared storage;
`atelier.sim` applies the same functions to simulated transfers (so the simulated bytes are
the ones the real chain would move). No torch here: the simulator imports this module alone.
"""

from __future__ import annotations

from typing import Sequence

FULL, DELTA = "full", "delta"


def publish_kind(step: int, *, full_every: int, has_previous: bool, same_keys: bool = True) -> str:
    """`FULL` at the first publish of a writer with no chain to extend, every `full_every` steps,
    and when the tensors' names changed; `DELTA` otherwise."""
    if not has_previous or step % full_every == 0 or not same_keys:
        return FULL
    return DELTA


def chain_reads(steps: Sequence[tuple[int, str]], held: int | None) -> tuple[int | None, list[int]]:
    """What a reader holding step `held` (None: nothing) reads to reach the newest of `steps`
    (sorted (step, kind) pairs on disk): the full snapshot to load (None: extend what it holds)
    and the deltas to apply after it, in order. Nothing at all when it holds the newest already.

    Raises ValueError when no full snapshot lies at or below the newest step."""
    if not steps:
        return None, []
    newest = steps[-1][0]
    if held == newest:
        return None, []
    fulls = [s for s, kind in steps if kind == FULL and s <= newest]
    if not fulls:
        raise ValueError("the delta chain has no full snapshot")
    base = fulls[-1]
    extend = held is not None and base <= held < newest
    start_after = held if extend else base
    deltas = [s for s, kind in steps if kind == DELTA and start_after < s <= newest]
    return (None if extend else base), deltas
