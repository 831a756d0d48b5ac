"""What a simulated rollout does: its turns, their tokens, the environment's time between them.

A `RolloutProfile` is one rollout as the pipeline sees it: time before its first model call
(sandbox creation, the prompt), then per turn the context the model is called on, the tokens it
samples and the environment's time after the call (tools; after the last call, the grade).
Model time is not part of a profile: the simulated engine decides it.

Two sources of profiles, both drawn a whole group at a time (the members of a group share a
task, so a hard task is long for all of them):
- `ReplayedWorkload`: the groups of a real run, read by `atelier.sim.calibrate` from its
  trajectories and ledger, drawn at random with replacement;
- `ParametricWorkload`: lognormal turns, tokens and tool times around the means of a
  `WorkloadSpec` (what a cluster file says of a workload no run has measured yet).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol, Sequence

from atelier.sim.cluster import WorkloadSpec


@dataclass(frozen=True)
class Turn:
    context: int
    """Tokens of context the model is called on."""
    sampled: int
    after_s: float
    """The environment's time after this call, before the next (or, after the last, the end)."""


@dataclass(frozen=True)
class RolloutProfile:
    setup_s: float
    turns: tuple[Turn, ...]
    length: int
    """Positions the trainer runs for this sample (its segments' tokens)."""
    reward: float = 0.0

    @property
    def sampled(self) -> int:
        return sum(t.sampled for t in self.turns)


GroupProfile = tuple[RolloutProfile, ...]


class Workload(Protocol):
    def draw_group(self, size: int, rng: random.Random) -> GroupProfile: ...


class ReplayedWorkload:
    """Groups of a real run; a group of another size takes members of one group cyclically."""

    def __init__(self, groups: Sequence[GroupProfile]) -> None:
        kept = [g for g in groups if g]
        if not kept:
            raise ValueError("no rollout to replay")
        self.groups = kept

    def draw_group(self, size: int, rng: random.Random) -> GroupProfile:
        group = rng.choice(self.groups)
        order = list(group)
        rng.shuffle(order)
        return tuple(order[i % len(order)] for i in range(size))


def lognormal(rng: random.Random, mean: float, cv: float) -> float:
    """A lognormal draw of the given mean and coefficient of variation (cv 0: the mean)."""
    if cv <= 0 or mean <= 0:
        return mean
    sigma2 = math.log1p(cv * cv)
    return rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))


class ParametricWorkload:
    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec

    def draw_group(self, size: int, rng: random.Random) -> GroupProfile:
        hardness = lognormal(rng, 1.0, self.spec.task_cv)
        return tuple(self._member(hardness, rng) for _ in range(size))

    def _member(self, hardness: float, rng: random.Random) -> RolloutProfile:
        s = self.spec
        n_turns = max(1, round(lognormal(rng, s.turns * hardness, s.turns_cv)))
        context, turns = int(s.prompt_tokens), []
        for i in range(n_turns):
            sampled = max(1, round(lognormal(rng, s.sampled_tokens_per_turn, s.sampled_cv)))
            last = i == n_turns - 1
            after = s.grade_s if last else lognormal(rng, s.tool_s_per_turn, s.tool_cv)
            turns.append(Turn(context, sampled, after))
            context += sampled + (0 if last else int(s.tool_tokens_per_turn))
        reward = 1.0 if rng.random() < s.pass_rate else 0.0
        return RolloutProfile(setup_s=s.setup_s, turns=tuple(turns), length=context, reward=reward)
