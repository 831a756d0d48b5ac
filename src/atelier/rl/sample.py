"""What the trainer eats: one token sequence with its loss mask and the
sampler's logprobs and versions, plus its advantage.

One sample per trajectory *segment*: turns within a segment extend the same
prefix, so they are merged into one sequence (docs/pitfalls.md: one sample per
turn multiplies compute and advances the schedule too fast). Every segment of a
self-summarised chain gets the episode's advantage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from atelier.harness.trajectory import Trajectory


@dataclass
class Sample:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]          # sampler's log mu per token (0.0 where loss_mask is 0)
    versions: list[int]            # policy version per token (-1 where not sampled)
    advantage: float
    group_id: str
    task_id: str
    routes: Any = None
    """MoE router replay: the sampler's experts, a packed uint8/uint16 array [tokens, layers, k]
    (atelier.moe.replay.pack_routes); None when the sampler did not record them."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError("sample fields must all have one entry per token")
        if self.routes is not None and len(self.routes) != n:
            raise ValueError("sample routes must have one row per token")

    def suffix(self, start: int) -> Sample:
        """The sample from token `start` on (what follows a prefix the trainer runs once)."""
        return Sample(self.token_ids[start:], self.loss_mask[start:], self.logprobs[start:], self.versions[start:],
                      self.advantage, self.group_id, self.task_id,
                      None if self.routes is None else self.routes[start:])


def samples_from_trajectory(traj: Trajectory, advantage: float, group_id: str) -> list[Sample]:
    """One sample per segment that has at least one sampled token."""
    return [
        Sample(
            token_ids=list(seg.token_ids),
            loss_mask=list(seg.loss_mask),
            logprobs=list(seg.logprobs),
            versions=list(seg.versions),
            advantage=advantage,
            group_id=group_id,
            task_id=traj.task_id,
            routes=seg.routes,
        )
        for seg in traj.segments
        if seg.sampled_tokens > 0
    ]
