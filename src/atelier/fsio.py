"""Crash-consistent file writes, and named crash points to test them.

The rule for everything a run writes (training metrics, ledger, trajectories
and checkpoints; evaluation records; the pipeline's stages; task-build
caches): what a committed step owns is written before its commit point, and
what lies beyond the last commit is truncated or rebuilt on resume. A commit
point is one atomic act: a rename (`atomic_write`, `atomic_dir`) or one
fsynced line appended to a log (`append_line`). Each writer's docstring names
its commit point. The tools:

- `atomic_write(path, data)`: the write-then-rename pattern, once. The data
  goes to a uniquely named temporary file in the same directory (so two
  writers never share one), is flushed and fsynced, then renamed over `path`;
  a reader, or a process resumed after `kill -9`, sees the old file or the new
  one, never half of one. `append_line` adds one fsynced line to a log whose
  last line is a commit record (`metrics.jsonl`).
- `atomic_dir(path)`: the same for a directory (a checkpoint, a pulled
  model): built in a temporary sibling, its files fsynced, renamed to `path`
  when the block ends without an exception. Temporaries a killed process
  left are removed the next time the same path is written.
- `crash_point(name)`: a named place where a test can kill the process.
  `ATELIER_CRASH_AT=name:n` sends SIGKILL to this process the n-th time the
  point is reached (n defaults to 1); unset, a crash point costs one dict
  lookup. `name:n@r` kills only trainer rank r (the process whose RANK is r;
  a process without RANK is rank 0), so a test can kill one rank of several
  mid-step while the others run on into their next collective. Tests crash
  at every point in turn and check that the resumed run equals an
  uninterrupted one.
- `told_when_disk_full(path, what)`: a write that fails because the disk
  (or the user's quota) is full raises `DiskFullError`, which names the
  path, the free space and the fix, instead of the writer's own error (for
  torch's checkpoint writer, an "unexpected pos" traceback). `atomic_write`
  and `atomic_dir` use it, so every checkpoint, model and record does.
- `owned_temp_dir(prefix)`: a scratch directory in the system's temporary
  directory that records the process that made it; making one first removes
  those of the same prefix whose process has ended, which a process killed
  before it could clean up leaves behind (a vLLM engine's weight updates).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from atelier.errors import AtelierError

CRASH_ENV = "ATELIER_CRASH_AT"


def atomic_write(path: str | os.PathLike, data: bytes | str, *, fsync: bool = True) -> Path:
    """Replace `path` with `data` (str is written as UTF-8) all at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with told_when_disk_full(path, f"writing {path.name}"), os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


@contextmanager
def atomic_dir(path: str | os.PathLike, *, fsync: bool = True) -> Iterator[Path]:
    """Yield an empty temporary directory beside `path`; when the block ends
    without an exception, fsync its files and rename it to `path` (a
    directory already there is replaced). On an exception it is removed.

    One writer per `path` (the temporaries of a killed writer, named
    `.<name>.*.tmp`, are removed first). The temporary's name starts with a
    dot, so a glob for finished directories (`step-*`) never sees it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        # Told inside the cleanup: once the partial files are removed, the disk no longer looks full.
        with told_when_disk_full(path, f"writing {path.name}"):
            os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp's 0700 would outlive the rename
            yield tmp
            if fsync:
                _fsync_tree(tmp)
            if path.exists():  # a stale copy (a resumed run writes it again): moved aside, then removed
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
                os.replace(path, old / "old")
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
            if fsync:
                _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, so a rename of `root`
    never outlives its contents on power loss."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            if os.path.islink(os.path.join(dirpath, name)):
                continue
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskFullError(AtelierError):
    """A write failed because the filesystem it went to (or the user's quota there) is full."""


# Under this much free space, a writer's failure is taken for a full disk even
# when its error does not say so: torch.save reports ENOSPC as
# "[enforce fail at inline_container.cc] unexpected pos", without an errno.
LOW_FREE_BYTES = 64 << 20
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def is_disk_full(exc: BaseException, path: str | os.PathLike) -> bool:
    """Whether `exc`, raised while writing under `path`, is a full disk or quota: an OSError
    with ENOSPC or EDQUOT (itself or a cause), a library error whose text says so (safetensors),
    or a write error (OSError, RuntimeError) while the filesystem has almost no space left."""
    seen: BaseException | None = exc
    visited: set[int] = set()
    while seen is not None and id(seen) not in visited:   # a chain can loop back on itself
        visited.add(id(seen))
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS:
            return True
        if any(words in str(seen) for words in _FULL_WORDS):
            return True
        seen = seen.__cause__ or seen.__context__
    if not isinstance(exc, (OSError, RuntimeError)):
        return False
    free = free_bytes(path)
    return free is not None and free < LOW_FREE_BYTES


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes (for this user) on the filesystem holding `path` or its nearest existing parent."""
    path = Path(path).absolute()
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


@contextmanager
def told_when_disk_full(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Raise `DiskFullError` (naming `what`, `path`, the free space and the fix) in place of an
    error from the block that `is_disk_full` recognises; any other error passes unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        if not is_disk_full(exc, path):
            raise
        free = free_bytes(path)
        left = f"{free / 2**20:.1f} MiB free" if free is not None else "free space unknown"
        raise DiskFullError(
            f"the disk is full: {what} at {path} failed ({left} there; {type(exc).__name__}: {exc})",
            hint=f"free space on the disk holding {Path(path).absolute().parent} (old run directories and "
                 "their checkpoints are the usual culprits), then run the same command again to continue: "
                 "what was already written is kept") from exc


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append `line` (a newline is added) and fsync: once this returns, the
    line survives `kill -9` and, with the disk's cooperation, power loss."""
    with told_when_disk_full(path, f"appending to {Path(path).name}"), open(path, "a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


def _read_umask() -> int:
    """This process's umask, read without changing it (os.umask would, for
    a moment, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


_UMASK = _read_umask()


_hits: dict[str, int] = {}
_target: tuple[str, int, int | None] | None | bool = False  # False: not read yet


def crash_point(name: str) -> None:
    """SIGKILL this process here if `ATELIER_CRASH_AT` names this point (and this
    process's rank, when it names one) and this is its n-th visit; otherwise do nothing."""
    global _target
    if _target is False:
        _target = parse_crash_at(os.environ.get(CRASH_ENV, ""))
    if _target is None or _target[0] != name:
        return
    if _target[2] is not None and _target[2] != int(os.environ.get("RANK", "0")):
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == _target[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def parse_crash_at(value: str) -> tuple[str, int, int | None] | None:
    """`name`, `name:n` or `name:n@rank` -> (name, n, rank or None); empty -> None."""
    value = value.strip()
    if not value:
        return None
    value, at, rank = value.partition("@")
    if at and not rank.isdigit():
        raise ValueError(f"{CRASH_ENV}=...@{rank!r}: the rank must be a number")
    name, _, count = value.partition(":")
    if count and (not count.isdigit() or int(count) < 1):
        raise ValueError(f"{CRASH_ENV}={value!r}: expected name, name:n or name:n@rank with n >= 1")
    return name, int(count) if count else 1, int(rank) if at else None


OWNER_FILE = ".atelier-owner"
"""In an `owned_temp_dir`: the pid and start time of the process that made it."""


def proc_stat_fields(stat: str) -> list[str]:
    """The fields of a /proc/PID/stat text after the command name, which may hold spaces and
    parentheses (so they start after the last ')'): index 0 is proc(5)'s field 3, the state."""
    return stat[stat.rindex(")") + 2:].split()


def _process_start(pid: int) -> str | None:
    """The start time of `pid` (clock ticks since boot; an identity that survives pid reuse),
    "" where /proc cannot tell, None when no such process runs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return proc_stat_fields(stat)[19]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def owned_temp_dir(prefix: str, parent: str | os.PathLike | None = None) -> Path:
    """A new directory `<tmp>/<prefix>XXXX` recording this process as its owner; first removes
    each `<prefix>*` directory whose recorded owner has ended (a directory recording none
    is not ours and stays)."""
    base = Path(parent or tempfile.gettempdir())
    for old in base.glob(f"{prefix}*"):
        try:
            pid, start = (old / OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue
        now = _process_start(int(pid))
        if now is None or (now and now != start):   # ended, or the pid now names another process
            shutil.rmtree(old, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    (path / OWNER_FILE).write_text(f"{os.getpid()} {_process_start(os.getpid()) or 0}\n")
    return path
