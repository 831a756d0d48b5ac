"""Peak memory of a whole process tree, sampled from /proc.

`atelier run` holds each stage in a child process (see `atelier.pipeline.child`),
and the children start their own (sandboxes, test runs, rollout workers), so
the peak of any one process says little. `TreeMemory` samples, every
`interval_s`, the root process and all its descendants and keeps two maxima:

- `peak_pss`, the figure a memory budget is checked against: the sum of each
  process's proportional set size (`Pss` in /proc/PID/smaps_rollup), where a
  page shared by n processes (a forked child's copy-on-write pages, the same
  shared library mapped by every worker) counts 1/n in each. Summed over a
  tree it is what the tree holds in RAM (pages it shares with processes
  outside the tree count only their share). A process whose smaps_rollup
  cannot be read (an older kernel, no permission) counts its RSS instead,
  which can only overstate.
- `peak_rss`, the sum of every process's VmRSS: an upper bound that counts a
  shared page once per process sharing it. A stage that forks workers from a
  process holding a model reports the model once per worker here.

One process is never counted twice: a child created by vfork (Python's
subprocess uses it where it can) runs in its parent's memory until it execs,
and /proc shows that memory under both pids, so a sample taken in that window
would count a stage's whole model again. A child whose memory is its
parent's (`kcmp(KCMP_VM)`) is skipped, and each process's two figures come
from one read of its smaps_rollup, never from page counts read earlier: a
child that read as its parent's memory and then exec'd or exited in between
was counted as a second copy of it (a training stage starting sandboxes
recorded about twice what it held: docs/log/2026-12-04-rl-epoch.md). A process that has ended
counts nothing.

A spike shorter than the interval can be missed. Off Linux (no /proc) both
are None.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from atelier.fsio import proc_stat_fields

PROC = Path("/proc")
PEAK_KEYS = ("peak_pss_mb", "peak_rss_mb")
"""How `stages.json` and `summary.json` name the two peaks, in MiB."""


@dataclass(frozen=True)
class TreeSample:
    """Bytes resident in a process tree at one moment."""

    rss: int
    """Sum of VmRSS: shared pages counted once per process."""
    pss: int
    """Sum of Pss: shared pages split among the processes sharing them."""


def tree_pids(parents: Mapping[int, int], root: int) -> set[int]:
    """`root` and every process whose parent chain reaches it (pure)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def _read_procs(proc: Path = PROC) -> tuple[dict[int, int], dict[int, tuple[int, ...]]]:
    """(pid -> parent pid, pid -> its statm fields in pages) of every process readable now."""
    parents, statm = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = tuple(int(f) for f in (entry / "statm").read_text().split())
        except OSError:  # it ended while we looked
            continue
        pid = int(entry.name)
        parents[pid] = int(proc_stat_fields(stat)[1])
        statm[pid] = fields
    return parents, statm


_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())
_KCMP_VM = 1


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def same_memory(pid: int, other: int) -> bool | None:
    """Whether two processes run in one address space (a vfork child before
    it execs); None where the kernel cannot say (no kcmp, no permission)."""
    libc = _libc() if _KCMP is not None else None
    if libc is None:
        return None
    answer = libc.syscall(_KCMP, pid, other, _KCMP_VM, 0, 0)
    return None if answer < 0 else answer == 0


def _runs_in_parents_memory(pid: int, parent: int, statm: Mapping[int, tuple[int, ...]]) -> bool:
    same = same_memory(pid, parent)
    if same is None:   # no kcmp: equal page counts are the only sign left
        return statm.get(pid) == statm.get(parent)
    return same


def process_memory(pid: int, proc: Path = PROC) -> TreeSample | None:
    """RSS and PSS of `pid` in bytes, from one read of smaps_rollup; None where it cannot
    be read; ProcessLookupError when the process has ended."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError) as exc:   # ESRCH: exiting, its memory already gone
        raise ProcessLookupError(pid) from exc
    except OSError:
        return None
    kib = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss"):
            kib[key] = int(rest.split()[0])
    if len(kib) < 2:
        return None
    return TreeSample(rss=kib["Rss"] * 1024, pss=kib["Pss"] * 1024)


def tree_memory(root: int, proc: Path = PROC) -> TreeSample | None:
    """What `root` and its descendants hold resident now; None without /proc."""
    if not (proc / str(root)).is_dir():
        return None
    parents, statm = _read_procs(proc)
    page = os.sysconf("SC_PAGE_SIZE")
    total_rss = total_pss = 0
    for pid in tree_pids(parents, root):
        fields, parent = statm.get(pid), parents.get(pid)
        if not fields or (parent in statm and _runs_in_parents_memory(pid, parent, statm)):
            continue  # gone, or its parent's memory seen through a vfork child
        try:
            own = process_memory(pid, proc) if fields[1] else TreeSample(0, 0)
        except ProcessLookupError:
            continue  # its page counts may have been a vfork child's view of its parent
        if own is None:
            own = TreeSample(fields[1] * page, fields[1] * page)
        total_rss += own.rss
        total_pss += own.pss
    return TreeSample(rss=total_rss, pss=total_pss)


class TreeMemory:
    """A background sampler of `tree_memory(root)`; `peak_pss` and `peak_rss`
    are the largest sums seen since start (or the last `reset`), in bytes."""

    def __init__(self, root: int | None = None, interval_s: float = 0.5) -> None:
        self.root = root or os.getpid()
        self.interval_s = interval_s
        self.peak_pss: int | None = None
        self.peak_rss: int | None = None
        self.now: TreeSample | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tree-memory", daemon=True)

    def __enter__(self) -> "TreeMemory":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def sample(self) -> TreeSample | None:
        value = tree_memory(self.root)
        with self._lock:
            self.now = value
            if value is not None:
                self.peak_pss = max(value.pss, self.peak_pss or 0)
                self.peak_rss = max(value.rss, self.peak_rss or 0)
        return value

    def peaks_mb(self) -> dict[str, int | None]:
        """Both peaks in MiB, keyed by `PEAK_KEYS`."""
        with self._lock:
            peaks = (self.peak_pss, self.peak_rss)
        return {key: None if peak is None else round(peak / 2 ** 20) for key, peak in zip(PEAK_KEYS, peaks)}

    def reset(self) -> None:
        """Start new peaks (a new stage) from the last sample."""
        with self._lock:
            self.peak_pss = None if self.now is None else self.now.pss
            self.peak_rss = None if self.now is None else self.now.rss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
