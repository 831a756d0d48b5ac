"""The simulated reconciler's state: groups and slots, moved by the real reconciler's rules.

`SimLedger` holds what `atelier.rl.ledger.Ledger` holds for a run (groups in admission order,
each slot's state and attempt) in memory, and decides with `atelier.rl.rules`: `may_admit` for
admission, `choose_batch` for the batch guard, `retry_delay` for retries, `group_verdict` for
groups left out, `FailureBreaker` for the stop. It keeps no clock: the pipeline
(`atelier.sim.pipeline`) passes the simulated time in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from atelier.rl.config import RolloutConfig
from atelier.rl.rules import (
    FailureBreaker,
    RolloutsFailing,
    breaker_limit,
    choose_batch,
    effective_staleness,
    group_verdict,
    groups_wanted,
    may_admit,
    retry_delay,
)
from atelier.sim.workload import GroupProfile, RolloutProfile


@dataclass
class SimSlot:
    group: "SimGroup"
    member: int
    profile: RolloutProfile
    state: str = "queued"
    attempt: int = 0
    not_before: float = 0.0
    step: int = 0
    versions: Counter = field(default_factory=Counter)
    """Sampled tokens by the policy version that produced them."""
    started: float = 0.0


@dataclass
class SimGroup:
    index: int
    admitted_version: int
    members: list[SimSlot] = field(default_factory=list)
    dropped: str = ""

    def untrained(self) -> bool:
        return not self.dropped and any(s.state not in ("trained", "dropped") for s in self.members)

    def ready(self) -> bool:
        states = [s.state for s in self.members]
        return all(st in ("ready", "dropped") for st in states) and "ready" in states


class SimLedger:
    def __init__(self, cfg: RolloutConfig, *, steps: int, tasks: int) -> None:
        self.cfg, self.steps, self.tasks = cfg, steps, tasks
        self.staleness = effective_staleness(cfg)
        self.version = 0
        self.groups: list[SimGroup] = []
        self.running = 0
        self.breaker = FailureBreaker(breaker_limit(cfg.workers))
        self.fatal: RolloutsFailing | None = None
        self.dropped: Counter[str] = Counter()
        self.failures = 0
        self.rollouts = 0
        self.gen_tokens = 0

    # -- admission ------------------------------------------------------------------
    def live_groups(self) -> int:
        return sum(1 for g in self.groups if not g.dropped)

    def untrained(self) -> list[SimGroup]:
        return [g for g in self.groups if g.untrained()]

    def tasks_left(self) -> bool:
        """Tasks not admitted yet; an epoch of unknown size holds 20 steps' worth per step asked
        (so that a workload whose every group is dropped still ends)."""
        epoch = self.tasks or 20 * self.steps * self.cfg.groups_per_step
        return len(self.groups) < epoch

    def wants_group(self) -> bool:
        return self.tasks_left() and may_admit(len(self.untrained()), self.live_groups(), staleness=self.staleness,
                                               groups_per_step=self.cfg.groups_per_step, total_steps=self.steps)

    def admit(self, profile: GroupProfile) -> SimGroup:
        group = SimGroup(len(self.groups), self.version)
        group.members = [SimSlot(group, m, p) for m, p in enumerate(profile)]
        self.groups.append(group)
        return group

    def launchable(self, now: float) -> list[SimSlot]:
        """Queued slots that may start now, in the reconciler's order, within `workers`."""
        queued = [s for g in self.groups for s in g.members if s.state == "queued" and s.not_before <= now]
        return queued[:max(0, self.cfg.workers - self.running)]

    # -- results ----------------------------------------------------------------------
    def graded(self, slot: SimSlot, versions: Counter) -> None:
        self.running -= 1
        self.breaker.success()
        slot.state, slot.versions = "graded", versions
        self.rollouts += 1
        self.gen_tokens += slot.profile.sampled
        self.complete(slot.group)

    def failed(self, slot: SimSlot, now: float, why: str) -> float | None:
        """An infrastructure failure; returns the retry's delay (None: dropped)."""
        self.running -= 1
        self.failures += 1
        delay = retry_delay(slot.attempt, max_retries=self.cfg.max_retries, backoff_base_s=self.cfg.retry_backoff_s)
        if delay is None:
            slot.state = "dropped"
        else:
            slot.state, slot.attempt, slot.not_before = "queued", slot.attempt + 1, now + delay
        self.fatal = self.fatal or self.breaker.failure(why)
        self.complete(slot.group)
        return delay

    def complete(self, group: SimGroup) -> None:
        if group.dropped or any(s.state not in ("graded", "dropped") for s in group.members):
            return
        valid = [s for s in group.members if s.state == "graded"]
        verdict = group_verdict([s.profile.reward for s in valid], len(group.members),
                                min_valid=self.cfg.min_valid, skip_tied_groups=self.cfg.skip_tied_groups)
        if verdict is not None:
            group.dropped = verdict
            self.dropped[verdict] += 1
            for s in group.members:
                s.state = "dropped"
            return
        for s in valid:
            s.state = "ready"

    # -- the trainer's side -------------------------------------------------------------
    def exhausted(self) -> bool:
        return not self.tasks_left() or not groups_wanted(self.live_groups(), self.steps, self.cfg.groups_per_step)

    def finished(self) -> bool:
        if self.version >= self.steps:
            return True
        return not self.untrained() and self.exhausted()

    def batch(self) -> list[SimGroup] | None:
        untrained = self.untrained()
        picked = choose_batch([g.ready() for g in untrained], [g.admitted_version for g in untrained],
                              version=self.version, staleness=self.staleness,
                              groups_per_step=self.cfg.groups_per_step, exhausted=self.exhausted())
        return None if picked is None else [untrained[i] for i in picked]

    def commit(self, batch: list[SimGroup], step: int) -> None:
        for g in batch:
            for s in g.members:
                if s.state == "ready":
                    s.state, s.step = "trained", step
        self.version = step

    # -- a restart (the trainer's node lost, or the run stopped and started again) ------------
    def restart(self, checkpoint_step: int) -> None:
        """What a resumed run finds (`atelier.rl.ledger.Ledger.load`): running slots queued again
        at the same attempt, trained slots of steps after the checkpoint ready again."""
        for g in self.groups:
            for s in g.members:
                if s.state == "running":
                    s.state = "queued"
                    s.not_before = 0.0
                elif s.state == "trained" and s.step > checkpoint_step:
                    s.state, s.step = "ready", 0
        self.running = 0
        self.version = checkpoint_step
        self.fatal = None
        self.breaker = FailureBreaker(breaker_limit(self.cfg.workers))
