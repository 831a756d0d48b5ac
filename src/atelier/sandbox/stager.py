"""Start bubblewrap for root without host root: stage the mounts, then drop.

Run as its own program by host root, just before bwrap:

    python -I -S stager.py UID GID COPY_INDEX N [SOURCE OWNER_UID OWNER_GID]*N -- BWRAP_ARGV...

UID/GID are the unprivileged host ids to become; each SOURCE is staged, and
when OWNER_UID/OWNER_GID are not ``-`` its files of that owner appear to
belong to UID/GID (an idmapped mount); BWRAP_ARGV[COPY_INDEX] is set to
``copy`` if an idmapped mount is refused (``-1``: none). It imports only
``os``, ``sys`` and ``ctypes`` (no ``json``, ``re`` or ``shutil``: every
sandbox that root creates pays for this interpreter's start, so it is kept
to one short start).

Why a program of its own: bwrap will run as the unprivileged uid, which cannot
reach sources under directories only root may enter (root's home, pytest's
``/tmp/pytest-of-root``, our 0700 runtime directory). So, still as root and
in a private mount namespace (the host's mount table never changes), it:

1. clones each source as a detached mount (``open_tree``); a source with an
   owner becomes an *idmapped* mount on which files of that owner appear to
   belong to the unprivileged uid, which is root inside the sandbox, so that
   overlayfs can copy them up and the sandbox can read files only their owner
   may read;
2. mounts a fresh tmpfs (mode 0755) over ``/tmp`` and attaches clone ``i`` at
   ``/tmp/<i>``, where the unprivileged uid can reach it (bwrap finds them
   there: it builds its new root on a tmpfs over ``/tmp`` and sees what lies
   beneath once it pivots);
3. drops every supplementary group, then gid and uid (``setres[ug]id``), and
   execs bwrap with the same pid, so the caller's view of the process tree is
   unchanged.

Exit code 90 with a message on stderr when a step fails.
"""

from __future__ import annotations

import ctypes
import os
import sys

SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442  # the same on every architecture
OPEN_TREE_CLONE = 1
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_IDMAP = 0x00100000
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
STAGE_DIR = "/tmp"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


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


def _mapping_userns(owner: tuple[int, int], uid: int, gid: int) -> int:
    """A descriptor of a user namespace mapping `owner` to (uid, gid): the
    idmapping of a mount. A child unshares it and waits while we write its
    maps; the namespace outlives the child through the descriptor."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(done_w)
        ok = _libc.unshare(CLONE_NEWUSER) == 0
        os.write(ready_w, b"1" if ok else b"0")
        os.read(done_r, 1)
        os._exit(0)
    os.close(ready_w)
    os.close(done_r)
    try:
        if os.read(ready_r, 1) != b"1":
            raise StageError("cannot create a user namespace for an idmapped mount")
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"{owner[0]} {uid} 1\n")
        with open(f"/proc/{pid}/gid_map", "w") as f:
            f.write(f"{owner[1]} {gid} 1\n")
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(ready_r)
        os.close(done_w)
        os.waitpid(pid, 0)  # reaped now: bwrap must be our only child


def _clone(source: str, owner: tuple[int, int] | None, uid: int, gid: int) -> tuple[int, bool]:
    """A detached copy of the mount at `source`; returns (fd, idmapped)."""
    fd = _check(_libc.syscall(SYS_OPEN_TREE, AT_FDCWD, source.encode(),
                              OPEN_TREE_CLONE | os.O_CLOEXEC | AT_RECURSIVE), f"open_tree {source}")
    if owner is None:
        return fd, False
    try:
        ns = _mapping_userns(owner, uid, gid)
    except (StageError, OSError) as exc:
        print(f"atelier-stager: no idmapped mount of {source}: {exc}", file=sys.stderr)
        return fd, False
    attr = _MountAttr(MOUNT_ATTR_IDMAP, 0, 0, ns)
    res = _libc.syscall(SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH | AT_RECURSIVE,
                        ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    err = ctypes.get_errno()
    os.close(ns)
    if res < 0:
        # Kernel < 5.12, or a filesystem without idmapping support.
        print(f"atelier-stager: no idmapped mount of {source}: {os.strerror(err)}", file=sys.stderr)
        return fd, False
    return fd, True


def parse_args(args: list[str]) -> tuple[int, int, int, list[tuple[str, tuple[int, int] | None]], list[str]]:
    """(uid, gid, copy_index, [(source, owner or None)], bwrap argv) from the
    command line described in the module docstring."""
    uid, gid, copy_index, n = (int(a) for a in args[:4])
    items = []
    for i in range(n):
        source, owner_uid, owner_gid = args[4 + 3 * i: 7 + 3 * i]
        items.append((source, None if owner_uid == "-" else (int(owner_uid), int(owner_gid))))
    rest = args[4 + 3 * n:]
    if not rest or rest[0] != "--" or len(rest) < 2:
        raise StageError("expected -- and bwrap's argv after the sources")
    return uid, gid, copy_index, items, rest[1:]


def stage(uid: int, gid: int, copy_index: int, items: list[tuple[str, tuple[int, int] | None]],
          argv: list[str]) -> list[str]:
    """Do steps 1 and 2; return bwrap's argv (its workspace mode set to
    `copy` when an idmapped mount was refused)."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
    argv = list(argv)
    clones = []
    for source, owner in items:
        fd, mapped = _clone(source, owner, uid, gid)
        if owner and not mapped and copy_index >= 0:
            argv[copy_index] = "copy"
        clones.append((fd, os.path.isdir(source)))
    _check(_libc.mount(b"tmpfs", STAGE_DIR.encode(), b"tmpfs", 0, b"mode=0755"), f"tmpfs on {STAGE_DIR}")
    for i, (fd, is_dir) in enumerate(clones):
        target = f"{STAGE_DIR}/{i}"
        if is_dir:
            os.mkdir(target)
        else:
            open(target, "w").close()
        _check(_libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
               f"move_mount to {target}")
        os.close(fd)
    return argv


def main() -> None:
    try:
        uid, gid, copy_index, items, argv = parse_args(sys.argv[1:])
        argv = stage(uid, gid, copy_index, items, argv)
        os.chdir("/")
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        # argv[0] is an absolute path (resolved by the caller): this
        # interpreter may no longer read its own library (root's home), so
        # nothing may be imported from here on.
        os.execv(argv[0], argv)
    except (StageError, OSError, ValueError) as exc:
        print(f"atelier-stager: {exc}", file=sys.stderr)
        sys.exit(90)


if __name__ == "__main__":
    main()
