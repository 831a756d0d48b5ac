"""A shared server in SimPy: jobs served at once, each at a rate that depends on how many run.

`SharedServer` is the one queueing model of the simulator. Its jobs carry an amount of work
(tokens to decode, bytes to move, CPU-seconds to run) and progress together, each at
`rate(n)` units per second while n jobs run; at most `max_jobs` run, the rest wait in order
of arrival. That is continuous batching exactly at the granularity of a decode step (every
running sequence gains one token per step, a step of n sequences takes `1 / rate(n)`), and
processor sharing for a link or a host's cores (`rate(n) = capacity / n`).

Events only at arrivals, completions, stalls and outages, never per token: a virtual clock
`V` (work done by any one running job since the start) advances at `rate(n)`, and each job
finishes when `V` reaches its start mark plus its work, so a heap of finish marks gives the
next completion. A *stall* stops every job (a prefill on the engine, a weight swap); an
*outage* fails every running job with `ServerDown` and holds new ones until the server is up.
`set_speed(s)` scales every rate by `s` from now on (a CPU shared with other work: `Cores`), and
`on_busy(callback)` is told whenever the server goes from idle to busy or back.

Version marks: `mark(version)` records that from now on the work done is of `version` (the
weights swapped in); a finished job reports how much of its work fell under each version, the
simulated counterpart of the per-token policy versions a rollout records.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import simpy

EPS = 1e-9


class ServerDown(Exception):
    """The server failed while the job ran (an inference replica killed, a host lost)."""


@dataclass
class Job:
    work: float
    size: float = 0.0                  # what it holds while running (KV tokens), against `capacity`
    done: simpy.Event | None = None
    start_v: float = 0.0
    finish_v: float = 0.0
    version_work: dict[int, float] = field(default_factory=dict)
    """Work done under each version, set when the job finishes."""


class SharedServer:
    """See the module docstring. `rate(n)`: work units per second of each of n running jobs."""

    def __init__(self, env: simpy.Environment, rate: Callable[[int], float], *, max_jobs: int | None = None,
                 capacity: float | None = None, version: int = 0) -> None:
        self.env, self.rate, self.max_jobs, self.capacity = env, rate, max_jobs, capacity
        self.V, self._last = 0.0, env.now
        self._heap: list[tuple[float, int, Job]] = []
        self._waiting: deque[Job] = deque()
        self._held = 0.0
        self._seq = itertools.count()
        self._stall_until = env.now
        self.up = True
        self.speed = 1.0
        self._busy_callbacks: list[Callable[[], None]] = []
        self._marks_v: list[float] = [0.0]
        self._marks_version: list[int] = [version]
        self._wake = env.event()
        self.busy_time = 0.0
        env.process(self._run())

    # -- what callers do ---------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._heap)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def version(self) -> int:
        return self._marks_version[-1]

    def submit(self, work: float, size: float = 0.0) -> simpy.Event:
        """An event that succeeds with the finished `Job`, or fails with `ServerDown`."""
        job = Job(work=max(work, 0.0), size=size, done=self.env.event())
        self._waiting.append(job)
        self._poke()
        return job.done

    def stall(self, seconds: float) -> None:
        """Stop every running job for `seconds` more (after any stall already under way)."""
        self._advance()
        self._stall_until = max(self._stall_until, self.env.now) + max(seconds, 0.0)
        self._poke()

    def mark(self, version: int) -> None:
        """Work done from now on is of `version`."""
        self._advance()
        self._marks_v.append(self.V)
        self._marks_version.append(version)

    def fail(self) -> int:
        """The server goes down: running jobs fail with `ServerDown` (returns how many); waiting
        jobs stay queued until `restore`."""
        self._advance()
        failed = 0
        for _, _, job in self._heap:
            job.done.fail(ServerDown("the server went down while the job ran"))
            failed += 1
        self._heap, self._held, self.up = [], 0.0, False
        self._poke()
        return failed

    def set_speed(self, speed: float) -> None:
        self._advance()
        self.speed = speed
        self._poke()

    def on_busy(self, callback: Callable[[], None]) -> None:
        self._busy_callbacks.append(callback)

    @property
    def busy(self) -> bool:
        return bool(self._heap) and self.up

    def restore(self) -> None:
        self._advance()
        self.up = True
        self._poke()

    # -- the clock -----------------------------------------------------------------
    def _poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _advance(self) -> None:
        now = self.env.now
        productive = now - max(self._last, self._stall_until)
        if productive > 0 and self._heap and self.up:
            self.V += productive * self.rate(len(self._heap)) * self.speed
            self.busy_time += productive
        self._last = now

    def _fits(self, job: Job) -> bool:
        if self.max_jobs is not None and len(self._heap) >= self.max_jobs:
            return False
        return self.capacity is None or not self._heap or self._held + job.size <= self.capacity

    def _admit(self) -> None:
        while self.up and self._waiting and self._fits(self._waiting[0]):
            job = self._waiting.popleft()
            job.start_v = self.V
            job.finish_v = self.V + job.work
            self._held += job.size
            heapq.heappush(self._heap, (job.finish_v, next(self._seq), job))

    def _complete(self) -> None:
        while self._heap and self._heap[0][0] <= self.V + EPS * max(1.0, abs(self.V)):
            _, _, job = heapq.heappop(self._heap)
            self._held -= job.size
            job.version_work = self._split_by_version(job.start_v, job.finish_v)
            job.done.succeed(job)

    def _split_by_version(self, start: float, end: float) -> dict[int, float]:
        i = bisect.bisect_right(self._marks_v, start) - 1   # the mark in force when the job started
        if end <= start:
            return {self._marks_version[i]: 0.0}
        out: dict[int, float] = {}
        while i < len(self._marks_v) and self._marks_v[i] < end:
            lo = max(start, self._marks_v[i])
            hi = end if i + 1 == len(self._marks_v) else min(end, self._marks_v[i + 1])
            if hi > lo:
                version = self._marks_version[i]
                out[version] = out.get(version, 0.0) + hi - lo
            i += 1
        return out

    def _run(self):
        was_busy = False
        while True:
            self._advance()
            self._complete()
            self._admit()
            self._complete()   # jobs of no work finish at once
            if self.busy != was_busy:
                was_busy = self.busy
                for callback in self._busy_callbacks:
                    callback()
            self._wake = self.env.event()
            if self._heap and self.up:
                left = self._heap[0][0] - self.V
                rate = self.rate(len(self._heap)) * self.speed
                delay = max(self._stall_until - self.env.now, 0.0) + max(left, 0.0) / rate
                yield self.env.timeout(delay) | self._wake
            else:
                yield self._wake


class Cores:
    """A machine's CPU cores shared by servers that each keep `demand` cores busy while busy
    (a trainer rank's threads, an engine's): while their busy demands exceed `cores`, every busy
    one runs at `cores / demand` of its speed (the laptop's trainer and engine on 2 cores)."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.members: list[tuple[SharedServer, float]] = []

    def add(self, server: SharedServer, demand: float) -> None:
        self.members.append((server, demand))
        server.on_busy(self._rebalance)

    def _rebalance(self) -> None:
        demand = sum(d for server, d in self.members if server.busy)
        speed = min(1.0, self.cores / demand) if demand > 0 else 1.0
        for server, _ in self.members:
            if server.speed != speed:
                server.set_speed(speed)
