"""Learning-rate schedule and the mixture's sequence order: pure functions of the step.

Both are functions of counters alone, so a resumed run recomputes exactly
what the uninterrupted run would have used, from the counters in its
checkpoint.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np


def lr_at(step: int, *, lr: float, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to lr * min_lr_ratio at `steps`.

    `step` counts optimizer steps from 0 within the phase.
    """
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def pick_source(weights: list[float], seed: int, phase: int, sample: int) -> int:
    """Which source the `sample`-th sequence of a phase comes from, by weight."""
    u = np.random.default_rng([seed, phase, sample]).random()
    cum = np.cumsum(weights) / sum(weights)
    return int(min(np.searchsorted(cum, u, side="right"), len(weights) - 1))


def row_order(n_rows: int, seed: int, key: int, count: int) -> int:
    """The row served as the `count`-th draw from a pool of `n_rows` (a fresh shuffle each epoch)."""
    epoch, offset = divmod(count, n_rows)
    return int(_permutation(n_rows, seed, key, epoch)[offset])


@lru_cache(maxsize=16)
def _permutation(n_rows: int, seed: int, key: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, key, epoch]).permutation(n_rows)
