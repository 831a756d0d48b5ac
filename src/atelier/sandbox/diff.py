"""Git-style unified diffs of a workspace against its snapshot.

The output is what `git diff --binary` would print and what `git apply`
accepts: text hunks with three lines of context and "\\ No newline at end of
file" markers, file modes for new, deleted and executable files, symlinks as
mode 120000, and binary files as `GIT binary patch` literals (with the full
blob ids git needs to apply them).

Diffing costs what changed, not the size of the repository: the caller passes
the candidate paths (for an overlay, the files in its upper layers).
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import os
import stat
import zlib
from typing import Callable, Iterable

from atelier.sandbox.fsutil import Entry, open_dir, walk

ZERO_OID = "0" * 40
BINARY_SNIFF_BYTES = 8000
OPAQUE_XATTRS = ("user.overlay.opaque", "trusted.overlay.opaque")

EntryReader = Callable[[str], "Entry | None"]


def blob_id(data: bytes) -> str:
    """The object id git gives a blob with this content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_binary(data: bytes) -> bool:
    return b"\0" in data[:BINARY_SNIFF_BYTES]


def _quote(path: str) -> str:
    """Quote a path the way git does when it holds special characters."""
    if not any(c in path for c in '"\\\t\n') and path.isascii() and path.isprintable():
        return path
    out = []
    for byte in path.encode("utf-8", errors="surrogateescape"):
        ch = chr(byte)
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\n":
            out.append("\\n")
        elif 32 <= byte < 127:
            out.append(ch)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _range(start: int, length: int) -> str:
    # The `@@ -a,b +c,d @@` convention: an empty range names the line before it.
    if length == 1:
        return str(start + 1)
    if length == 0:
        return f"{start},0"
    return f"{start + 1},{length}"


def _lines_with_marker(lines: list[bytes], prefix: bytes) -> list[bytes]:
    out = []
    for line in lines:
        if line.endswith(b"\n"):
            out.append(prefix + line)
        else:
            out.append(prefix + line + b"\n\\ No newline at end of file\n")
    return out


def text_hunks(old: bytes, new: bytes, context: int = 3) -> bytes:
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    out: list[bytes] = []
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        first, last = group[0], group[-1]
        header = f"@@ -{_range(first[1], last[2] - first[1])} +{_range(first[3], last[4] - first[3])} @@\n"
        out.append(header.encode())
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out.extend(_lines_with_marker(a[i1:i2], b" "))
                continue
            out.extend(_lines_with_marker(a[i1:i2], b"-"))
            out.extend(_lines_with_marker(b[j1:j2], b"+"))
    return b"".join(out)


def _base85_lines(data: bytes) -> bytes:
    """git's binary-patch encoding: zlib data, 52 bytes a line, each line led
    by its length (A-Z for 1-26, a-z for 27-52)."""
    packed = zlib.compress(data, 9)
    out = []
    for i in range(0, len(packed), 52):
        chunk = packed[i : i + 52]
        n = len(chunk)
        lead = chr(ord("A") + n - 1) if n <= 26 else chr(ord("a") + n - 27)
        out.append(lead.encode() + base64.b85encode(chunk, pad=True) + b"\n")
    return b"".join(out)


def binary_patch(old: bytes, new: bytes) -> bytes:
    return (
        b"GIT binary patch\n"
        + b"literal %d\n" % len(new) + _base85_lines(new) + b"\n"
        + b"literal %d\n" % len(old) + _base85_lines(old) + b"\n"
    )


def file_diff(path: str, old: Entry | None, new: Entry | None) -> bytes:
    """The diff of one path; empty when nothing changed."""
    if old == new or (old is None and new is None):
        return b""
    if old is not None and new is not None and old.kind != new.kind:
        # A file that became a symlink or back: git writes (and `git apply`
        # only accepts) a deletion followed by a creation.
        return file_diff(path, old, None) + file_diff(path, None, new)
    q = _quote
    out = [f"diff --git {q('a/' + path)} {q('b/' + path)}\n".encode()]
    old_data = old.data if old else b""
    new_data = new.data if new else b""
    old_oid = blob_id(old_data) if old else ZERO_OID
    new_oid = blob_id(new_data) if new else ZERO_OID
    if old is None:
        assert new is not None
        out.append(f"new file mode {new.git_mode}\n".encode())
        out.append(f"index {old_oid}..{new_oid}\n".encode())
    elif new is None:
        out.append(f"deleted file mode {old.git_mode}\n".encode())
        out.append(f"index {old_oid}..{new_oid}\n".encode())
    elif old.git_mode != new.git_mode:
        out.append(f"old mode {old.git_mode}\nnew mode {new.git_mode}\n".encode())
        if old_data != new_data:
            out.append(f"index {old_oid}..{new_oid}\n".encode())
    else:
        out.append(f"index {old_oid}..{new_oid} {new.git_mode}\n".encode())
    if old_data == new_data:
        return b"".join(out)
    if is_binary(old_data) or is_binary(new_data):
        out.append(binary_patch(old_data, new_data))
        return b"".join(out)
    out.append(f"--- {q('a/' + path) if old else '/dev/null'}\n".encode())
    out.append(f"+++ {q('b/' + path) if new else '/dev/null'}\n".encode())
    out.append(text_hunks(old_data, new_data))
    return b"".join(out)


def unified_diff(paths: Iterable[str], old: EntryReader, new: EntryReader) -> str:
    """The whole diff over the candidate paths, in path order."""
    parts = [file_diff(p, old(p), new(p)) for p in sorted(set(paths))]
    return b"".join(parts).decode("utf-8", errors="surrogateescape")


def _is_opaque(dir_fd: int) -> bool:
    for name in OPAQUE_XATTRS:
        try:
            if os.getxattr(dir_fd, name) == b"y":
                return True
        except OSError:
            continue
    return False


def layer_changes(layer_fd: int) -> tuple[set[str], set[str]]:
    """What an overlay upper layer touches: (paths of files written or
    deleted, directories whose lower content is hidden: replaced or deleted).
    Every file of the snapshot under those directories may have changed."""
    files: set[str] = set()
    hidden_dirs: set[str] = set()
    for rel, entry, dir_fd in walk(layer_fd):
        if dir_fd is not None:
            if _is_opaque(dir_fd):
                hidden_dirs.add(rel)
            continue
        st = entry.stat(follow_symlinks=False)
        files.add(rel)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout
            hidden_dirs.add(rel)
    return files, hidden_dirs


def files_under(root_fd: int, dirs: Iterable[str]) -> set[str]:
    """Every file path of the tree at `root_fd` inside any of `dirs`."""
    found: set[str] = set()
    for d in dirs:
        try:
            with open_dir(root_fd, d) as fd:
                found.update(f"{d}/{rel}" for rel, _, sub in walk(fd) if sub is None)
        except (FileNotFoundError, NotADirectoryError, OSError):
            continue
    return found


def all_files(root_fd: int) -> set[str]:
    return {rel for rel, _, sub in walk(root_fd) if sub is None}
