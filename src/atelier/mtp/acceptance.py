"""Greedy acceptance of the heads' drafts, measured on token sequences without an engine.

Legend: K = heads, B = sequences, T = tokens, L = start positions.

A speculative step that starts at position i (the trunk has h^0_i and the next token t_{i+1})
drafts t_{i+2} with head 1, t_{i+3} with head 2, ... and keeps the drafts up to the first one
the main model's greedy choice rejects. Teacher-forced over a sequence, head k's draft at i is
accepted when its argmax equals the main head's argmax at i + k and heads 1..k-1 were
accepted at i. Per head this gives the conditional rate (accepted at depth k among the starts
accepted at depth k-1), and over D heads the mean accepted length: tokens a verification step
emits, 1 (the verified token) + the expected number of accepted drafts.

On held-out text the heads are fed the text's tokens; greedy decoding feeds them the model's
own choices. The two agree where the text is the model's own greedy continuation, which is why
`atelier mtp eval` measures both: acceptance on held-out code, and on greedy continuations of
held-out prompts (what greedy speculative decoding would accept, start by start).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Acceptance:
    """Counts over start positions: where heads 1..k all matched (`chain`), where head k matched."""

    heads: int
    starts: int = 0
    chain: list[int] = field(default_factory=list)
    matched: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.chain = self.chain or [0] * self.heads
        self.matched = self.matched or [0] * self.heads

    def add(self, match_KBT: torch.Tensor, weights_KBT: torch.Tensor) -> None:
        """Count one batch laid out on the teacher's positions (`atelier.mtp.loss`): head k's row
        at j = i + k is its draft from start i; a start counts when every head has a weighted row."""
        K, _, T = match_KBT.shape
        L = T - K
        if L < 1:
            return
        rows = [match_KBT[k - 1, :, k:k + L] for k in range(1, K + 1)]
        valid_BL = torch.stack([weights_KBT[k - 1, :, k:k + L] > 0 for k in range(1, K + 1)]).all(0)
        chain_BL = torch.ones_like(valid_BL)
        self.starts += int(valid_BL.sum())
        for k, row in enumerate(rows):
            chain_BL = chain_BL & row
            self.chain[k] += int((chain_BL & valid_BL).sum())
            self.matched[k] += int((row & valid_BL).sum())

    def merge(self, other: Acceptance) -> None:
        self.starts += other.starts
        self.chain = [a + b for a, b in zip(self.chain, other.chain)]
        self.matched = [a + b for a, b in zip(self.matched, other.matched)]

    def to_dict(self) -> dict[str, Any]:
        n = max(self.starts, 1)
        before = [self.starts] + self.chain[:-1]
        per_head = [{"head": k + 1, "rate": self.chain[k] / max(before[k], 1), "accepted": self.chain[k],
                     "tried": before[k], "match_rate": self.matched[k] / n} for k in range(self.heads)]
        return {"heads": self.heads, "starts": self.starts, "per_head": per_head,
                "mean_accepted_length": 1.0 + sum(self.chain) / n}
