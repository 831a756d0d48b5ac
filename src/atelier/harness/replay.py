"""Turn a unified diff into the tool calls that make it, for SFT warm-start
data: a gold patch replayed through the same tools the agent uses.

`gold_patch_script(patch, read_original=...)` returns the assistant texts of
a short episode: one turn reading the lines around each change (a window of
`READ_MARGIN` lines, not whole files, so the replay fits the context budget
the policy itself has), one turn per file
(`edit_file` per hunk, `write_file` for new files, `delete_file`), then a
`submit`. With `read_original` (e.g. `sandbox.read_file`) every edit's
old_string is widened with surrounding lines until it is unique in the file
at that moment, so the replay obeys the unique-match rule; without it the
hunks are used as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from atelier.harness.errors import HarnessError
from atelier.harness.parsing import format_call

MAX_WIDEN = 40
READ_MARGIN = 8   # lines shown around each hunk by the replay's read_file calls
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass
class Hunk:
    old_start: int
    old_count: int
    new_count: int
    old: list[str] = field(default_factory=list)   # lines with their newlines
    new: list[str] = field(default_factory=list)

    @property
    def open(self) -> bool:
        return len(self.old) < self.old_count or len(self.new) < self.new_count


@dataclass
class FilePatch:
    path: str
    kind: str = "modify"     # "modify" | "add" | "delete"
    hunks: list[Hunk] = field(default_factory=list)
    headers: int = 0         # "---"/"+++" lines seen


def _strip_prefix(name: str) -> str | None:
    name = name.split("\t")[0].strip()
    if name == "/dev/null":
        return None
    return name[2:] if name.startswith(("a/", "b/")) else name


def parse_patch(patch: str) -> list[FilePatch]:
    """Files and hunks of a git or plain unified diff; binary patches and renames are refused."""
    files: list[FilePatch] = []
    cur: FilePatch | None = None
    hunk: Hunk | None = None
    last_mark = ""
    for line in patch.splitlines(keepends=True):
        body = line.rstrip("\n")
        if hunk is not None and hunk.open and body[:1] in (" ", "-", "+", ""):
            mark, text = (body[:1] or " "), (line[1:] if body else "\n")
            if mark != "+":
                hunk.old.append(text)
            if mark != "-":
                hunk.new.append(text)
            last_mark = mark
        elif body.startswith("\\") and hunk is not None:
            # "\\ No newline at end of file" applies to the line just before it.
            if last_mark != "+" and hunk.old:
                hunk.old[-1] = hunk.old[-1].rstrip("\n")
            if last_mark != "-" and hunk.new:
                hunk.new[-1] = hunk.new[-1].rstrip("\n")
        elif body.startswith("diff --git "):
            cur, hunk = FilePatch(path=body.split(" b/", 1)[-1]), None
            files.append(cur)
        elif body.startswith(("GIT binary patch", "Binary files ")):
            raise HarnessError(f"the patch changes a binary file ({cur.path if cur else '?'})",
                               hint="tool calls can only replay text changes")
        elif body.startswith(("rename from ", "copy from ")):
            raise HarnessError("the patch renames or copies a file", hint="write it as a delete plus an add")
        elif body.startswith("new file mode") and cur is not None:
            cur.kind = "add"
        elif body.startswith("deleted file mode") and cur is not None:
            cur.kind = "delete"
        elif body.startswith("--- "):
            old = _strip_prefix(body[4:])
            if cur is None or cur.hunks or cur.headers:
                cur = FilePatch(path=old or "")
                files.append(cur)
            cur.headers, hunk = 1, None
            if old is None:
                cur.kind = "add"
        elif body.startswith("+++ ") and cur is not None:
            new = _strip_prefix(body[4:])
            cur.headers += 1
            if new is None:
                cur.kind = "delete"
            else:
                cur.path = new
        elif (m := _HUNK.match(body)) and cur is not None:
            count = lambda g: 1 if g is None else int(g)  # noqa: E731
            hunk = Hunk(int(m.group(1)), count(m.group(2)), count(m.group(4)))
            cur.hunks.append(hunk)
    return files


def _unique_edit(current: str, hunk: Hunk, index: int) -> tuple[str, str] | None:
    """(old, new) for the hunk at line `index` (0-based) of `current`: only the
    changed lines, widened by surrounding lines until old is unique."""
    lines = current.splitlines(keepends=True)
    if "".join(lines[index:index + len(hunk.old)]) != "".join(hunk.old):
        return None
    head = 0
    while head < min(len(hunk.old), len(hunk.new)) and hunk.old[head] == hunk.new[head]:
        head += 1
    tail = 0
    while (tail < min(len(hunk.old), len(hunk.new)) - head
           and hunk.old[len(hunk.old) - 1 - tail] == hunk.new[len(hunk.new) - 1 - tail]):
        tail += 1
    core_old = hunk.old[head:len(hunk.old) - tail]
    core_new = hunk.new[head:len(hunk.new) - tail]
    lo = index + head
    hi = lo + len(core_old)
    for extra in range(min(len(lines), MAX_WIDEN) + 1):   # fewest extra lines first, following lines first
        for before in range(extra + 1):
            start, end = lo - before, hi + extra - before
            if start < 0 or end > len(lines):
                continue
            old = "".join(lines[start:end])
            if old and current.count(old) == 1:
                return old, "".join(lines[start:lo]) + "".join(core_new) + "".join(lines[hi:end])
    return None


def gold_patch_calls(patch: str, read_original: Callable[[str], str] | None = None) -> list[list[tuple[str, dict]]]:
    """The calls of each turn (name, arguments) that replay `patch`."""
    files = parse_patch(patch)
    if not files:
        raise HarnessError("the patch changes no files", hint="pass a unified diff (git diff output)")
    turns: list[list[tuple[str, dict[str, Any]]]] = []
    reads = [("read_file", {"path": f.path, "start_line": lo, "end_line": hi})
             for f in files if f.kind == "modify" for lo, hi in _read_windows(f)]
    if reads:
        turns.append(reads)
    for f in files:
        if f.kind == "delete":
            turns.append([("delete_file", {"path": f.path})])
        elif f.kind == "add":
            turns.append([("write_file", {"path": f.path, "content": "".join(l for h in f.hunks for l in h.new)})])
        else:
            turns.append(_modify_calls(f, read_original))
    return turns


def _read_windows(f: FilePatch) -> list[tuple[int, int]]:
    """1-based inclusive line ranges covering every hunk of `f` with READ_MARGIN
    lines around it, overlapping ranges merged. The end may pass the file's last
    line; read_file clamps it."""
    windows: list[tuple[int, int]] = []
    for h in f.hunks:
        lo = max(1, h.old_start - READ_MARGIN)
        hi = h.old_start + max(h.old_count, 1) + READ_MARGIN
        if windows and lo <= windows[-1][1] + 1:
            windows[-1] = (windows[-1][0], max(windows[-1][1], hi))
        else:
            windows.append((lo, hi))
    return windows


def _modify_calls(f: FilePatch, read_original: Callable[[str], str] | None) -> list[tuple[str, dict]]:
    if read_original is None:
        calls = []
        for h in f.hunks:
            if not "".join(h.old):
                raise HarnessError(f"a hunk of {f.path} has no old lines to anchor an edit",
                                   hint="pass read_original so the edit can take surrounding lines")
            calls.append(("edit_file", {"path": f.path, "old_string": "".join(h.old), "new_string": "".join(h.new)}))
        return calls
    original = read_original(f.path)
    current, calls, shift = original, [], 0
    for h in f.hunks:
        index = max(h.old_start - 1, 0) + shift if h.old else h.old_start + shift
        edit = _unique_edit(current, h, index)
        if edit is None:  # no short unique anchor: write the whole file instead
            return [("write_file", {"path": f.path, "content": apply_hunks(original, f)})]
        old, new = edit
        current = current.replace(old, new, 1)
        calls.append(("edit_file", {"path": f.path, "old_string": old, "new_string": new}))
        shift += len(h.new) - len(h.old)
    return calls


def apply_hunks(original: str, f: FilePatch) -> str:
    """The file after the patch, hunks applied at their line numbers."""
    lines, out, at = original.splitlines(keepends=True), [], 0
    for h in f.hunks:
        start = max(h.old_start - 1, 0) if h.old else h.old_start
        if "".join(lines[start:start + len(h.old)]) != "".join(h.old):
            raise HarnessError(f"a hunk of {f.path} does not apply at line {h.old_start}",
                               hint="the patch must be made against the files read_original returns")
        out += lines[at:start] + h.new
        at = start + len(h.old)
    return "".join(out + lines[at:])


def gold_patch_script(patch: str, read_original: Callable[[str], str] | None = None,
                      message: str = "Applied the change.") -> list[str]:
    """Assistant texts (one per turn, ending with submit) that replay `patch` through the tools."""
    turns = gold_patch_calls(patch, read_original)
    texts = ["\n".join(format_call(name, args) for name, args in calls) for calls in turns]
    return [*texts, format_call("submit", {"message": message})]
