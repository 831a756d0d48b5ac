"""How many CPU threads the engine's steps run on: as many as pay, measured as it runs.

A decode step is a few hundred operations, and on a CPU each multi-threaded one
waits for all its threads at its end. Alone on a machine, two threads nearly
halve a step's matrix products. But two things make them far slower than one:

- another process wants the cores (a sandbox running tests): one of our
  threads is often descheduled and every operation waits a time slice for it;
- another thread of this process runs multi-threaded torch too (an in-process
  trainer). OpenMP then has more threads than cores and makes idle workers
  sleep at once, so every operation of ours pays a wake-up (see
  docs/log/2026-12-06-rollout-engine.md). For the same reason the engine loads
  and runs its model on its own thread, so a caller's thread keeps no team.

`StepThreads` chooses per step between one thread and torch's thread count, for each batch
size apart:

- on more than one, it drops to one when the engine's thread spent more than
  `CONTENDED` of each of `SUSTAINED` windows of `WINDOW` seconds in a row
  runnable but waiting for a core (its run-queue delay in
  `/proc/self/task/<tid>/schedstat`, where Linux has it). One window is not
  enough: a short burst elsewhere (a process starting, a log flush) makes a
  single window look contended, and a drop it causes costs seconds of slow
  steps until a probe wins the count back;
- and it *probes*: now and then one decode step runs on the other count, and
  when that step is `GAIN` faster than the median of the last steps of the
  same batch size on the current count, the other count becomes current. A
  probe that loses doubles the time to the next one (from `PROBE_FIRST` up to
  `PROBE_LAST` seconds), so a machine that stays busy pays one slow step in
  minutes.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import deque

import torch

WINDOW = 0.5
CONTENDED = 0.10
SUSTAINED = 3   # contended windows in a row before dropping to one thread
GAIN = 0.85
PROBE_FIRST = 2.0
PROBE_LAST = 120.0
COMPARED = 4   # steps of the current count a probe is compared with


@contextlib.contextmanager
def threads(n: int):
    """Run the block with torch on `n` threads in the calling thread (torch's thread count is per
    thread, so other threads, e.g. a trainer's, keep theirs)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_queue_wait_ns(tid: int) -> int | None:
    """Nanoseconds thread `tid` of this process has spent runnable but not running (None where
    the kernel does not say)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None


class StepThreads:
    """`StepThreads(fixed, most)`, used from the thread that runs the steps: `choose(batch)` before
    a step (`batch`: its decode batch size when it only decodes, else None) gives its thread count;
    `record(n, batch, seconds)` after a decode-only step. `fixed` pins the count; None adapts
    between 1 and `most` (default: torch's thread count) as the module docstring says, for each
    batch size apart (sizes of one power of two share a choice): a step of one sequence is a few
    hundred small operations, one of 64 a few dozen large ones, and what else runs on the machine
    can make one thread the faster for the first and two for the second."""

    def __init__(self, fixed: int | None = None, most: int | None = None) -> None:
        if fixed is not None and fixed < 1:
            raise ValueError("a fixed thread count must be >= 1")
        self.fixed = fixed
        self.most = max(1, most or torch.get_num_threads())
        self.current = fixed or self.most      # the count of the last step chosen
        self.switches = 0
        self._count: dict[int | None, int] = {}
        self._recent: dict[int | None, deque[tuple[int, float]]] = {}
        self._probe_gap: dict[int | None, float] = {}
        self._next_probe: dict[int | None, float] = {}
        self._probing: int | None | bool = False
        self._tid: int | None = None
        self._window: tuple[float, int] | None = None
        self._contended = 0   # contended windows in a row
        self._default = self.most

    @property
    def adaptive(self) -> bool:
        return self.fixed is None and self.most > 1

    @staticmethod
    def bucket(batch: int | None) -> int | None:
        return None if batch is None else max(1, batch).bit_length()

    def choose(self, batch: int | None) -> int:
        if not self.adaptive:
            return self.current
        self._watch_run_queue()
        key, now = self.bucket(batch), time.monotonic()
        count = self._count.setdefault(key, self._default)
        self._next_probe.setdefault(key, now + PROBE_FIRST)
        same = [s for n, s in self._recent.get(key, ()) if n == count]
        self._probing = key if batch is not None and now >= self._next_probe[key] and len(same) >= 2 else False
        self.current = self._other(count) if self._probing is not False else count
        return self.current

    def record(self, n: int, batch: int, seconds: float) -> None:
        if not self.adaptive:
            return
        key = self.bucket(batch)
        count = self._count.get(key, self._default)
        if self._probing == key and n != count:
            self._probing = False
            same = [s for m, s in self._recent.get(key, ()) if m == count][-COMPARED:]
            if same and seconds < GAIN * statistics.median(same):
                self._switch(key, n)
            else:
                self._probe_gap[key] = min(PROBE_LAST, 2 * self._probe_gap.get(key, PROBE_FIRST))
            self._next_probe[key] = time.monotonic() + self._probe_gap.get(key, PROBE_FIRST)
            return
        self._recent.setdefault(key, deque(maxlen=2 * COMPARED)).append((n, seconds))

    def _other(self, count: int) -> int:
        return 1 if count > 1 else self.most

    def _switch(self, key: int | None, n: int) -> None:
        self._count[key] = n
        self.switches += 1
        self._recent.pop(key, None)
        self._probe_gap[key] = PROBE_FIRST
        self._next_probe[key] = time.monotonic() + PROBE_FIRST

    def _watch_run_queue(self) -> None:
        """Drop every batch size to one thread when this thread waited for a core more than
        `CONTENDED` of each of the last `SUSTAINED` windows."""
        now = time.monotonic()
        if self._window is not None and now - self._window[0] < WINDOW:
            return
        if self._tid is None:
            self._tid = threading.get_native_id()
        wait = run_queue_wait_ns(self._tid)
        if wait is None:
            return
        if self._window is not None and any(c > 1 for c in self._count.values()):
            waited = (wait - self._window[1]) / 1e9 / (now - self._window[0])
            self._contended = self._contended + 1 if waited > CONTENDED else 0
            if self._contended >= SUSTAINED:
                self._contended = 0
                for key, c in list(self._count.items()):
                    if c > 1:
                        self._switch(key, 1)
        self._window = (now, wait)
