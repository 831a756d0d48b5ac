"""A pool of sandboxes: bounded concurrency, admission by host pressure, warm spares.

`SandboxPool.acquire(snapshot)` returns a fresh sandbox; `release(sb)` closes
it. Sandboxes are never reused across rollouts: what makes acquiring cheap is a
spare created ahead of time ("warm"), not a recycled one.

The concurrency seam, in order of what an `acquire` does:

1. Under the pool's lock, take a spare of the same (snapshot, config) if there
   is one: O(1), no process is started. Otherwise reserve a slot. `max_live`
   bounds every sandbox the pool owns: handed out ("live"), idle spares
   ("warm") and being created. Spares are evictable: an acquire that finds the
   pool full closes the least recently used spare and takes its slot. Only
   handed-out and in-creation sandboxes make an acquire wait; past `timeout`
   it raises `PoolExhausted`.
2. Outside the lock, admission: read MemAvailable and CPU pressure (PSI
   `some avg10`, the percent of time a runnable task waited, against
   `max_cpu_pressure` where the kernel has PSI; else the 1-minute load average
   per CPU against `max_load_per_cpu`). While memory is below
   `min_available_mb` or the CPU is over its threshold, sleep
   in short steps, for at most `max_defer_s` (and never past the acquire's
   deadline), then create anyway. Each delayed creation counts once in
   `deferred`. Admission slows creation down under pressure; it never fails it.
3. Outside the lock, create the sandbox and record how long it took.

Example, `max_live=2, warm=1`: A acquires snapshot S (miss: creates; S now has
a target of one spare, which the refill thread creates: 2 owned). B acquires
snapshot T: the pool is full, so B closes S's spare and creates its own. A
releases: one slot frees, the refill thread makes a spare for T (the most
recently used snapshot first), and so on.

Warm spares: with `warm=N`, every (snapshot, config) that has been acquired
(or declared with `prewarm`) gets a target of N spares, kept by one daemon
thread that creates them in the free room of `max_live`, most recently used
snapshot first. Only the `max_warm_snapshots` most recently used snapshots keep
spares; older ones are closed. Snapshots must not change on disk while the
pool holds sandboxes over them (a spare made earlier would see the change
half-applied, as any overlay would).

Ownership: `close()` closes every sandbox the pool handed out or holds as a
spare, and waits for creations in flight. Forks (`sb.fork()`) belong to the
caller, who must close them (the backend still kills them at exit).

Where it is meant to be used, and where it is not (yet): RL rollouts and
evaluation create their sandboxes directly (`atelier.harness.episode`), one
per episode and one per grade. A bwrap sandbox is created in milliseconds
(docs/log/2026-12-02-sandboxes.md) against episodes of seconds to minutes, so
a warm spare would save little there, and the reconciler's `workers` and
eval's `concurrency` already bound how many run at once. The pool pays off
where creation is on the critical path: many short episodes at high
concurrency (tool-light environments, interactive use), admission under host
memory or CPU pressure, and sandboxes on other nodes (`RaySandboxPool`,
which wraps one pool per node). Today only their tests reach them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from atelier.sandbox.base import Sandbox, SandboxClosed, SandboxConfig, SandboxError, SnapshotMissing, SnapshotUnusable
from atelier.sandbox.factory import create_sandbox
from atelier.sandbox.pressure import (
    CpuPressure,
    admission_wait_reason,
    read_cpu_pressure,
    read_mem_available_mb,
)

log = logging.getLogger(__name__)

CREATE_WINDOW = 1000
"""Creations whose durations feed `create_p50_ms`/`create_p99_ms`."""
_DEFER_STEP_S = 0.1


class PoolExhausted(SandboxError):
    """Every slot of the pool stayed in use until the acquire's timeout."""


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def least_loaded(open_counts: Sequence[int], turn: int) -> int:
    """The host a new sandbox goes to (`RaySandboxPool`; `atelier.sim` places by the same rule):
    the one with the fewest open sandboxes, ties broken in turn starting at host `turn`."""
    n = len(open_counts)
    return min(range(n), key=lambda i: (open_counts[i], (i - turn) % n))


# -- the pool -----------------------------------------------------------------

PoolKey = tuple[str, str]
"""(resolved snapshot path, config as JSON): spares only serve the same pair."""


@dataclasses.dataclass
class _Warm:
    snapshot: Path
    config: SandboxConfig
    target: int
    spares: collections.deque = dataclasses.field(default_factory=collections.deque)
    refilling: int = 0
    failures: int = 0
    retry_at: float = 0.0


class SandboxPool:
    """Hands out fresh sandboxes; thread-safe. See the module docstring."""

    def __init__(self, config: SandboxConfig | None = None, max_live: int = 64, warm: int = 0,
                 min_available_mb: int = 512, max_load_per_cpu: float = 4.0, *,
                 max_cpu_pressure: float = 90.0, max_defer_s: float = 5.0,
                 max_warm_snapshots: int = 8,
                 memory_probe: Callable[[], float | None] = read_mem_available_mb,
                 cpu_probe: Callable[[], CpuPressure | None] = read_cpu_pressure,
                 factory: Callable[[Path, SandboxConfig], Sandbox] = create_sandbox) -> None:
        """`max_cpu_pressure` is the PSI threshold in percent. `memory_probe`,
        `cpu_probe` and `factory` replace the /proc readers and
        `create_sandbox` (tests use them)."""
        if max_live < 1 or warm < 0:
            raise SandboxError(f"bad pool size max_live={max_live}, warm={warm}",
                               hint="max_live must be >= 1 and warm >= 0")
        self.config = config or SandboxConfig()
        self.max_live, self.warm = max_live, warm
        self.min_available_mb, self.max_load_per_cpu = min_available_mb, max_load_per_cpu
        self.max_cpu_pressure, self.max_defer_s = max_cpu_pressure, max_defer_s
        self.max_warm_snapshots = max_warm_snapshots
        self._memory_probe, self._cpu_probe, self._factory = memory_probe, cpu_probe, factory
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._live: set[Sandbox] = set()
        self._warm: collections.OrderedDict[PoolKey, _Warm] = collections.OrderedDict()  # LRU first
        self._n_spares = 0
        self._creating = 0
        self._waiting = 0                # acquires blocked on a full pool (stats: "waiting")
        self._counts: collections.Counter[str] = collections.Counter()
        self._deferred_s = 0.0
        self._create_ms: collections.deque[float] = collections.deque(maxlen=CREATE_WINDOW)
        self._refiller: threading.Thread | None = None
        self._last_pressure_warning = -math.inf

    # -- public API ------------------------------------------------------------
    def acquire(self, snapshot: str | os.PathLike, config: SandboxConfig | None = None,
                timeout: float | None = None) -> Sandbox:
        """A fresh sandbox over `snapshot`; blocks while `max_live` sandboxes
        are in use, for at most `timeout` seconds (None: no limit)."""
        cfg = config or self.config
        path = Path(snapshot).resolve()
        key = (str(path), cfg.model_dump_json())
        deadline = None if timeout is None else time.monotonic() + timeout
        evicted = None
        try:
            with self._cond:
                while True:
                    self._check_open()
                    entry = self._warm.get(key)
                    if entry is not None:
                        self._warm.move_to_end(key)
                        if entry.spares:
                            sb = entry.spares.popleft()
                            self._n_spares -= 1
                            self._live.add(sb)
                            self._counts["warm_hits"] += 1
                            self._cond.notify_all()  # the refill thread makes a new spare
                            return sb
                    if self._owned() < self.max_live:
                        break
                    evicted = self._pop_lru_spare()
                    if evicted is not None:
                        self._counts["evicted"] += 1
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise PoolExhausted(
                            f"all {self.max_live} sandboxes of the pool stayed in use for {timeout:g} s",
                            hint="release sandboxes when done (`with pool.sandbox(snapshot) as sb:`), "
                            "raise `max_live`, or pass a longer `timeout`")
                    self._waiting += 1
                    try:
                        self._cond.wait(remaining)
                    finally:
                        self._waiting -= 1
                self._creating += 1
        finally:
            if evicted is not None:
                evicted.close()
        sb = self._finish_create(path, cfg, deadline, key=None)
        if self.warm:  # from now on keep spares of this snapshot
            with self._cond:
                dropped = self._declare(key, path, cfg, self.warm, only_if_new=True)
            for old in dropped:
                old.close()
        return sb

    def release(self, sandbox: Sandbox) -> None:
        """Close the sandbox (it is never reused) and free its slot."""
        sandbox.close()
        with self._cond:
            self._live.discard(sandbox)
            self._cond.notify_all()

    @contextlib.contextmanager
    def sandbox(self, snapshot: str | os.PathLike, config: SandboxConfig | None = None,
                timeout: float | None = None) -> Iterator[Sandbox]:
        sb = self.acquire(snapshot, config, timeout)
        try:
            yield sb
        finally:
            self.release(sb)

    def prewarm(self, snapshot: str | os.PathLike, n: int, config: SandboxConfig | None = None) -> None:
        """Keep `n` spares of `snapshot` ready from now on (0 stops and closes them)."""
        cfg = config or self.config
        path = Path(snapshot).resolve()
        if not path.is_dir():
            raise SnapshotMissing(f"snapshot directory {str(snapshot)!r} does not exist",
                                  hint="pass the path of a repository checkout")
        with self._cond:
            self._check_open()
            dropped = self._declare((str(path), cfg.model_dump_json()), path, cfg, n, only_if_new=False)
        for sb in dropped:
            sb.close()

    def stats(self) -> dict[str, float | int | None]:
        with self._cond:
            times = list(self._create_ms)
            return {
                "created": self._counts["created"], "failed": self._counts["failed"],
                "live": len(self._live), "warm": self._n_spares, "creating": self._creating,
                "waiting": self._waiting,
                "warm_hits": self._counts["warm_hits"], "evicted": self._counts["evicted"],
                "deferred": self._counts["deferred"], "deferred_s": round(self._deferred_s, 3),
                "create_p50_ms": percentile(times, 50), "create_p99_ms": percentile(times, 99),
            }

    def create_times_ms(self) -> list[float]:
        """Durations of the recent creations (the window behind the percentiles)."""
        with self._cond:
            return list(self._create_ms)

    def close(self) -> None:
        """Close every sandbox the pool owns, after creations in flight end.
        Sandboxes handed out are closed too. Idempotent."""
        with self._cond:
            self._closing.set()
            self._cond.notify_all()
            refiller = self._refiller
        if refiller is not None and refiller is not threading.current_thread():
            refiller.join()
        with self._cond:
            while self._creating:
                self._cond.wait()
            owned = list(self._live)
            for entry in self._warm.values():
                owned += entry.spares
            self._live.clear()
            self._warm.clear()
            self._n_spares = 0
        for sb in owned:
            sb.close()

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (callers hold self._cond unless said otherwise) -------------
    def _check_open(self) -> None:
        if self._closing.is_set():
            raise SandboxClosed("the sandbox pool is closed", hint="create a new SandboxPool")

    def _owned(self) -> int:
        return len(self._live) + self._n_spares + self._creating

    def _declare(self, key: PoolKey, path: Path, cfg: SandboxConfig, n: int,
                 only_if_new: bool) -> list[Sandbox]:
        """Set a spare target; returns spares to close (outside the lock)."""
        if self._closing.is_set():
            return []
        entry = self._warm.get(key)
        if entry is None:
            entry = self._warm[key] = _Warm(path, cfg, n)
        elif not only_if_new:
            entry.target = n
        self._warm.move_to_end(key)
        dropped: list[Sandbox] = []
        while len(self._warm) > self.max_warm_snapshots:
            _, old = self._warm.popitem(last=False)
            dropped += old.spares
        while len(entry.spares) > entry.target:
            dropped.append(entry.spares.pop())
        self._n_spares -= len(dropped)
        if self._refiller is None:
            self._refiller = threading.Thread(target=self._refill_loop, name="sandbox-pool-refill",
                                              daemon=True)
            self._refiller.start()
        self._cond.notify_all()
        return dropped

    def _pop_lru_spare(self) -> Sandbox | None:
        for entry in self._warm.values():
            if entry.spares:
                self._n_spares -= 1
                return entry.spares.popleft()
        return None

    def _next_refill(self) -> tuple[PoolKey, _Warm] | None:
        if self._owned() >= self.max_live:
            return None
        now = time.monotonic()
        for key, entry in reversed(self._warm.items()):  # most recently used first
            if len(entry.spares) + entry.refilling < entry.target and now >= entry.retry_at:
                return key, entry
        return None

    def _refill_loop(self) -> None:
        while True:
            with self._cond:
                job = None
                while not self._closing.is_set() and (job := self._next_refill()) is None:
                    self._cond.wait(1.0)  # also wakes to retry after a failure's backoff
                if job is None:
                    return
                key, entry = job
                entry.refilling += 1
                self._creating += 1
            try:
                self._finish_create(entry.snapshot, entry.config, None, key=key)
                entry.failures = 0
            except SandboxClosed:
                return
            except Exception as exc:  # a background thread: log, back off, keep serving
                with self._cond:
                    entry.failures += 1
                    entry.retry_at = time.monotonic() + min(30.0, 2.0 ** entry.failures)
                    if isinstance(exc, (SnapshotMissing, SnapshotUnusable)):  # no retry can cure
                        self._warm.pop(key, None)
                log.warning("could not create a spare sandbox over %s: %s", entry.snapshot, exc)
            finally:
                with self._cond:
                    entry.refilling -= 1

    def _finish_create(self, path: Path, cfg: SandboxConfig, deadline: float | None,
                       key: PoolKey | None) -> Sandbox:
        """Create into a slot already reserved (`_creating`); called without the
        lock. With `key` the sandbox becomes a spare of that key, else live."""
        try:
            self._admit(deadline)
            self._check_open()
            start = time.monotonic()
            try:
                sb = self._factory(path, cfg)
            except Exception:
                with self._cond:
                    self._counts["failed"] += 1
                raise
            surplus = None
            with self._cond:
                self._counts["created"] += 1
                self._create_ms.append((time.monotonic() - start) * 1000)
                entry = self._warm.get(key) if key is not None else None
                if self._closing.is_set():
                    surplus = sb
                elif key is None:
                    self._live.add(sb)
                elif entry is not None and len(entry.spares) < entry.target:
                    entry.spares.append(sb)
                    self._n_spares += 1
                else:  # the snapshot lost its spares meanwhile
                    surplus = sb
            if surplus is not None:
                surplus.close()  # before the slot frees, so close() never misses it
                self._check_open()
            return sb
        finally:
            with self._cond:
                self._creating -= 1
                self._cond.notify_all()

    def _admit(self, deadline: float | None) -> None:
        """Wait, in short sleeps and for a bounded time, while the host is
        short of memory or CPU (see the module docstring)."""
        reason = self._wait_reason()
        if reason is None:
            return
        start = time.monotonic()
        until = start + self.max_defer_s if deadline is None else min(start + self.max_defer_s, deadline)
        while reason is not None and time.monotonic() < until:
            if self._closing.wait(min(_DEFER_STEP_S, max(0.0, until - time.monotonic()))):
                break
            reason = self._wait_reason()
        waited = time.monotonic() - start
        with self._cond:
            self._counts["deferred"] += 1
            self._deferred_s += waited
            warn = reason is not None and start - self._last_pressure_warning > 60
            if warn:
                self._last_pressure_warning = start
        if warn:
            log.warning("creating a sandbox although %s (waited %.1f s; further such "
                        "messages are muted for a minute)", reason, waited)

    def _wait_reason(self) -> str | None:
        return admission_wait_reason(
            self._memory_probe(), self._cpu_probe(), min_available_mb=self.min_available_mb,
            max_load_per_cpu=self.max_load_per_cpu, max_cpu_pressure=self.max_cpu_pressure)
