"""Start bubblewrap for root without host root: stage the mounts, then drop.

bwrap will run as an unprivileged uid (see `rootmap`), which cannot reach
sources under directories only root may enter (root's home, pytest's
``/tmp/pytest-of-root``, our 0700 runtime directory). So root stages them
first, in a private mount namespace (the host's mount table never changes):

1. each source is cloned as a detached mount (``open_tree``); a source with
   an owner becomes an *idmapped* mount on which files of that owner appear
   to belong to the unprivileged uid, which is root inside the sandbox, so
   that overlayfs can copy them up and the sandbox can read files only their
   owner may read;
2. clone ``i`` of sandbox ``n`` is attached at ``/tmp/<n>/<i>`` on a tmpfs
   (mode 0755) that covers ``/tmp`` in that namespace only, where the
   unprivileged uid can reach it (bwrap finds them there: it builds its new
   root on a tmpfs over ``/tmp`` and sees what lies beneath once it pivots);
3. bwrap is started from that namespace through ``setpriv``, which drops
   every supplementary group, then gid and uid, and execs bwrap with the
   same pid, so the caller's view of the process tree is unchanged;
4. once bwrap has made its own mounts (the holder says "ready"), the clones
   are detached again.

Where it runs: in one thread of the atelier process (`Stager`) that has
unshared its mount namespace (a namespace is per thread; a process started
from that thread inherits it). Earlier this was a Python program of its own,
started for every sandbox: one interpreter start per sandbox, which made
root's sandboxes much slower to create than a user's
(docs/log/2026-12-02-sandboxes.md). Now a sandbox costs root the mounts and one
``setpriv`` exec. The user namespace that an idmapped mount needs (a mapping
of the owner to the unprivileged id) is made once per owner, by an
``unshare`` child, and kept for the process's life.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import logging
import os
import stat
import subprocess
import threading
from typing import Any, Callable, TypeVar

SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # the same on every architecture
OPEN_TREE_CLONE = 1
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_IDMAP = 0x00100000
CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
STAGE_DIR = "/tmp"

log = logging.getLogger(__name__)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
T = TypeVar("T")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class StageError(Exception):
    pass


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise StageError(f"{what}: {os.strerror(err)}")
    return result


def _mapping_userns(owner: tuple[int, int], host_id: int) -> int:
    """A descriptor of a user namespace mapping `owner` to `host_id`: the
    idmapping of a mount. An `unshare` child makes it and waits while we
    write its maps; the namespace outlives the child through the descriptor."""
    child = subprocess.Popen(["unshare", "--user", "--", "sh", "-c", "echo; read _"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout is not None
        if child.stdout.readline() != b"\n":
            raise StageError(f"cannot create a user namespace for an idmapped mount: "
                             f"{child.stderr.read().decode(errors='replace').strip()}")  # type: ignore[union-attr]
        with open(f"/proc/{child.pid}/uid_map", "w") as f:
            f.write(f"{owner[0]} {host_id} 1\n")
        with open(f"/proc/{child.pid}/gid_map", "w") as f:
            f.write(f"{owner[1]} {host_id} 1\n")
        return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        child.communicate(b"\n")


class Stager:
    """The staging namespace: one thread that owns it and does every step
    there (`run`); `stage`, `spawn` and `release` are its three jobs."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "atelier-stager", initializer=self._enter)
        self._names = itertools.count()
        self._userns: dict[tuple[int, int, int], int] = {}
        self._under_stage_dir = -1

    def _enter(self) -> None:
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        # Sources under /tmp stay reachable through what lay there before the cover.
        self._under_stage_dir = os.open(STAGE_DIR, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        _check(_libc.mount(b"tmpfs", STAGE_DIR.encode(), b"tmpfs", 0, b"mode=0755"), f"tmpfs on {STAGE_DIR}")

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return self._pool.submit(fn, *args).result()
        except concurrent.futures.BrokenExecutor as exc:
            raise StageError(f"cannot make a private mount namespace: {exc.__cause__ or exc}") from exc

    def _locate(self, source: str) -> tuple[int, str]:
        """(dirfd, path) that reaches `source` from inside the namespace."""
        if source == STAGE_DIR or source.startswith(STAGE_DIR + "/"):
            return self._under_stage_dir, source[len(STAGE_DIR) + 1:] or "."
        return AT_FDCWD, source

    def _clone(self, source: str, owner: tuple[int, int] | None, host_id: int) -> tuple[int, bool]:
        """A detached copy of the mount at `source`; returns (fd, idmapped)."""
        dirfd, path = self._locate(source)
        # The stage's own tmpfs sits on STAGE_DIR, with every staged sandbox's clones on it: a
        # recursive clone of STAGE_DIR would take those in place of the directory's files (and
        # could not be detached). A snapshot holds no mount points (`atelier.sandbox.snapshot`),
        # so one clone of the directory alone is the whole of it.
        recursive = 0 if source == STAGE_DIR else AT_RECURSIVE
        fd = _check(_libc.syscall(SYS_OPEN_TREE, dirfd, path.encode(),
                                  OPEN_TREE_CLONE | os.O_CLOEXEC | recursive), f"open_tree {source}")
        if owner is None:
            return fd, False
        key = (*owner, host_id)
        try:
            if key not in self._userns:
                self._userns[key] = _mapping_userns(owner, host_id)
        except (StageError, OSError) as exc:
            log.warning("no idmapped mount of %s (the workspace is a copy): %s", source, exc)
            return fd, False
        attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, self._userns[key])
        res = _libc.syscall(SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH | recursive,
                            ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
        # Refused on Linux < 5.12, or a filesystem without idmapping support.
        return fd, res >= 0

    def _stage(self, items: list[tuple[str, tuple[int, int] | None]], host_id: int) -> tuple[str, bool]:
        """Steps 1 and 2; returns (the sandbox's directory, whether every
        requested idmapped mount was made)."""
        top = f"{STAGE_DIR}/{next(self._names)}"
        os.mkdir(top, 0o755)
        mapped_all = True
        try:
            for i, (source, owner) in enumerate(items):
                fd, mapped = self._clone(source, owner, host_id)
                try:
                    mapped_all &= mapped or owner is None
                    dirfd, path = self._locate(source)
                    target = f"{top}/{i}"
                    if stat.S_ISDIR(os.stat(path, dir_fd=None if dirfd == AT_FDCWD else dirfd).st_mode):
                        os.mkdir(target)
                    else:
                        open(target, "w").close()
                    _check(_libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(),
                                         MOVE_MOUNT_F_EMPTY_PATH), f"move_mount to {target}")
                finally:
                    os.close(fd)
        except BaseException:
            self._release(top)
            raise
        return top, mapped_all

    def _release(self, top: str) -> None:
        """Step 4: detach the clones of one sandbox and remove its directory."""
        for name in os.listdir(top):
            _libc.umount2(f"{top}/{name}".encode(), MNT_DETACH)
            try:
                os.rmdir(f"{top}/{name}")
            except NotADirectoryError:
                os.unlink(f"{top}/{name}")
        os.rmdir(top)

    def stage(self, items: list[tuple[str, tuple[int, int] | None]], host_id: int) -> tuple[str, bool]:
        return self.run(self._stage, items, host_id)

    def spawn(self, argv: list[str], **popen: Any) -> subprocess.Popen:
        """Step 3: start `argv` (which drops its ids) inside the namespace."""
        return self.run(lambda: subprocess.Popen(argv, cwd="/", **popen))

    def release(self, top: str) -> None:
        self.run(self._release, top)


_stager: tuple[int, Stager] | None = None
_lock = threading.Lock()


def stager() -> Stager:
    """This process's `Stager` (a forked child makes its own)."""
    global _stager
    with _lock:
        if _stager is None or _stager[0] != os.getpid():
            _stager = (os.getpid(), Stager())
        return _stager[1]
