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

import ast
from dataclasses import dataclass, field
from typing import Any, Callable

import unidiff
from unidiff.constants import LINE_TYPE_NO_NEWLINE

from atelier.harness.errors import HarnessError
from atelier.harness.parsing import format_call

MAX_WIDEN = 40
READ_MARGIN = 8   # lines shown around each hunk by the replay's read_file calls


@dataclass
class Hunk:
    old_start: int
    old_count: int
    new_count: int
    old: list[str] = field(default_factory=list)   # lines with their newlines
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    path: str
    kind: str = "modify"     # "modify" | "add" | "delete"
    hunks: list[Hunk] = field(default_factory=list)


def _unquote(path: str) -> str:
    """A path git wrote in C quotes (special characters, octal UTF-8 bytes) as it is on disk."""
    if len(path) >= 2 and path[0] == path[-1] == '"':
        return ast.literal_eval("b" + path).decode("utf-8", errors="surrogateescape")
    return path


def _moved(f: unidiff.PatchedFile) -> bool:
    """A copy (or a rename unidiff did not flag): old and new paths differ, neither /dev/null."""
    names = [_unquote(name) for name in (f.source_file, f.target_file)]
    if "/dev/null" in names:
        return False
    return names[0].removeprefix("a/") != names[1].removeprefix("b/")


def _hunk(h: unidiff.Hunk) -> Hunk:
    out = Hunk(h.source_start, h.source_length, h.target_length)
    last = ""
    for line in h:
        if line.line_type == LINE_TYPE_NO_NEWLINE:  # applies to the line just before it
            if last != "+" and out.old:
                out.old[-1] = out.old[-1].rstrip("\n")
            if last != "-" and out.new:
                out.new[-1] = out.new[-1].rstrip("\n")
            continue
        if line.line_type != "+":
            out.old.append(line.value)
        if line.line_type != "-":
            out.new.append(line.value)
        last = line.line_type
    return out


def parse_patch(patch: str) -> list[FilePatch]:
    """Files and hunks of a git or plain unified diff (parsed by `unidiff`);
    binary patches, renames and copies are refused."""
    try:
        files = unidiff.PatchSet(patch)
    except unidiff.UnidiffParseError as exc:
        raise HarnessError(f"the patch cannot be parsed: {exc}", hint="pass a unified diff") from exc
    out = []
    for f in files:
        if f.is_binary_file:
            raise HarnessError(f"the patch changes a binary file ({_unquote(f.path)})",
                               hint="tool calls can only replay text changes")
        if f.is_rename or _moved(f):
            raise HarnessError("the patch renames or copies a file", hint="write it as a delete plus an add")
        kind = "add" if f.is_added_file else "delete" if f.is_removed_file else "modify"
        out.append(FilePatch(_unquote(f.path), kind, [_hunk(h) for h in f]))
    return out


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
