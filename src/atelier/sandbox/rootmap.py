"""Sandboxes started by root run as an unprivileged host uid, never uid 0.

An ordinary user's bwrap maps the sandbox's uid 0 to that user; for root it
would be host uid 0, which has no capabilities there but still wins the
kernel's owner checks (files only root may read, sysctls only root may write).
So when atelier runs as root, bwrap is started through `stager` as the host
uid/gid `SandboxConfig.root_maps_to` (an id no account should use): the
sandbox's uid 0 is that id, exactly as it would be the invoking user's.

Three things keep working that a plain drop of privileges would break:
- Sources under directories only root may enter (root's home, root's 0700
  runtime directory, pytest's temporary directories) are staged by root in a
  private mount namespace where the unprivileged id can reach them (`Stage`).
- The snapshot belongs to root, and overlayfs cannot copy up, inside a user
  namespace, a file whose owner is not mapped there: the snapshot is bound as
  an idmapped mount on which its owner appears as the unprivileged id. Where
  the kernel or filesystem refuses idmapped mounts, the workspace falls back
  to a copy (then files the snapshot's owner alone may read cannot be copied).
- The host reads and writes workspace files directly. Reads need nothing;
  files and directories the host creates there must belong to an id the
  sandbox maps, so writes run with that filesystem uid (`acting_as`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

from atelier.sandbox.base import SandboxUnavailable
from atelier.sandbox.stager import STAGE_DIR, StageError, stager


def running_as_root() -> bool:
    return os.geteuid() == 0


def check_mapped(host_id: int) -> None:
    """Refuse an id that this user namespace cannot switch to (root in a
    container whose map is a narrow range)."""
    for name in ("uid_map", "gid_map"):
        ranges = [tuple(map(int, line.split())) for line in Path(f"/proc/self/{name}").read_text().splitlines()]
        if not any(inside <= host_id < inside + count for inside, _, count in ranges):
            raise SandboxUnavailable(
                f"sandboxes started by root run as host id {host_id}, which this user namespace "
                f"does not map ({name}: {ranges})",
                hint="set `root_maps_to` in the sandbox config to an unused id inside the mapped range",
            )


class Stage:
    """Sources for bwrap (started by root) that the unprivileged id can reach.

    `source(path)` returns the path bwrap should bind from; `launch(argv)`
    returns the argv that drops to that id and execs bwrap; `spawn` starts
    it from the staging namespace and `release` detaches the staged mounts
    once bwrap has made its own (see `stager`). With `host_id=None` (not
    root) `source` and `launch` are the identity and `spawn` a plain Popen."""

    def __init__(self, host_id: int | None) -> None:
        self.host_id = host_id
        self._items: list[tuple[str, tuple[int, int] | None]] = []
        self._top: str | None = None
        self._copy_from_end: int | None = None
        # The directory under STAGE_DIR is named by the stager; argv holds a
        # placeholder until then.
        self._mark = f"{STAGE_DIR}/.stage-{id(self)}"

    def source(self, path: str | os.PathLike, *, idmap: bool = False) -> str:
        """Where bwrap finds `path`. With `idmap`, the files of `path`'s owner
        appear to belong to the sandbox's uid 0."""
        path = str(path)
        if self.host_id is None:
            return path
        owner = None
        if idmap:
            st = os.stat(path)
            owner = (st.st_uid, st.st_gid)
        self._items.append((path, owner))
        return f"{self._mark}/{len(self._items) - 1}"

    def launch(self, argv: list[str], copy_index: int | None = None) -> list[str]:
        """`argv` as the unprivileged id; `argv[copy_index]` becomes `copy`
        where an idmapped mount is refused."""
        if self.host_id is None:
            return argv
        program = shutil.which(argv[0])
        if program is None:
            raise SandboxUnavailable(f"{argv[0]} not found on PATH")
        drop = ["setpriv", f"--reuid={self.host_id}", f"--regid={self.host_id}", "--clear-groups", "--"]
        # Counted from the end: wrappers (the cgroup's) only prepend.
        self._copy_from_end = None if copy_index is None else len(argv) - copy_index
        return [*drop, program, *argv[1:]]

    def spawn(self, argv: list[str], **popen: Any) -> subprocess.Popen:
        if self.host_id is None:
            return subprocess.Popen(argv, **popen)
        st = stager()
        try:
            self._top, mapped_all = st.stage(self._items, self.host_id)
        except (StageError, OSError) as exc:
            raise SandboxUnavailable(f"cannot stage the sandbox's mounts for uid {self.host_id}: {exc}",
                                     hint="root's sandboxes need mount namespaces and open_tree "
                                     "(Linux >= 5.2)") from exc
        argv = [a.replace(self._mark, self._top) for a in argv]
        if not mapped_all and self._copy_from_end is not None:
            argv[len(argv) - self._copy_from_end] = "copy"
        try:
            return st.spawn(argv, **popen)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Detach the staged mounts (bwrap holds its own once it is ready)."""
        if self._top is not None:
            top, self._top = self._top, None
            stager().release(top)


_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def acting_as(host_id: int | None) -> Iterator[None]:
    """Run the block with filesystem uid and gid `host_id` (this thread only:
    the kernel keeps them per thread and glibc's setfsuid does not broadcast),
    so that what the host creates in a sandbox belongs to the sandbox. No-op
    for None."""
    if host_id is None:
        yield
        return
    old_gid = _libc.setfsgid(host_id)
    old_uid = _libc.setfsuid(host_id)
    try:
        yield
    finally:
        _libc.setfsuid(old_uid)
        _libc.setfsgid(old_gid)
