"""The reconciler: admits groups, launches rollouts, collects results, forms batches.

Threads and ordering (the concurrency seam of the whole run):

- Rollout workers (threads of a `RolloutBackend`, or Ray actors behind one)
  call `_on_done` when a rollout ends. The trainer thread calls
  `next_batch()` and, once the step's weights are live in the engine,
  `commit(batch, step)`. Every slot state change happens under one lock and
  reaches the ledger file before the lock is released; after each change
  `_pump()` admits new groups and launches queued slots.
- What is slow stays outside that lock: a rollout's trajectory file is
  written before `_on_done` takes it (so the file exists before the
  `graded` event), the ledger's fsync runs after it is released
  (`Ledger.deferred_sync`), and a batch's trajectories missing from memory
  (graded before a restart) are read after `next_batch` chose the batch.
- A `Batch` carries what the trainer and the step's metrics need: the
  groups, each trained slot (reward, final advantage) and its trajectory.
- Versions: `self.version` is the number of committed optimizer steps, which
  is also the engine's weight version once `commit` runs (the trainer
  updates the engine *before* committing). A group records the version at
  admission; every token it produces has a version at least that.

Staleness by admission, not by dropping (docs/pitfalls.md: dropping stale
groups at the sink starves slow, hard tasks). With S = max_staleness and G =
groups_per_step:

1. Admission: a group is admitted only while fewer than (S + 1) * G groups
   are admitted and untrained.
2. Batch guard: the trainer at version v may train a batch only if every
   group left untrained after it was admitted at version >= v + 1 - S (it
   can still be trained within the bound later). Otherwise the trainer
   waits for those older groups; they are never discarded.

So every trained token has staleness (v - its version) <= S. Worked example,
S = 1, G = 2: at v = 0 groups 0-3 are admitted (version 0). Groups 1 and 3
finish first: the trainer may take them (0, 2 left: admitted at 0 >= 0 + 1 - 1).
After step 1 (v = 1) groups 4, 5 are admitted at version 1; the next batch
must include groups 0 and 2 (admitted at 0 < 1 + 1 - 1), so if group 0 is
slow the trainer waits for it rather than training groups 4, 5 first.
In sync mode S = 0: each batch is generated entirely by the current weights.

A group is trained only when every member is graded or dropped; members
lost to infrastructure failures are retried up to `max_retries` times, each
after a backoff (`retry_backoff_s`, doubling) and with the slot's own seed
(`rollout_seed`, which says why), then left out of the group's
statistics (never scored 0); a group with fewer than `min_valid` members
left is dropped with a reason.

Failures are sorted by `atelier.failures.classify`. An infrastructure
failure is retried as above and logged in one line of RUN_DIR/failures.log.
Anything else is a bug: its traceback goes to failures.log, the slot is
queued again at the same attempt (neither dropped nor trained, so a resume
runs it once the bug is fixed), and `next_batch` raises a `BugError` naming
the slot and the task, which stops the run.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from atelier.errors import BugError
from atelier.failures import FailureLog, classify, describe
from atelier.harness.trajectory import Trajectory
from atelier.rl.advantages import final_advantages
from atelier.rl.config import RolloutConfig
from atelier.rl.curriculum import Curriculum
from atelier.rl.ledger import Group, Ledger, Slot
from atelier.rl.rules import (
    TOO_FEW,
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
from atelier.rl.sample import Sample, samples_from_trajectory

__all__ = ["Batch", "FailureBreaker", "Reconciler", "RolloutBackend", "RolloutsFailing", "rollout_seed"]

DoneCallback = Callable[[str, "Trajectory | None", "BaseException | None"], None]


TIED_REASON = "tied"
"""How a group dropped by `skip_tied_groups` begins its reason in the ledger."""


class RolloutBackend(Protocol):
    """Runs rollouts somewhere (threads, Ray actors) against an engine it owns."""

    @property
    def version(self) -> int: ...

    def submit(self, slot_id: str, task: Any, seed: int, done: DoneCallback) -> None: ...

    def update_weights(self, version: int) -> None: ...

    def close(self) -> None: ...


@dataclass
class Batch:
    """One optimizer step: its groups and, per ready member, the slot and its trajectory."""

    groups: list[Group]
    slots: list[Slot]
    trajectories: dict[str, Trajectory]
    version: int

    @property
    def slot_ids(self) -> list[str]:
        return [s.slot_id for s in self.slots]

    def samples(self) -> list[Sample]:
        """Every slot's trajectory as samples, each with its slot's advantage."""
        return [sample for slot in self.slots
                for sample in samples_from_trajectory(self.trajectories[slot.slot_id], slot.advantage or 0.0,
                                                      slot.group_id)]


@dataclass
class Counters:
    gen_tokens: int = 0
    rollouts: int = 0
    failures: int = 0
    """Infrastructure failures (each retried or, past `max_retries`, dropped)."""
    infra_types: Counter = field(default_factory=Counter)
    """The same by exception type."""
    tied_groups: int = 0
    """Groups dropped because every member got the same reward (`skip_tied_groups`)."""
    since: float = field(default_factory=time.perf_counter)


class Reconciler:
    def __init__(self, *, ledger: Ledger, tasks: Sequence[Any], category: Callable[[Any], str],
                 backend: RolloutBackend, cfg: RolloutConfig, curriculum: Curriculum,
                 rollouts_dir: Path, seed: int, version: int, total_steps: int = 0,
                 failure_log: FailureLog | None = None, negative_scale: float = 1.0) -> None:
        self.ledger, self.backend, self.cfg, self.curriculum = ledger, backend, cfg, curriculum
        self.category, self.rollouts_dir, self.seed = category, rollouts_dir, seed
        self.version, self.total_steps = version, total_steps
        self.negative_scale = negative_scale
        """`trainer.negative_advantage_scale`: the final advantages of a group's members
        (`atelier.rl.advantages.final_advantages`) are what the ledger records and the trainer uses."""
        self.staleness = effective_staleness(cfg)
        self.tasks = {t.id: t for t in tasks}
        admitted = ledger.task_ids()
        self.remaining = [t for t in tasks if t.id not in admitted]
        self.running: set[str] = set()
        self.counters = Counters()
        self.fatal: BaseException | None = None
        self.breaker = FailureBreaker(breaker_limit(cfg.workers))
        self._trajectories: dict[str, Trajectory] = {}   # graded slots' trajectories, until batched
        self._not_before: dict[str, float] = {}           # retries waiting out their backoff
        self.failure_log = failure_log or FailureLog(rollouts_dir.parent / "failures.log")
        self._cond = threading.Condition(threading.RLock())
        self._closed = False
        rollouts_dir.mkdir(parents=True, exist_ok=True)

    # --- start / resume ----------------------------------------------------
    def start(self) -> None:
        """Re-queue rollouts that died with a previous process, rebuild curriculum stats and the
        counters of rollouts not yet reported in a metrics line, launch.

        A rollout cut off by the process's death runs again at the *same* attempt, hence with the
        same seed (see `rollout_seed`): a kill is not the rollout's failure, so it neither uses up
        a retry nor changes what the slot samples."""
        with self._cond:
            for slot in self.ledger.in_state("running"):
                self.ledger.set(slot.slot_id, "queued", reason="re-run after restart")
            for slot in self.ledger.in_state("graded", "ready"):   # generated, not yet in a metrics line
                self.counters.rollouts += 1
                self.counters.gen_tokens += slot.tokens
            for group in sorted(self.ledger.groups.values(), key=lambda g: g.index):
                slots = self.ledger.group_slots(group.group_id)
                if not group.dropped and all(s.state in ("ready", "trained") for s in slots if s.state != "dropped"):
                    valid = [s for s in slots if s.state != "dropped"]
                    if valid:
                        self.curriculum.observe_group(self.category(self.tasks[group.task_id]),
                                                      [s.turns for s in valid], [s.tokens for s in valid],
                                                      [bool(s.passed) for s in valid], order=group.index)
                self._maybe_complete(group)
            self._pump()

    # --- admission and launch ---------------------------------------------
    def _live_groups(self) -> int:
        return sum(1 for g in self.ledger.groups.values() if not g.dropped)

    def _groups_wanted(self) -> bool:
        return groups_wanted(self._live_groups(), self.total_steps, self.cfg.groups_per_step)

    def _pump(self) -> None:
        if self._closed or self.fatal is not None:
            return
        while may_admit(len(self.ledger.untrained_groups()), self._live_groups(), staleness=self.staleness,
                        groups_per_step=self.cfg.groups_per_step, total_steps=self.total_steps):
            task = self.curriculum.next_task(self.remaining, self.category)
            if task is None:
                break
            self.remaining.remove(task)
            self.ledger.add_group(f"g{len(self.ledger.groups):05d}-{task.id}", task.id,
                                  self.cfg.group_size, self.version)
        queued = sorted(self.ledger.in_state("queued"),
                        key=lambda s: (self.ledger.groups[s.group_id].index, s.member))
        now = time.monotonic()
        for slot in queued:
            if len(self.running) >= self.cfg.workers:
                break
            if self._not_before.get(slot.slot_id, 0.0) > now:
                continue
            self._not_before.pop(slot.slot_id, None)
            self.ledger.set(slot.slot_id, "running", start_version=self.backend.version)
            self.running.add(slot.slot_id)
            seed = rollout_seed(self.seed, self.ledger.groups[slot.group_id].index, slot.member)
            self.backend.submit(slot.slot_id, self.tasks[slot.task_id], seed, self._on_done)

    # --- results -----------------------------------------------------------
    def _on_done(self, slot_id: str, traj: Trajectory | None, exc: BaseException | None) -> None:
        if exc is None and (traj is None or traj.reward is None):
            exc = MissingReward("the environment returned a trajectory without a reward "
                                "(Environment.rollout must score it, or raise InfraError)")
        if exc is None:  # before the lock: the file exists before the event that points to it
            traj.save(self._path(slot_id))
        with self.ledger.deferred_sync(), self._cond:  # the fsync runs after the lock is released
            self.running.discard(slot_id)
            if self._closed:
                return
            slot = self.ledger.slots[slot_id]
            if exc is None:
                self._graded(slot, traj)
            elif classify(exc) == "infra":
                self._failed(slot, exc)
            else:
                self._bug(slot, exc)
            self._maybe_complete(self.ledger.groups[slot.group_id])
            self._pump()
            self._cond.notify_all()

    def _graded(self, slot: Slot, traj: Trajectory) -> None:
        self.breaker.success()
        self._trajectories[slot.slot_id] = traj
        sampled = sum(seg.sampled_tokens for seg in traj.segments)
        self.counters.gen_tokens += sampled
        self.counters.rollouts += 1
        self.ledger.set(slot.slot_id, "graded", reward=traj.reward,
                        passed=bool(traj.reward_parts.get("pass", 0.0) >= 1.0), turns=traj.turns, tokens=sampled)

    def _failed(self, slot: Slot, exc: BaseException) -> None:
        """An infrastructure failure: retried up to `max_retries` times after a backoff, then
        dropped, never scored."""
        why = describe(exc)
        self.failure_log.record("infra", f"{slot.slot_id} (task {slot.task_id}, attempt {slot.attempt})", exc)
        self.counters.failures += 1
        self.counters.infra_types[type(exc).__name__] += 1
        delay = retry_delay(slot.attempt, max_retries=self.cfg.max_retries, backoff_base_s=self.cfg.retry_backoff_s)
        if delay is not None:
            self.ledger.set(slot.slot_id, "queued", attempt=slot.attempt + 1, failure=f"infra: {why}")
            if delay > 0:
                self._not_before[slot.slot_id] = time.monotonic() + delay
                timer = threading.Timer(delay, self._wake)
                timer.daemon = True
                timer.start()
        else:
            self.ledger.set(slot.slot_id, "dropped", reason=f"infrastructure: {why}", failure=f"infra: {why}")
        self.fatal = self.fatal or self.breaker.failure(why)

    def _bug(self, slot: Slot, exc: BaseException) -> None:
        """Not the infrastructure's, not the model's: stop the run; the slot runs again on resume."""
        where = f"{slot.slot_id} (task {slot.task_id}, attempt {slot.attempt})"
        self.failure_log.record("bug", where, exc)
        self.ledger.set(slot.slot_id, "queued", failure=f"bug: {describe(exc)}")
        if self.fatal is None:
            run_dir = self.rollouts_dir.parent
            self.fatal = BugError(
                f"rollout {slot.slot_id} of task {slot.task_id} failed with a bug, not an infrastructure "
                f"failure: {type(exc).__name__}: {str(exc)[:300]}",
                hint=f"the traceback is in {self.failure_log.path}; fix the bug, then run the same command "
                     f"again to continue (atelier train --run-dir {run_dir} continues this run): this "
                     "rollout runs again and nothing trained so far is lost")

    def _wake(self) -> None:
        """A retry's backoff is over: launch what may run now."""
        with self.ledger.deferred_sync(), self._cond:
            self._pump()

    def _maybe_complete(self, group: Group) -> None:
        slots = self.ledger.group_slots(group.group_id)
        if group.dropped or any(s.state not in ("graded", "dropped") for s in slots):
            return
        valid = [s for s in slots if s.state == "graded"]
        rewards = [s.reward for s in valid]
        verdict = group_verdict(rewards, group.size, min_valid=self.cfg.min_valid,
                                skip_tied_groups=self.cfg.skip_tied_groups)
        if verdict == TOO_FEW:
            self._drop(group, slots, f"only {len(valid)} of {group.size} rollouts survived infrastructure failures")
            return
        self.curriculum.observe_group(self.category(self.tasks[group.task_id]), [s.turns for s in valid],
                                      [s.tokens for s in valid], [bool(s.passed) for s in valid],
                                      order=group.index)
        if verdict is not None:   # tied, with skip_tied_groups
            self._drop(group, slots, f"{TIED_REASON}: every member scored {rewards[0]:g}")
            self.counters.tied_groups += 1
            return
        for s, adv in zip(valid, final_advantages(rewards, self.negative_scale)):
            self.ledger.set(s.slot_id, "ready", advantage=adv)

    def _drop(self, group: Group, slots: Sequence[Slot], reason: str) -> None:
        """Drop a completed group that will not be trained, and forget its members' trajectories."""
        self.ledger.drop_group(group.group_id, reason)
        for s in slots:
            self._trajectories.pop(s.slot_id, None)

    # --- the trainer's side --------------------------------------------------
    def _ready(self, group: Group) -> bool:
        slots = self.ledger.group_slots(group.group_id)
        return all(s.state in ("ready", "dropped") for s in slots) and any(s.state == "ready" for s in slots)

    def _trainable(self) -> Batch | None:
        untrained = self.ledger.untrained_groups()
        picked = choose_batch([self._ready(g) for g in untrained], [g.admitted_version for g in untrained],
                              version=self.version, staleness=self.staleness,
                              groups_per_step=self.cfg.groups_per_step,
                              exhausted=not self.remaining or not self._groups_wanted())
        if picked is None:
            return None
        chosen = [untrained[i] for i in picked]
        slots = [s for g in chosen for s in self.ledger.group_slots(g.group_id) if s.state == "ready"]
        return Batch(chosen, slots, {}, self.version)

    def finished(self) -> bool:
        with self._cond:
            if self.total_steps and self.version >= self.total_steps:
                return True
            return not self.ledger.untrained_groups() and (not self.remaining or not self._groups_wanted())

    def next_batch(self, timeout: float | None = None) -> Batch | None:
        """Block until a batch may be trained; None when the epoch (or step budget) is done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self.fatal is not None:
                    raise self.fatal
                if self.finished():
                    return None
                batch = self._trainable()
                if batch is not None:
                    held = {sid: self._trajectories.pop(sid, None) for sid in batch.slot_ids}
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("no batch became ready in time")
                self._cond.wait(timeout=1.0 if left is None else min(left, 1.0))
        # Outside the lock: slots graded before a restart have their trajectory on disk only.
        batch.trajectories = {sid: traj if traj is not None else self.load_trajectory(sid)
                              for sid, traj in held.items()}
        return batch

    def commit(self, batch: Batch, step: int) -> None:
        """Mark the batch trained by `step` and advance the version (weights are live)."""
        with self.ledger.deferred_sync(), self._cond:
            for sid in batch.slot_ids:
                if self.ledger.slots[sid].state != "trained":
                    self.ledger.set(sid, "trained", step=step)
            self.version = step
            self._pump()
            self._cond.notify_all()

    def take_counters(self) -> Counters:
        with self._cond:
            out, self.counters = self.counters, Counters()
            return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _path(self, slot_id: str) -> Path:
        return self.rollouts_dir / f"{_fname(slot_id)}.json"

    def load_trajectory(self, slot_id: str) -> Trajectory:
        return Trajectory.load(self._path(slot_id))


def rollout_seed(run_seed: int, group_index: int, member: int) -> int:
    """The sampling seed of member `member` of the `group_index`-th admitted group.

    A function of the run's seed and the slot's place alone, never of its
    attempt: every run of the slot draws from the same random stream (and, on
    the same weights, samples the same tokens).
    - A rollout cut off by `kill -9` runs again on resume with this seed, so a
      resumed run draws exactly the samples of an uninterrupted one (with
      `rollout.batch_invariant` and sync mode, bit for bit; tests/rl/test_crash_points.py).
    - An infrastructure retry (sandbox died, engine unreachable) also reruns
      with this seed, deliberately: the failure was the machinery's, not the
      sample's, so the retried rollout is the one a run without the failure
      would have drawn, and a group's statistics are not conditioned on which
      draws happened to survive the infrastructure. The cost: a draw that
      itself provokes an infrastructure failure (say, commands that exhaust the
      sandbox's memory) fails again on each retry and is dropped after
      `max_retries`, never scored, exactly as the failure taxonomy says.
    """
    return (run_seed * 1_000_003 + group_index * 1009 + member * 101) % (2**31)


def _fname(slot_id: str) -> str:
    return slot_id.replace("/", "--")


class MissingReward(Exception):
    """An environment broke its contract: a trajectory came back unscored (a bug)."""
