"""How a sandbox's memory is bounded, for root and for an ordinary user.

A sandbox must never take the host down by allocating memory. Two ways, the
first that works here is used (`SandboxConfig.memory_mb` is the limit):

1. ``cgroup``: a memory cgroup per sandbox (`cgroups.SandboxCgroup`). The
   kernel bounds the whole sandbox and kills a process past it, counted in
   the cgroup's `oom_kill`; no per-process limit. Root can always make one.
   An ordinary user can where its own cgroup is delegated to it: cgroup v2
   under systemd's user manager (started through `systemd-run --user
   --scope -p Delegate=yes atelier ...`), a container's cgroup namespace, or
   a v1 memory hierarchy whose cgroup it owns. Under v2, atelier then moves
   the processes of its own cgroup into a leaf child once, since v2 lets
   only a cgroup without processes hand controllers to its children.
2. ``watchdog``: no writable memory cgroup (an ordinary user on most
   machines, root in some containers). Each process gets the address-space
   limit `memory_mb` (RLIMIT_AS: a single process cannot pass it; its
   allocation fails inside it, e.g. Python's `MemoryError`), and one
   thread of the host process sums the resident anonymous memory of every
   process of each sandbox every `INTERVAL_S`; past `memory_mb` it kills the
   largest one (SIGKILL, as the kernel's OOM killer would) and counts the
   kill. Many processes together can pass the limit only by what they
   allocate within one interval before the kill. A sandbox that runs no
   command and holds no process of its own (a warm pool's) costs nothing:
   nothing in it can grow until a command starts.

Either way `ExecResult.oom_killed` says a process of the sandbox was killed
for memory while the command ran (a count compared before and after). The
local backend has only RLIMIT_AS (``rlimit``) and never reports a kill.

What the watchdog does not see: memory not charged to a process's resident
anonymous pages (kernel memory, page cache; files in the sandbox's tmpfs are
bounded by `disk_mb` instead), and a burst faster than one interval. Shared
copy-on-write pages of forked processes are counted once per process, so it
errs towards killing early.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from typing import Iterable

log = logging.getLogger(__name__)

INTERVAL_S = 0.05
PAGE = os.sysconf("SC_PAGE_SIZE")


def children(pid: int) -> list[int]:
    """Direct children of every thread of `pid` ([] once it is gone)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def tree(roots: Iterable[int]) -> list[int]:
    """`roots` and all their descendants that still exist."""
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += children(pid)
    return sorted(seen)


def anon_bytes(pid: int) -> int:
    """Resident memory of `pid` that is not file-backed (statm's resident
    minus shared pages): what only killing it gives back. 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            fields = f.read().split()
        return max(0, int(fields[1]) - int(fields[2])) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def over_limit(usage: dict[int, int], limit: int) -> int | None:
    """The pid to kill when the sum of `usage` passes `limit`: the largest
    (the kernel's choice, too); None when within it."""
    if sum(usage.values()) <= limit or not usage:
        return None
    return max(usage, key=lambda pid: usage[pid])


def host_oom_kills() -> int | None:
    """Processes the kernel's OOM killer has killed on this host since boot,
    any cgroup's limit or the host's memory alike (`oom_kill` in
    /proc/vmstat, Linux >= 4.13); None where it is not counted."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


Counts = tuple[int | None, int | None]
"""A counter read before and after a command."""


def _rose(counts: Counts | None) -> bool:
    return counts is not None and None not in counts and counts[1] > counts[0]  # type: ignore[operator]


def attribute_kill(exit_code: int, kills: Counts, limit_hits: Counts | None, host_kills: Counts) -> str | None:
    """Who killed a process of the sandbox while a command ran: "sandbox"
    (past its own limit: the code's doing), "host" (the host's OOM killer,
    short of memory: not the code's doing) or None (no OOM kill).

    `kills`: the sandbox's own count of OOM kills (a memory cgroup's, which
    counts the host's kills of its processes too; the watchdog's, which
    counts only its own); `limit_hits`: the cgroup's count of hits of its
    limit (None for the watchdog, whose every kill is for the limit);
    `host_kills`: the host's count (`host_oom_kills`), used only where the
    sandbox's own count cannot see the host's kills (the watchdog): a
    command that died of SIGKILL (exit 137) while it rose."""
    if _rose(kills):
        return "sandbox" if limit_hits is None or _rose(limit_hits) else "host"
    if limit_hits is None and exit_code == 137 and _rose(host_kills):
        return "host"
    return None


_ALLOCATION_FAILED = ("MemoryError", "Cannot allocate memory", "std::bad_alloc", "out of memory",
                      "Out of memory", "memory allocation of")


def allocation_failed(exit_code: int, stderr: str) -> bool:
    """Whether a failed command's error output reads like an allocation that
    failed under RLIMIT_AS (Python, libc's ENOMEM, C++, Rust): a hint to show
    the agent where no kill is counted. The program wrote it, so it is
    never taken as proof of anything."""
    return exit_code != 0 and any(p in stderr for p in _ALLOCATION_FAILED)


class Watch:
    """The watchdog's view of one sandbox: its root processes (the sandbox's
    init, each running command's top process) and the kills made so far."""

    def __init__(self, limit_bytes: int, roots: Iterable[int]) -> None:
        self.limit_bytes = limit_bytes
        self.kills = 0
        self._roots = set(roots)
        self._base = frozenset(self._roots)
        # Idle: no command runs and the sandbox holds nothing but its holder,
        # so nothing in it can grow until the next command: not walked.
        self.active = True
        self._lock = threading.Lock()

    def add_root(self, pid: int) -> None:
        with self._lock:
            self._roots.add(pid)
            self.active = True

    def discard_root(self, pid: int) -> None:
        with self._lock:
            self._roots.discard(pid)

    def check(self) -> None:
        """One pass: kill the largest process while the sandbox is over its limit."""
        with self._lock:
            if not self.active:
                return
            roots = set(self._roots)
        procs = [pid for pid in tree(roots) if pid not in roots]
        with self._lock:
            if self._roots == self._base and len(procs) <= 1:  # the holder alone
                self.active = False
        usage = {pid: anon_bytes(pid) for pid in procs}
        while (victim := over_limit(usage, self.limit_bytes)) is not None:
            self.kills += 1  # before the kill: a command that dies of it must see the count
            log.info("sandbox memory watchdog: killing pid %d (%d MiB resident) past %d MiB",
                     victim, usage[victim] >> 20, self.limit_bytes >> 20)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
            usage.pop(victim)


class Watchdog:
    """One daemon thread that checks every registered sandbox each interval."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._watches: "weakref.WeakSet[Watch]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def watch(self, limit_bytes: int, roots: Iterable[int]) -> Watch:
        w = Watch(limit_bytes, roots)
        with self._lock:
            self._watches.add(w)
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name="atelier-memory-watchdog", daemon=True)
                self._thread.start()
        return w

    def unwatch(self, w: Watch) -> None:
        with self._lock:
            self._watches.discard(w)

    def _run(self) -> None:
        event = threading.Event()
        while True:
            with self._lock:
                watches = list(self._watches)
            for w in watches:
                try:
                    w.check()
                except Exception:  # a watchdog that dies would leave every sandbox unbounded
                    log.exception("sandbox memory watchdog: a check failed")
            event.wait(self.interval_s)


WATCHDOG = Watchdog()
