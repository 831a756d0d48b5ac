"""What a snapshot directory must be to become a workspace, and what a failed copy of one means.

A snapshot is one directory tree on one filesystem. `check_snapshot(path)`
refuses, with `SnapshotUnusable` naming the problem, a directory that is not:

- one that holds mount points (`/`, `/dev`, a checkout with a volume mounted
  inside): an overlay's lower layer does not cross them, so the sandbox would
  see the empty directories beneath them while the host sees what is mounted
  there, and a copy would take in whole other filesystems;
- one on a kernel pseudo-filesystem (`/proc`, `/sys`, cgroups, ...): its
  files are views of the running kernel, not a tree to work in.

Everything else works: sockets and FIFOs are kept as they are (the host never
opens them: diffs compare regular files and symlinks only), device files and
files only their owner may read stay in the overlay as on the host, unreadable
inside as outside, and a tree of any size or depth costs the overlay nothing.

Where the workspace is a copy (`workspace = "copy"`, or the overlay fallback),
some files cannot be copied by the sandbox's unprivileged root: device files
(creating one needs a privilege no user namespace grants), files the user
cannot read, and more bytes than the sandbox's `disk_mb`. `copy_failure`
turns `cp`'s complaint into `SnapshotUnusable` naming those files.
"""

from __future__ import annotations

import re
from pathlib import Path

from atelier.sandbox.base import SnapshotUnusable

PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "bpf",
    "configfs", "fusectl", "mqueue", "pstore", "hugetlbfs", "binfmt_misc", "autofs", "efivarfs", "nsfs",
})
MOUNTINFO = "/proc/self/mountinfo"
SHOWN = 5  # mount points or files named in a message; the rest are counted


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash in a path as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts(mountinfo: str | None = None) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount this process sees, in mount order."""
    text = Path(MOUNTINFO).read_text() if mountinfo is None else mountinfo
    out = []
    for line in text.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        out.append((_unescape(fields[4]), after[0] if after else ""))
    return out


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def check_snapshot(path: Path, mountinfo: str | None = None) -> None:
    """Refuse a resolved snapshot directory that holds mount points or lies on a pseudo-filesystem
    (see the module docstring)."""
    table = mounts(mountinfo)
    root = str(path).rstrip("/") or "/"
    inside = sorted({mp for mp, _ in table if mp != root and (root == "/" or mp.startswith(root + "/"))})
    if inside:
        raise SnapshotUnusable(
            f"snapshot {root} holds mount points ({_listed(inside)}): a sandbox's view of it would not be "
            "the host's", hint="use a directory on one filesystem: copy the tree first "
                               "(cp -a --one-file-system SRC DEST), or unmount what is mounted inside")
    owner = max((mp for mp, _ in table if root == mp or root.startswith(mp.rstrip("/") + "/")), key=len,
                default=None)
    kind = next((fs for mp, fs in reversed(table) if mp == owner), "")
    if kind in PSEUDO_FILESYSTEMS:
        raise SnapshotUnusable(f"snapshot {root} is on a {kind} filesystem, a view of the running kernel",
                               hint="use a directory of files (a repository checkout)")


_CP_FILE = re.compile(r"^cp: (?:cannot (?:create special file|open|create regular file|access|stat)|error "
                      r"(?:writing|reading)) '(.*?)'(?: for reading)?: (.*)$")


def copied_from(*dirs: str) -> re.Pattern[str]:
    """What `copy_failure` cuts from the paths of a `cp -a SRC/. DEST` run over these directories."""
    return re.compile("^(?:" + "|".join(re.escape(d.rstrip("/")) for d in dirs) + r")/(?:\./)?")


def copy_failure(snapshot: Path, stderr: str, disk_mb: int, where: re.Pattern[str]) -> SnapshotUnusable:
    """`SnapshotUnusable` for a workspace copy that `cp` could not make, naming the files and why.

    `where` matches the start of the paths `cp` names (the directories it read from and wrote to),
    which is cut to leave the path in the snapshot."""
    problems: dict[str, list[str]] = {}
    other = []
    for line in stderr.strip().splitlines():
        match = _CP_FILE.match(line)
        if not match:
            other.append(line)
            continue
        name = where.sub("", match.group(1))
        problems.setdefault(match.group(2), []).append(name.removeprefix("./") or ".")
    hints = {"Operation not permitted": "device files cannot be made in a sandbox: remove them, or use "
                                        "workspace = \"overlay\"",
             "Permission denied": "make the files readable by you, or remove them",
             "No space left on device": f"the copy needs more than disk_mb = {disk_mb}: raise disk_mb, or use "
                                        "workspace = \"overlay\""}
    parts = [f"{why}: {_listed(sorted(set(names)))}" for why, names in problems.items()]
    message = f"snapshot {snapshot} cannot be copied into a sandbox ({'; '.join(parts + other[:2]) or 'cp failed'})"
    return SnapshotUnusable(message, hint="; ".join(hints[w] for w in problems if w in hints)
                            or "check that every file of the snapshot can be read and copied")
