"""Reading, listing, finding, writing and deleting workspace files."""

from __future__ import annotations

import re
from functools import lru_cache

from atelier.harness.errors import ToolError
from atelier.harness.tools.base import Tool, ToolContext, in_workspace, obj, rel
from atelier.sandbox.base import SandboxPathError

STR, INT = {"type": "string"}, {"type": "integer", "minimum": 1}


def numbered(lines: list[str], first: int) -> str:
    """`cat -n` style lines, so the model can cite and range them."""
    width = len(str(first + len(lines) - 1))
    return "\n".join(f"{n:>{width}}\t{line}" for n, line in enumerate(lines, first))


def read_text(ctx: ToolContext, path: str) -> str:
    """A workspace text file, or a ToolError saying why it cannot be shown."""
    data = ctx.sandbox.read_bytes(path)
    if b"\0" in data[:8192]:
        raise ToolError(f"{path} is a binary file ({len(data)} bytes); it cannot be shown as text")
    return data.decode("utf-8", errors="replace")


def _is_dir(ctx: ToolContext, path: str) -> bool:
    return ctx.sandbox.exec(["test", "-d", in_workspace(path)], timeout=10).exit_code == 0


def read_file(ctx: ToolContext, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
    path = rel(path)
    try:
        text = read_text(ctx, path)
    except SandboxPathError:
        if not path or _is_dir(ctx, path):
            raise ToolError(f"{path or '.'} is a directory; use list_dir to see its entries") from None
        raise
    lines = text.splitlines()
    total = len(lines)
    ctx.touch(path, "viewed")
    if total == 0:
        return f"{path} is empty"
    start = start_line or 1
    if start > total:
        raise ToolError(f"start_line {start} is past the end of {path} ({total} lines)")
    end = min(end_line or start + ctx.config.read_max_lines - 1, total)
    if end < start:
        raise ToolError(f"end_line {end_line} is before start_line {start}")
    shown = numbered(lines[start - 1:end], start)
    if start == 1 and end == total:
        return shown
    return f"{shown}\n[lines {start}-{end} of {total} in {path}; use start_line/end_line for others]"


def list_dir(ctx: ToolContext, path: str = ".", depth: int = 1) -> str:
    path = rel(path)
    res = ctx.sandbox.exec(["find", in_workspace(path), "-mindepth", "1", "-maxdepth", str(min(depth, 6)),
                            "-name", ".git", "-prune", "-o", "-printf", "%y %P\\n"], timeout=30)
    if res.exit_code != 0:
        raise ToolError(f"cannot list {path or '.'}: {res.stderr.strip() or 'not a directory'}")
    entries = sorted(line[2:] + ("/" if line[0] == "d" else "") for line in res.stdout.splitlines() if line[2:])
    limit = ctx.config.list_max_entries
    if not entries:
        return f"{path or '.'} is empty"
    more = f"\n[{len(entries) - limit} more entries; list a subdirectory]" if len(entries) > limit else ""
    return "\n".join(entries[:limit]) + more


def workspace_files(ctx: ToolContext) -> list[str]:
    """Every regular file of the workspace outside .git, relative, sorted."""
    res = ctx.sandbox.exec(["find", ".", "-name", ".git", "-prune", "-o", "-type", "f", "-printf", "%P\\n"],
                           timeout=30)
    return sorted(p for p in res.stdout.splitlines() if p)


@lru_cache(maxsize=256)
def glob_regex(pattern: str) -> re.Pattern[str]:
    """`**` spans directories, `*` and `?` stay within one, `[..]` is a class."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif c == "*":
            out, i = out + "[^/]*", i + 1
        elif c == "?":
            out, i = out + "[^/]", i + 1
        elif c == "[" and "]" in pattern[i + 1:]:
            j = pattern.index("]", i + 1)
            body = pattern[i + 1:j].replace("\\", "\\\\")
            out, i = out + "[" + ("^" + body[1:] if body.startswith("!") else body) + "]", j + 1
        else:
            out, i = out + re.escape(c), i + 1
    return re.compile(out + r"\Z")


def glob(ctx: ToolContext, pattern: str) -> str:
    pattern = pattern.strip().removeprefix("./")
    if not pattern:
        raise ToolError("pattern is empty; e.g. '**/*.py' or 'test_*.py'")
    if "/" not in pattern and not pattern.startswith("**"):
        pattern = "**/" + pattern  # a bare name pattern matches at any depth
    regex = glob_regex(pattern)
    hits = [p for p in workspace_files(ctx) if regex.match(p)]
    if not hits:
        return f"no files match {pattern!r}"
    limit = ctx.config.list_max_entries
    more = f"\n[{len(hits) - limit} more; narrow the pattern]" if len(hits) > limit else ""
    return "\n".join(hits[:limit]) + more


def write_file(ctx: ToolContext, path: str, content: str) -> str:
    path = rel(path)
    if not path or _is_dir(ctx, path):
        raise ToolError(f"{path or '.'} is a directory; name a file")
    try:
        ctx.sandbox.read_bytes(path)
        existed = True
    except Exception:
        existed = False
    ctx.sandbox.write_file(path, content)
    ctx.touch(path, "edited")
    lines = content.count("\n") + (0 if content.endswith("\n") or not content else 1)
    return f"{'overwrote' if existed else 'created'} {path} ({lines} lines)"


def delete_file(ctx: ToolContext, path: str) -> str:
    path = rel(path)
    target = in_workspace(path)
    res = ctx.sandbox.exec(["sh", "-c", 'if [ -d "$1" ] && [ ! -L "$1" ]; then echo dir; exit 3; fi; '
                            'if [ ! -e "$1" ] && [ ! -L "$1" ]; then exit 4; fi; rm -f -- "$1"', "rm", target],
                           timeout=30)
    if res.exit_code == 3 or not path:
        raise ToolError(f"{path or '.'} is a directory; delete_file removes single files "
                        "(use run_terminal with rm -r for a directory)")
    if res.exit_code == 4:
        raise ToolError(f"no such file: {path}")
    if res.exit_code != 0:
        raise ToolError(f"cannot delete {path}: {res.stderr.strip()}")
    ctx.recent.pop(path, None)
    return f"deleted {path}"


TOOLS = [
    Tool("read_file", "Show a text file with line numbers, whole or a range (1-based, inclusive).",
         obj({"path": STR, "start_line": INT, "end_line": INT}, ["path"]), read_file),
    Tool("list_dir", "List a directory's entries (directories end in /), recursing `depth` levels.",
         obj({"path": STR, "depth": INT}, []), list_dir),
    Tool("glob", "Find files by name pattern, e.g. '**/*.py' or 'test_*.py' (any depth when no '/').",
         obj({"pattern": STR}, ["pattern"]), glob),
    Tool("write_file", "Create or overwrite a file with the given content.",
         obj({"path": STR, "content": STR}, ["path", "content"]), write_file),
    Tool("delete_file", "Delete one file.", obj({"path": STR}, ["path"]), delete_file),
]
