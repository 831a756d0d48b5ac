"""The reconciler's rules as pure functions: what is admitted, what may be trained, when a failed
rollout runs again, when a group is left out, when the run stops.

`atelier.rl.reconciler.Reconciler` applies them to its ledger under its lock; `atelier.sim`
applies the very same functions to a simulated pipeline, so a rule changed here changes both.
The reconciler's docstring explains the rules and works an example; these functions only
decide, they hold no state but `FailureBreaker`'s count and touch no file or clock.
"""

from __future__ import annotations

from typing import Sequence

from atelier.errors import AtelierError
from atelier.failures import backoff_s
from atelier.rl.advantages import tied
from atelier.rl.config import RolloutConfig


class RolloutsFailing(AtelierError):
    """Too many rollouts in a row failed: the infrastructure is down, not flaky."""


def effective_staleness(cfg: RolloutConfig) -> int:
    """The bound S the rules apply: `max_staleness` in async mode, 0 in sync mode (each batch is
    generated entirely by the current weights)."""
    return 0 if cfg.mode == "sync" else cfg.max_staleness


def admission_limit(staleness: int, groups_per_step: int) -> int:
    """Most groups admitted and untrained at once: (S + 1) * G."""
    return (staleness + 1) * groups_per_step


def groups_wanted(live_groups: int, total_steps: int, groups_per_step: int) -> bool:
    """Whether a step budget (`trainer.steps`, 0: none) still wants groups, `live_groups` being
    those admitted and not dropped."""
    return not total_steps or live_groups < total_steps * groups_per_step


def may_admit(untrained_groups: int, live_groups: int, *, staleness: int, groups_per_step: int,
              total_steps: int) -> bool:
    """Whether one more group may be admitted now (rule 1 of the reconciler's docstring)."""
    return (untrained_groups < admission_limit(staleness, groups_per_step)
            and groups_wanted(live_groups, total_steps, groups_per_step))


def choose_batch(ready: Sequence[bool], admitted_versions: Sequence[int], *, version: int, staleness: int,
                 groups_per_step: int, exhausted: bool) -> list[int] | None:
    """Which of the untrained groups (in admission order; `ready[i]`: every member graded or
    dropped, one at least graded) the trainer at `version` trains now, as their indices, or None
    to wait. The first `groups_per_step` ready groups, or, once no group will be admitted any more
    (`exhausted`) and all are ready, the rest; never while a group left out would exceed the
    staleness bound later (rule 2, the batch guard)."""
    chosen_all = [i for i, is_ready in enumerate(ready) if is_ready]
    last = exhausted and len(chosen_all) == len(ready) and bool(chosen_all)
    if len(chosen_all) < groups_per_step and not last:
        return None
    chosen = chosen_all[:groups_per_step]
    floor = version + 1 - staleness
    taken = set(chosen)
    if any(admitted_versions[i] < floor for i in range(len(ready)) if i not in taken):
        return None  # an older group would exceed the bound later: wait for it
    return chosen


def retry_delay(attempt: int, *, max_retries: int, backoff_base_s: float) -> float | None:
    """After an infrastructure failure of attempt `attempt` (0 the first): seconds before the
    slot runs again, or None when its retries are spent and it is dropped."""
    if attempt >= max_retries:
        return None
    return backoff_s(backoff_base_s, attempt + 1)


def breaker_limit(workers: int) -> int:
    """Rollouts failing in a row that stop the run: never fewer than 8, three per worker."""
    return max(8, 3 * workers)


class FailureBreaker:
    """Trips after `limit` rollouts in a row failed: the infrastructure is down, not flaky."""

    def __init__(self, limit: int) -> None:
        self.limit, self.streak = limit, 0

    def success(self) -> None:
        self.streak = 0

    def failure(self, why: str) -> RolloutsFailing | None:
        self.streak += 1
        if self.streak < self.limit:
            return None
        return RolloutsFailing(f"{self.streak} rollouts in a row failed; the last: {why}",
                               hint="check the engine and the sandboxes, then run the same command again to continue")


TOO_FEW = "too few"
TIED = "tied"


def group_verdict(valid_rewards: Sequence[float], size: int, *, min_valid: int,
                  skip_tied_groups: bool) -> str | None:
    """What becomes of a group whose members are all graded or dropped: None, trained; `TOO_FEW`,
    dropped (fewer than `min_valid` survived infrastructure failures); `TIED`, dropped because
    every member scored the same and `skip_tied_groups` is on."""
    if len(valid_rewards) < min(min_valid, size):
        return TOO_FEW
    if skip_tied_groups and tied(list(valid_rewards)):
        return TIED
    return None
