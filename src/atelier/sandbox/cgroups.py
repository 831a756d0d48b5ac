"""Per-sandbox cgroups, wherever a cgroup hierarchy is writable.

Root can always write one. An ordinary user can where its own cgroup is
delegated to it (see `atelier.sandbox.memory` for the order of fallbacks):
under cgroup v2 a cgroup that holds processes cannot enable controllers for
its children, so where atelier's own cgroup is writable and delegated
(systemd's `Delegate=yes`, or a container's cgroup namespace root), atelier
moves its processes into a leaf child, `LEAF`, once, and then enables
`pids` and `memory` for the sandboxes' cgroups beside it. A writable cgroup
of a unit systemd manages without delegation is left alone. Elsewhere (the common case for a user)
nothing is created and the watchdog bounds memory. RLIMIT_NPROC already
counts the processes of each sandbox's own user namespace, for root too (its
sandboxes run as an unprivileged uid, see `rootmap`), so a fork bomb stops at
`max_processes`; the cgroup adds `pids.max` as a second wall and, where the
memory controller is there, `memory.max` / `memory.limit_in_bytes` for the
whole sandbox rather than per process.

Out of memory: with a memory cgroup, the kernel kills a process of the
sandbox when the sandbox as a whole passes `memory_mb` (swap is capped at 0
where the kernel lets us, so the limit is not softened by swapping), and
counts each kill: `oom_kill` in `memory.events` (v2) or `memory.oom_control`
(v1). `oom_kills()` reads that count; a backend compares it before and after
a command to say `ExecResult.oom_killed` exactly (any OOM kill of a process
of the sandbox while the command ran, its own or a background process's).
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import threading
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")


def _own_path(controller: str) -> str:
    """This process's cgroup path in the hierarchy of `controller` ("" = v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller == "" and controllers == "") or controller in controllers.split(","):
            return path.lstrip("/")
    return ""


def _writable(d: Path) -> bool:
    return d.is_dir() and os.access(d, os.W_OK)


LEAF = "atelier-leaf"
"""Where atelier's own processes go under cgroup v2 (see the module docstring)."""
_leaf_lock = threading.Lock()


def _candidate_parents(controller: str) -> list[Path]:
    """Cgroups of ours under which a child with `controller` can be made:
    v2 when the controller is (or can be) enabled for children, else a v1
    hierarchy."""
    out = []
    if (ROOT / "cgroup.controllers").exists():
        v2 = ROOT / _own_path("")
        if v2.name == LEAF:
            v2 = v2.parent
        if _writable(v2) and _enable_for_children(v2, controller):
            out.append(v2)
    if (ROOT / controller / "cgroup.procs").exists():
        out.append(ROOT / controller / _own_path(controller))
    return [p for p in out if _writable(p)]


def _delegated(d: Path) -> bool:
    """Whether the v2 cgroup `d` is handed to us to arrange: systemd marks
    a unit started with `Delegate=yes` (xattr `trusted.delegate` or, under
    a user's manager, `user.delegate`); the root of a cgroup namespace (a
    container's) is the tenant's."""
    if d == ROOT:
        return True
    for name in ("trusted.delegate", "user.delegate"):
        try:
            if os.getxattr(d, name).strip(b"\0") in (b"1", b"yes", b"true"):
                return True
        except OSError:
            continue
    return False


def _enable_for_children(d: Path, controller: str) -> bool:
    """Make `controller` available to new children of the v2 cgroup `d`:
    already so, or move every process of `d` into `d/LEAF` and enable it."""
    try:
        if controller in (d / "cgroup.subtree_control").read_text().split():
            return True
        if controller not in (d / "cgroup.controllers").read_text().split():
            return False  # not delegated to us
        if not _delegated(d):
            return False  # a unit systemd manages: its processes are not ours to move
        with _leaf_lock:
            try:  # the true root, or a cgroup without processes, needs no move
                (d / "cgroup.subtree_control").write_text(f"+{controller}")
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
            leaf = d / LEAF
            leaf.mkdir(exist_ok=True)
            # Repeat: a process may fork while we move the others.
            for _ in range(10):
                pids = (d / "cgroup.procs").read_text().split()
                if not pids:
                    break
                for pid in pids:
                    try:
                        (leaf / "cgroup.procs").write_text(pid)
                    except ProcessLookupError:
                        pass
            (d / "cgroup.subtree_control").write_text(f"+{controller}")
        log.info("cgroup v2: moved the processes of %s into %s to give sandboxes %s", d, LEAF, controller)
        return True
    except OSError as exc:
        log.debug("cgroup %s: cannot enable %s for children: %s", d, controller, exc)
        return False


class SandboxCgroup:
    """A cgroup in each available controller hierarchy; `wrap(argv)` returns an
    argv that joins them and then execs `argv`."""

    def __init__(self, max_processes: int, memory_bytes: int) -> None:
        self.dirs: list[Path] = []
        name = f"atelier-{uuid.uuid4().hex[:12]}"
        for controller, files in (
            ("pids", {"pids.max": str(max_processes)}),
            # memsw after limit_in_bytes: v1 refuses a memory+swap limit below the memory limit.
            ("memory", {"memory.max": str(memory_bytes), "memory.swap.max": "0",
                        "memory.limit_in_bytes": str(memory_bytes),
                        "memory.memsw.limit_in_bytes": str(memory_bytes)}),
        ):
            for parent in _candidate_parents(controller):
                d = parent / name
                try:
                    d.mkdir(exist_ok=True)
                    wrote = False
                    for fname, value in files.items():
                        if (d / fname).exists():
                            try:
                                (d / fname).write_text(value)
                            except OSError as exc:
                                if fname.startswith(("memory.swap", "memory.memsw")):
                                    log.debug("cgroup %s: swap not capped: %s", d, exc)
                                    continue  # a swap cap is a refinement, not the limit
                                raise
                            wrote = True
                    if wrote:
                        self.dirs.append(d)
                        break
                    d.rmdir()
                except OSError as exc:
                    log.debug("cgroup %s unusable: %s", d, exc)

    @property
    def limits_memory(self) -> bool:
        """Whether a memory cgroup bounds the whole sandbox (and counts OOM kills)."""
        return self._memory_dir() is not None

    def _memory_dir(self) -> Path | None:
        for d in self.dirs:
            if (d / "memory.events").exists() or (d / "memory.oom_control").exists():
                return d
        return None

    def oom_kills(self) -> int | None:
        """Processes of the sandbox the kernel's OOM killer has killed so far
        (for the sandbox's limit or the host's shortage alike); None without
        a memory cgroup (or a kernel older than 4.13, which does not count
        them)."""
        return self.oom_counts()[0]

    def oom_counts(self) -> tuple[int | None, int | None]:
        """(OOM kills, times the sandbox's limit was hit): v2's `oom_kill`
        and `oom` of memory.events; v1's `oom_kill`, and 1 where the peak
        since `reset_peak` reached the limit, else 0. A kill without a hit
        was the host's OOM killer's, not the limit's."""
        d = self._memory_dir()
        if d is None:
            return None, None
        try:
            if (d / "memory.events").exists():
                text = (d / "memory.events").read_text()
                return parse_oom_kills(text), parse_count(text, "oom")
            kills = parse_oom_kills((d / "memory.oom_control").read_text())
            # v1's failcnt stays 0 on recent kernels; its peak (reset by
            # `reset_peak` before each command) tells whether the limit was reached.
            peak = int((d / "memory.max_usage_in_bytes").read_text())
            return kills, int(peak >= int((d / "memory.limit_in_bytes").read_text()))
        except (OSError, ValueError):
            return None, None

    def reset_peak(self) -> None:
        """Start v1's peak usage afresh (before a command; see `oom_counts`)."""
        d = self._memory_dir()
        if d is not None and (d / "memory.max_usage_in_bytes").exists():
            try:
                (d / "memory.max_usage_in_bytes").write_text("0")
            except OSError:
                pass

    def wrap(self, argv: list[str]) -> list[str]:
        if not self.dirs:
            return argv
        joins = "; ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in self.dirs)
        return ["/bin/sh", "-c", f'{joins}; exec "$@"', "atelier-cgroup", *argv]

    def remove(self) -> None:
        """Remove the cgroups; those whose last tasks are still being reaped
        are removed by a background thread, so `close()` does not wait."""
        busy = []
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                busy.append(d)
        self.dirs = []
        if busy:
            threading.Thread(target=_remove_when_empty, args=(busy,), daemon=True).start()


def parse_oom_kills(text: str) -> int | None:
    """The `oom_kill` count of a `memory.events` or `memory.oom_control` file."""
    return parse_count(text, "oom_kill")


def parse_count(text: str, name: str) -> int | None:
    """The count `name` of a flat-keyed cgroup file (`key value` lines)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name and value.strip().isdigit():
            return int(value)
    return None


def _remove_when_empty(dirs: list[Path], attempts: int = 500) -> None:
    for d in dirs:
        for _ in range(attempts):
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.01)
        else:
            log.warning("cgroup %s still busy; left for the system to clean", d)
