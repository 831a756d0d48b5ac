"""The slot ledger: every sample's lifecycle, append-only on disk.

A *slot* is one member of one group: `queued -> running -> graded -> ready ->
trained`, or `dropped` with a reason. `graded` means the environment returned
a trajectory with a reward (its file is written before the event);
`ready` means its whole group is graded and advantages are set; `trained`
carries the optimizer step that consumed it. An infrastructure failure sends
a slot back to `queued` with `attempt + 1`, or to `dropped` once the retries
are spent.

Durability and ordering: one JSON line per event, written and flushed to the
OS under the ledger's lock (a `kill -9` cannot lose it after that) and
fsync'd before `record` returns, so the ledger on disk is always a prefix of
what happened. Inside `deferred_sync()` the fsync waits until the block
ends: the reconciler records under its own lock and syncs after releasing
it, so one rollout's fsync never holds up another's completion.
Replaying it gives the state. A torn last line (kill -9 mid-write) is
ignored. Resume rules (`Ledger.load(path, committed_step)`):

- `trained` events of a step newer than the last committed checkpoint are
  undone (those slots are `ready` again: the model that learned from them was
  never saved);
- slots left `queued` or `running` are re-run (their rollout died with the
  process), at the same attempt: a kill is not a failure of the rollout;
- `graded` and `ready` slots keep their trajectories and are trained once.

Groups are numbered in admission order (`group_index`); the task cursor is
the set of tasks that have a group. Every event carries `t`, the Unix time it
was recorded: replaying ignores it; `atelier.sim` reads how long slots queued,
ran and waited to be trained from it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

STATES = ("queued", "running", "graded", "ready", "trained", "dropped")


@dataclass
class Slot:
    slot_id: str
    group_id: str
    task_id: str
    member: int
    state: str = "queued"
    attempt: int = 0
    reason: str = ""
    reward: float | None = None
    passed: bool | None = None
    start_version: int | None = None
    step: int | None = None              # the step that trained it
    advantage: float | None = None
    turns: int = 0
    tokens: int = 0                      # sampled tokens
    failures: list[str] = field(default_factory=list)


@dataclass
class Group:
    group_id: str
    task_id: str
    index: int                           # admission order
    admitted_version: int
    size: int
    dropped: str = ""
    slots: list[str] = field(default_factory=list)


class Ledger:
    """Append-only JSONL of slot events plus the state they replay to. Thread-safe."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.slots: dict[str, Slot] = {}
        self.groups: dict[str, Group] = {}
        self._lock = threading.RLock()
        self._file = None
        self._deferred = threading.local()

    # --- persistence -------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, committed_step: int | None = None) -> "Ledger":
        """Replay `path` (missing: empty); undo trained events after `committed_step`."""
        ledger = cls(path)
        if ledger.path.exists():
            for line in ledger.path.read_text(encoding="utf-8").splitlines():
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    break                    # a torn tail: nothing after it was ever acknowledged
                ledger._apply(event)
        if committed_step is not None:
            for slot in ledger.slots.values():
                if slot.state == "trained" and (slot.step or 0) > committed_step:
                    slot.state, slot.step = "ready", None
        return ledger

    def _write(self, event: dict[str, Any]) -> None:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()

    def _sync(self) -> None:
        file = self._file
        if file is not None:
            try:
                os.fsync(file.fileno())
            except (ValueError, OSError):  # closed meanwhile: close() flushed it
                pass

    @contextmanager
    def deferred_sync(self) -> Iterator[None]:
        """Events this thread records inside the block reach the OS at once and
        are fsync'd once, when the block ends (see the module docstring)."""
        depth = getattr(self._deferred, "depth", 0)
        self._deferred.depth = depth + 1
        try:
            yield
        finally:
            self._deferred.depth = depth
            if depth == 0:
                self._sync()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "group":
            group = Group(event["group_id"], event["task_id"], event["index"],
                          event["admitted_version"], event["size"])
            self.groups[group.group_id] = group
            for m in range(group.size):
                slot = Slot(f"{group.group_id}/{m}", group.group_id, group.task_id, m)
                self.slots[slot.slot_id] = slot
                group.slots.append(slot.slot_id)
        elif kind == "group_dropped":
            self.groups[event["group_id"]].dropped = event["reason"]
        elif kind == "slot":
            slot = self.slots[event["slot_id"]]
            for key in ("state", "attempt", "reason", "reward", "passed", "start_version", "step",
                        "advantage", "turns", "tokens"):
                if key in event:
                    setattr(slot, key, event[key])
            if event.get("failure"):
                slot.failures.append(event["failure"])
        else:
            raise ValueError(f"unknown ledger event {kind!r}")

    def record(self, event: dict[str, Any]) -> None:
        event = {**event, "t": round(time.time(), 4)} if "t" not in event else event
        with self._lock:
            self._write(event)
            self._apply(event)
        if not getattr(self._deferred, "depth", 0):
            self._sync()

    # --- transitions -------------------------------------------------------
    def add_group(self, group_id: str, task_id: str, size: int, version: int) -> Group:
        with self._lock:
            self.record({"event": "group", "group_id": group_id, "task_id": task_id,
                         "index": len(self.groups), "admitted_version": version, "size": size})
            return self.groups[group_id]

    def set(self, slot_id: str, state: str, **fields: Any) -> None:
        if state not in STATES:
            raise ValueError(f"unknown slot state {state!r}")
        self.record({"event": "slot", "slot_id": slot_id, "state": state, **fields})

    def drop_group(self, group_id: str, reason: str) -> None:
        with self._lock:
            self.record({"event": "group_dropped", "group_id": group_id, "reason": reason})
            for sid in self.groups[group_id].slots:
                if self.slots[sid].state not in ("dropped", "trained"):
                    self.set(sid, "dropped", reason=f"group dropped: {reason}")

    # --- queries -----------------------------------------------------------
    def group_slots(self, group_id: str) -> list[Slot]:
        return [self.slots[s] for s in self.groups[group_id].slots]

    def in_state(self, *states: str) -> Iterator[Slot]:
        return (s for s in list(self.slots.values()) if s.state in states)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATES}
        for slot in self.slots.values():
            out[slot.state] += 1
        return out

    def task_ids(self) -> set[str]:
        return {g.task_id for g in self.groups.values()}

    def untrained_groups(self) -> list[Group]:
        """Groups admitted and neither trained nor dropped, in admission order."""
        out = []
        for g in sorted(self.groups.values(), key=lambda g: g.index):
            if g.dropped:
                continue
            if any(self.slots[s].state not in ("trained", "dropped") for s in g.slots):
                out.append(g)
        return out
