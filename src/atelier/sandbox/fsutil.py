"""File access beneath a root directory that never follows a symlink out of it.

The host reads and writes sandbox files directly (no process start), through a
directory that the sandbox controls. A model can plant symlinks there
(`notes -> /home/me/.ssh`), so every path component is opened relative to its
parent's descriptor with O_NOFOLLOW: a symlink anywhere on the path is an
error, never a way out.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from typing import Iterator

from atelier.sandbox.base import SandboxLimitExceeded, SandboxPathError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Entry:
    """What diffing needs to know about one path: kind, mode and content."""

    kind: str  # "file" or "symlink"
    executable: bool
    data: bytes

    @property
    def git_mode(self) -> str:
        if self.kind == "symlink":
            return "120000"
        return "100755" if self.executable else "100644"


@contextlib.contextmanager
def open_dir(root_fd: int, relpath: str, *, create: bool = False) -> Iterator[int]:
    """Yield a descriptor of directory `relpath` beneath `root_fd`."""
    fd = os.dup(root_fd)
    try:
        for part in [p for p in relpath.split("/") if p]:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def _split(relpath: str) -> tuple[str, str]:
    parent, _, name = relpath.rpartition("/")
    return parent, name


def read_beneath(root_fd: int, relpath: str) -> bytes:
    parent, name = _split(relpath)
    with open_dir(root_fd, parent) as dfd:
        # O_NONBLOCK: opening a FIFO the sandbox planted must not block the host.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise IsADirectoryError(errno.EISDIR, "not a regular file", relpath)
            return f.read()


def write_beneath(root_fd: int, relpath: str, data: bytes, mode: int = 0o644) -> None:
    """Write through a temporary file and a rename, so a failed write (the disk
    cap) leaves the old file as it was, never half a file."""
    parent, name = _split(relpath)
    with open_dir(root_fd, parent, create=True) as dfd:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISREG(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, "not a regular file", relpath)
            mode = stat.S_IMODE(st.st_mode)
        tmp = f".{name}.atelier-{os.urandom(4).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise


def entry_beneath(root_fd: int, relpath: str) -> Entry | None:
    """The file or symlink at `relpath`, or None if there is none (a directory
    counts as none: diffs are about files)."""
    parent, name = _split(relpath)
    try:
        with open_dir(root_fd, parent) as dfd:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                return Entry("symlink", False, os.fsencode(os.readlink(name, dir_fd=dfd)))
            if not stat.S_ISREG(st.st_mode):
                return None
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    return None
                return Entry("file", bool(st.st_mode & 0o100), f.read())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:
        raise SandboxPathError(f"cannot read {relpath!r} to compare it: permission denied",
                               hint="a file only its owner may read cannot be diffed by another user") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a parent component is a symlink
            return None
        raise


def walk(root_fd: int, prefix: str = "") -> Iterator[tuple[str, os.DirEntry, int | None]]:
    """Every entry beneath `root_fd` as (relative path, entry, directory fd or
    None), parents before children, never following symlinks. A directory's fd
    is valid only until the walk moves on.

    Iterative, so a tree of any depth is walked; it holds one descriptor per
    level, and a tree deeper than the open-files limit is refused."""
    stack: list[tuple[int | None, Iterator[os.DirEntry], str]] = [(None, _sorted_entries(root_fd), prefix)]
    try:
        while stack:
            fd, entries, at = stack[-1]
            entry = next(entries, None)
            if entry is None:
                stack.pop()
                if fd is not None:
                    os.close(fd)
                continue
            rel = f"{at}{entry.name}"
            if not entry.is_dir(follow_symlinks=False):
                yield rel, entry, None
                continue
            try:
                sub = os.open(entry.name, _DIR_FLAGS, dir_fd=root_fd if fd is None else fd)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    raise SandboxLimitExceeded(
                        f"the tree is nested {len(stack)} directories deep at {rel!r}, past the open-files limit",
                        hint="raise the limit (ulimit -n) or make the tree shallower") from None
                continue
            stack.append((sub, _sorted_entries(sub), rel + "/"))
            yield rel, entry, sub
    finally:
        for fd, _, _ in stack:
            if fd is not None:
                os.close(fd)


def _sorted_entries(dir_fd: int) -> Iterator[os.DirEntry]:
    with os.scandir(dir_fd) as it:
        return iter(sorted(it, key=lambda e: e.name))


def remove_tree(path: str | os.PathLike) -> None:
    """Delete a directory tree, ignoring errors, at any depth: shutil.rmtree recurses once per
    level (before Python 3.12) and a tree deeper than the interpreter's recursion limit needs
    `rm -rf`."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        subprocess.run(["rm", "-rf", "--", os.fspath(path)], capture_output=True)
