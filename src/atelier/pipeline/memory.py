"""Peak resident memory of a whole process tree, sampled from /proc.

`atelier run` holds each stage in a child process (see `atelier.pipeline.isolate`),
and the children start their own (sandboxes, test runs, rollout workers), so
the peak of any one process says little. `TreeMemory` samples, every
`interval_s`, the sum of VmRSS over the root process and all its descendants
and keeps the maximum.

What the figure is: an upper bound on what the tree held resident at the
sampled moments. Pages shared between processes (a forked child's
copy-on-write pages, shared libraries) count once per process, so the sum
overstates; a spike shorter than the interval can be missed, so it may
understate a short burst. Off Linux (no /proc) it reports None.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Mapping

PROC = Path("/proc")


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


def _read_procs(proc: Path = PROC) -> tuple[dict[int, int], dict[int, int]]:
    """(pid -> parent pid, pid -> resident bytes) of every process readable now."""
    parents, rss = {}, {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            statm = (entry / "statm").read_text().split()
        except OSError:  # it ended while we looked
            continue
        pid = int(entry.name)
        # Fields after the command name (which may hold spaces) start at the last ')'.
        parents[pid] = int(stat[stat.rindex(")") + 2:].split()[1])
        rss[pid] = int(statm[1]) * page
    return parents, rss


def tree_rss(root: int, proc: Path = PROC) -> int | None:
    """Resident bytes of `root` and its descendants now; None without /proc."""
    if not (proc / str(root)).is_dir():
        return None
    parents, rss = _read_procs(proc)
    return sum(rss.get(pid, 0) for pid in tree_pids(parents, root))


class TreeMemory:
    """A background sampler of `tree_rss(root)`; `peak` is the largest sum seen
    since start (or the last `reset`), in bytes."""

    def __init__(self, root: int | None = None, interval_s: float = 0.5) -> None:
        self.root = root or os.getpid()
        self.interval_s = interval_s
        self.peak: int | None = None
        self.now: int | None = None
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

    def sample(self) -> int | None:
        value = tree_rss(self.root)
        with self._lock:
            self.now = value
            if value is not None and (self.peak is None or value > self.peak):
                self.peak = value
        return value

    def reset(self) -> int | None:
        """Start a new peak (a new stage); return the old one."""
        with self._lock:
            old, self.peak = self.peak, self.now
        return old

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()
