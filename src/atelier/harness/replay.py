"""Gold patches replayed through the agent's own tools: the tool calls that make a
unified diff, as the assistant texts of a short episode (warm-start data, and
`scripted:gold`'s check of tasks, tools and grader).

`gold_patch_script(patch, read_original=...)` returns the assistant texts of
a short episode: one turn reading the lines around each change (a window of
`READ_MARGIN` lines, not whole files, so the replay fits the context budget
the policy itself has), one turn per file
(`edit_file` per hunk, `write_file` for new files, `delete_file`), then a
`submit`. With `read_original` (e.g. `sandbox.read_file`) every edit's
old_string is widened with surrounding lines until it is unique in the file
at that moment, so the replay obeys the unique-match rule; without it the
hunks are used as they are.

*Located* replays are the ones a policy can imitate on tasks it has never
seen. The gold replay above opens with `read_file` on a window around each
hunk: line numbers taken from the gold patch, which a policy cannot know on a
held-out task. A warm start on
those replays teaches the model to guess line numbers, which leads to wrong
paths, made-up ranges and broken calls, and no held-out edit at all
(docs/log/2026-12-03-demo-null-run.md).

A *located* replay starts from what the prompt gives (the function's name and
its file, `Fix the failing behaviour of `f` in pkg/mod.py`) and finds the
code with the tools, in three turns (the demo's turn budget) and a fourth to submit:

1. `grep` for the definition (`def f\\b` or `class f\\b`, the last part of a
   dotted name) in that file;
2. `read_file` from the definition's line over a fixed window (longer when
   the change lies further down), the line number taken from turn 1's
   output;
3. the gold patch's `edit_file` calls (old strings widened until unique, as
   the gold replay makes them, then trimmed of the indentation and line
   end old and new share where the rest stays unique: `trim_edit`);
4. `submit`. An episode cut at three turns is graded all the same: the
   edit is what counts, and the edit turn alone fits a 192-token turn.

Every step has a source the policy sees at test time: the name and path in
the prompt, the line number in the grep result, the old string in the read
result. Tasks whose prompt names no function or file, or whose patch spans
files, keep the gold replay.

`replay_script(prompt, patch, read_original, kind)` picks one of the two for a
task; `task_replay_script(task, kind)` reads the task's own snapshot.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import unidiff
from unidiff.constants import LINE_TYPE_NO_NEWLINE

from atelier.harness.errors import HarnessError
from atelier.harness.parsing import format_call
from atelier.tasks.schema import Task

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
            content = "".join(line for h in f.hunks for line in h.new)
            turns.append([("write_file", {"path": f.path, "content": content})])
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


# --- located replays ---------------------------------------------------------------

READ_WINDOW = 24
"""Lines a located replay reads from the definition on (more when the change lies below)."""
SUBMIT_MESSAGE = "Applied the change."
_TARGET = re.compile(r"`([A-Za-z_][\w.]*)`\s+in\s+(\S+\.py)\b")


def prompt_target(prompt: str) -> tuple[str, str] | None:
    """(name, path) the prompt names, e.g. ("log_errors.__exit__", "funcy/debug.py"); None if none (pure)."""
    found = _TARGET.search(prompt)
    return (found.group(1), found.group(2)) if found else None


def definition_line(source: str, name: str, before: int) -> tuple[str, int] | None:
    """The grep pattern for `name`'s definition and the 1-based line of the last
    match at or above line `before` (the definition that encloses the change); None if none (pure)."""
    last = name.rsplit(".", 1)[-1]
    for keyword in ("def", "class"):
        pattern = rf"{keyword} {last}\b"
        compiled = re.compile(rf"^\s*(async\s+)?{pattern}")
        lines = [i for i, text in enumerate(source.splitlines(), 1) if compiled.match(text) and i <= before]
        if lines:
            return pattern, lines[-1]
    return None


def changed_lines(hunks: list[Hunk]) -> tuple[int, int]:
    """First and last line (1-based, old file) that the hunks change, context lines left out (pure)."""
    def head(a: list[str], b: list[str]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    h0, h1 = hunks[0], hunks[-1]
    first = h0.old_start + head(h0.old, h0.new)
    tail = head(h1.old[::-1], h1.new[::-1])
    last = max(h1.old_start + len(h1.old) - tail - 1, h1.old_start + head(h1.old, h1.new))
    return first, last


def located_script(prompt: str, patch: str, read_original: Callable[[str], str],
                   window: int = READ_WINDOW) -> list[str] | None:
    """The assistant texts of a located replay (see the module docstring), or None
    when the task does not fit one (no name and file in the prompt, a patch that
    spans files or does not touch the named one, no definition found)."""
    target = prompt_target(prompt)
    files = parse_patch(patch)
    if target is None or len(files) != 1 or files[0].kind != "modify" or files[0].path != target[1]:
        return None
    name, path = target
    first, last = changed_lines(files[0].hunks)
    found = definition_line(read_original(path), name, first)
    if found is None:
        return None
    pattern, line = found
    end = max(line + window - 1, last + 2)
    edits = _trimmed(gold_patch_calls(patch, read_original)[-1], read_original(path))
    return [
        format_call("grep", {"pattern": pattern, "path": path}),
        format_call("read_file", {"path": path, "start_line": line, "end_line": end}),
        "\n".join(format_call(n, a) for n, a in edits),
        format_call("submit", {"message": SUBMIT_MESSAGE}),
    ]


def trim_edit(current: str, old: str, new: str) -> tuple[str, str]:
    """`old` and `new` without the indentation and line end they share, when
    the shorter `old` is still unique in `current` and the edit then makes the
    same file; else as given (pure).

    Why: after SFT on untrimmed replays the policy's held-out edits missed
    only by whitespace (indentation miscounted, a newline written as a
    literal backslash-n; docs/log/2026-12-03-located-replays.md). The
    trimmed old string is the code exactly as `read_file` shows it after the
    line number's tab, with nothing to count."""
    short_old, short_new = old.strip(), new.strip()
    if not short_old or short_old == short_new or current.count(short_old) != 1:
        return old, new
    if current.replace(short_old, short_new, 1) != current.replace(old, new, 1):
        return old, new
    return short_old, short_new


def _trimmed(calls: list[tuple[str, dict]], original: str) -> list[tuple[str, dict]]:
    current, out = original, []
    for name, args in calls:
        if name == "edit_file":
            old, new = trim_edit(current, args["old_string"], args["new_string"])
            current = current.replace(args["old_string"], args["new_string"], 1)
            args = {**args, "old_string": old, "new_string": new}
        out.append((name, args))
    return out


def replay_script(prompt: str, patch: str, read_original: Callable[[str], str], kind: str = "located") -> list[str]:
    """The replay of `kind` ("located" or "gold") for one task; a task that does not fit a
    located replay gets the gold one."""
    if kind == "located":
        script = located_script(prompt, patch, read_original)
        if script is not None:
            return script
    return gold_patch_script(patch, read_original=read_original, message=SUBMIT_MESSAGE)


def task_replay_script(task: Task, kind: str = "located") -> list[str]:
    """`replay_script` of `task`'s prompt and gold patch, reading its files from the task's snapshot."""
    def read_original(rel: str) -> str:
        return (task.snapshot / rel).read_text(encoding="utf-8")

    return replay_script(task.prompt, task.gold_patch, read_original, kind)
