"""`edit_file`: replace one exact, unique piece of text.

The unique-match rule keeps edits unambiguous. When it fails the message
says exactly why and what to do (docs/pitfalls.md: edit tools that only
said "no match" left agents looping): for zero matches, the most similar passage of
the file with its line numbers and a similarity figure, and whether only
whitespace differs; for several matches, how many and on which lines.
"""

from __future__ import annotations

import difflib

from atelier.harness.errors import ToolError
from atelier.harness.tools.base import Tool, ToolContext, obj, rel
from atelier.harness.tools.files import numbered, read_text

SNIPPET_CONTEXT = 3


def line_of(content: str, offset: int) -> int:
    return content.count("\n", 0, offset) + 1


def nearest_match(content: str, needle: str) -> tuple[float, int, int]:
    """(similarity 0..1, first line, last line) of the window of the file's
    lines most similar to `needle`; windows have the needle's line count."""
    lines = content.splitlines()
    size = max(1, len(needle.splitlines()))
    best = (0.0, 1, min(size, len(lines)))
    matcher = difflib.SequenceMatcher(autojunk=False)
    matcher.set_seq2(needle)
    for start in range(0, max(1, len(lines) - size + 1)):
        window = "\n".join(lines[start:start + size])
        matcher.set_seq1(window)
        if matcher.real_quick_ratio() <= best[0] or matcher.quick_ratio() <= best[0]:
            continue
        ratio = matcher.ratio()
        if ratio > best[0]:
            best = (ratio, start + 1, min(start + size, len(lines)))
    return best


def _squash(text: str) -> str:
    return " ".join(text.split())


def no_match_message(path: str, content: str, old: str) -> str:
    if not content:
        return f"old_string was not found: {path} is empty (use write_file to give it content)"
    ratio, first, last = nearest_match(content, old)
    lines = content.splitlines()
    hint = ""
    if _squash(old) and _squash(old) in _squash(content):
        hint = " It matches when whitespace is ignored: copy the indentation and line breaks exactly."
    shown = numbered(lines[first - 1:last], first)
    return (f"old_string was not found in {path}.{hint} The most similar text is lines {first}-{last} "
            f"({ratio:.0%} similar):\n{shown}\nCopy the text exactly as it appears there (without the "
            f"line numbers), or read_file {path} to see the current content.")


def edit_file(ctx: ToolContext, path: str, old_string: str, new_string: str, replace_all: bool = False) -> str:
    path = rel(path)
    if old_string == "":
        raise ToolError("old_string is empty; to create or replace a whole file use write_file")
    if old_string == new_string:
        raise ToolError("old_string and new_string are the same; nothing would change")
    try:
        content = read_text(ctx, path)
    except ToolError:
        raise
    except Exception:
        raise ToolError(f"no such file: {path} (use write_file to create it)") from None
    count = content.count(old_string)
    if count == 0:
        raise ToolError(no_match_message(path, content, old_string))
    if count > 1 and not replace_all:
        starts, at = [], content.find(old_string)
        while at != -1:
            starts.append(line_of(content, at))
            at = content.find(old_string, at + len(old_string))
        raise ToolError(f"old_string occurs {count} times in {path} (at lines {', '.join(map(str, starts))}); "
                        "include more surrounding lines to make it unique, or pass replace_all=true")
    first_at = content.find(old_string)
    updated = content.replace(old_string, new_string) if replace_all else content.replace(old_string, new_string, 1)
    ctx.sandbox.write_file(path, updated)
    ctx.touch(path, "edited")
    lines = updated.splitlines()
    first = line_of(updated, first_at)
    last = first + new_string.count("\n")
    lo, hi = max(1, first - SNIPPET_CONTEXT), min(len(lines), last + SNIPPET_CONTEXT)
    done = f"replaced {count} occurrences" if count > 1 else "replaced 1 occurrence"
    return f"edited {path}: {done}. Lines {lo}-{hi} now read:\n{numbered(lines[lo - 1:hi], lo)}"


TOOL = Tool(
    "edit_file",
    "Replace old_string with new_string in a file. old_string must match exactly (whitespace included) "
    "and be unique unless replace_all is true.",
    obj({"path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
         "replace_all": {"type": "boolean"}}, ["path", "old_string", "new_string"]),
    edit_file,
)
