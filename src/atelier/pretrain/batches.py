"""Batches for each phase, with a cursor that a checkpoint stores and a resume restores.

Shape legend: N rows, S sequence length, V vocabulary.

A mask value of 1 at position t means token t is a training target (predicted
from tokens < t); position 0 of a row is never a target.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.nn.functional as F

from atelier.pretrain.packing import TokenStream
from atelier.pretrain.schedule import pick_source, row_order


class MixtureBatches:
    """Rows of `seq_len` drawn from weighted token streams.

    The n-th row of the phase comes from the source `pick_source` names and is
    that source's next row in a per-epoch shuffle; the cursor is just the
    sample count and the draws per source.
    """

    def __init__(self, streams: list[TokenStream], weights: list[float], seq_len: int,
                 seed: int, phase: int, cursor: dict[str, Any] | None = None) -> None:
        self.streams, self.weights, self.seq_len = streams, weights, seq_len
        self.seed, self.phase = seed, phase
        self.n_rows = [s.rows(seq_len) for s in streams]
        self.sample = (cursor or {}).get("sample", 0)
        self.counts = list((cursor or {}).get("counts", [0] * len(streams)))

    def cursor(self) -> dict[str, Any]:
        return {"sample": self.sample, "counts": list(self.counts)}

    def next(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        rows = []
        for _ in range(n):
            src = pick_source(self.weights, self.seed, self.phase, self.sample)
            row = row_order(self.n_rows[src], self.seed, src, self.counts[src])
            rows.append(self.streams[src].row(row, self.seq_len))
            self.sample += 1
            self.counts[src] += 1
        ids_NS = np.stack(rows)
        mask_NS = np.ones_like(ids_NS)
        mask_NS[:, 0] = 0
        return ids_NS, mask_NS


class ExampleBatches:
    """Rows of packed SFT examples, reshuffled every epoch."""

    def __init__(self, ids_NS: np.ndarray, mask_NS: np.ndarray, seed: int, phase: int,
                 cursor: dict[str, Any] | None = None) -> None:
        self.ids_NS, self.mask_NS, self.seed, self.phase = ids_NS, mask_NS, seed, phase
        self.sample = (cursor or {}).get("sample", 0)

    def cursor(self) -> dict[str, Any]:
        return {"sample": self.sample}

    def next(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        picks = []
        for _ in range(n):
            picks.append(row_order(len(self.ids_NS), self.seed, 10_000 + self.phase, self.sample))
            self.sample += 1
        return self.ids_NS[picks], self.mask_NS[picks]


def masked_lm_loss(logits_NSV, ids_NS, mask_NS):
    """Summed next-token NLL over target positions, and how many there were.

    Returning the sum (not the mean) lets gradient accumulation divide by the
    target count of the whole optimizer step, so every token weighs the same
    however the step was split into micro-batches.
    """
    logits = logits_NSV[:, :-1].float()
    targets = ids_NS[:, 1:]
    weights = mask_NS[:, 1:].to(logits.dtype)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return (nll * weights.reshape(-1)).sum(), weights.sum()
