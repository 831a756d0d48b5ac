"""Curriculum: which task comes next in the single epoch (pure).

The reference upsamples harder tasks later in training, judged by
heuristics such as turns and thinking tokens. In a single epoch no task is
seen twice, so "upsampling" means *reordering the remaining tasks*: while
the recent pass rate is below `saturation` tasks come in their fixed order;
once the easy ones saturate, the next task is taken from the category whose
finished rollouts were hardest (most turns and sampled tokens, lowest pass
rate), so hard tasks are trained on before the epoch ends.

The recent pass rate is that of the `window` latest groups *by admission
order* (`observe_group(..., order=group index)`), not by the order they
happened to finish in: a resumed run, which observes the finished groups
again in admission order, and two runs whose rollouts finished in different
orders pick the same next task (in sync mode; async admission itself
depends on timing).
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from atelier.rl.config import CurriculumConfig


@dataclass
class CategoryStats:
    rollouts: int = 0
    turns: float = 0.0
    tokens: float = 0.0
    passed: float = 0.0

    def hardness(self) -> float:
        """Mean turns * 50 + mean sampled tokens, scaled up by the failure rate."""
        if not self.rollouts:
            return 0.0
        effort = 50.0 * self.turns / self.rollouts + self.tokens / self.rollouts
        return effort * (1.0 + (1.0 - self.passed / self.rollouts))


@dataclass
class Curriculum:
    cfg: CurriculumConfig
    stats: dict[str, CategoryStats] = field(default_factory=dict)
    recent: list[tuple[float, float]] = field(default_factory=list)
    """(admission order, pass rate) of the latest `window` groups, sorted by order."""

    def observe_group(self, category: str, turns: list[int], tokens: list[int], passed: list[bool],
                      order: float | None = None) -> None:
        """Count a finished group; `order` is its admission index (None: after every group so far)."""
        s = self.stats.setdefault(category, CategoryStats())
        s.rollouts += len(turns)
        s.turns += sum(turns)
        s.tokens += sum(tokens)
        s.passed += sum(passed)
        if passed:
            if order is None:
                order = self.recent[-1][0] + 1 if self.recent else 0
            insort(self.recent, (order, sum(passed) / len(passed)))
            del self.recent[:-self.cfg.window]

    @property
    def saturated(self) -> bool:
        return (self.cfg.enabled and len(self.recent) >= self.cfg.window
                and sum(rate for _, rate in self.recent) / len(self.recent) >= self.cfg.saturation)

    def next_task(self, remaining: Sequence[Any], category: Callable[[Any], str]) -> Any:
        """The next task from `remaining` (in epoch order); None when empty."""
        if not remaining:
            return None
        if not self.saturated:
            return remaining[0]
        best, best_h = remaining[0], -1.0
        for task in remaining:  # first of the hardest category keeps the order stable
            stats = self.stats.get(category(task))
            h = stats.hardness() if stats else 0.0
            if h > best_h:
                best, best_h = task, h
        return best
