"""Searching the workspace: `grep` (exact, regular expressions) and
`codebase_search` (ranked, by meaning of the words).

`codebase_search` is BM25 (k1=1.2, b=0.75) over chunks of 40 lines.
Identifiers are split the way code names words (`parseHTTPHeader`,
`parse_http_header` -> parse, http, header) and kept whole as well, and a
chunk's file path counts among its words, so "where are headers parsed"
finds `http/headers.py`. The index is cached per file (size and mtime) for
the episode, so repeated searches cost only the files that changed.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from atelier.harness.errors import ToolError
from atelier.harness.tools.base import Tool, ToolContext, in_workspace, obj, rel

CHUNK_LINES = 40
MAX_FILE_BYTES = 256 * 1024
MAX_FILES = 5000
K1, B = 1.2, 0.75
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")
_PART = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
# not after an escape but \b or \<
_DOTTED = re.compile(r"(?:(?<=\\[b<])|(?<![\w\\]))[A-Za-z_]\w*(?:\\?\.[A-Za-z_]\w*)+")
_STOP = frozenset("the a an of to in and or is are for on with where what how which does do be by it this that".split())


def terms(text: str) -> list[str]:
    out: list[str] = []
    for word in _WORD.findall(text):
        low = word.lower()
        parts = [p.lower() for p in _PART.findall(word)]
        if low not in _STOP:
            out.append(low)
        out.extend(p for p in parts if p != low and len(p) > 1 and p not in _STOP)
    return out


def grep(ctx: ToolContext, pattern: str, path: str = ".", include: str | None = None) -> str:
    target = rel(path)
    lines, heading = _grep_lines(ctx, pattern, target, include), ""
    cut = None if lines else last_part_pattern(pattern)
    if cut is not None and (lines := _grep_lines(ctx, cut, target, include)):
        heading = (f"no matches for {pattern!r}; Python defines a dotted name (a method, a nested function) "
                   f"under its last part, and {cut!r} matches:\n")
    if not lines:
        return f"no matches for {pattern!r} in {target or '.'}" + (f" (files {include})" if include else "")
    limit = ctx.config.grep_max_matches
    shown = [(line[2:] if line.startswith("./") else line)[:240] for line in lines[:limit]]
    more = f"\n[{len(lines) - limit} more matches; narrow the pattern, path or include]" if len(lines) > limit else ""
    return heading + "\n".join(shown) + more


def _grep_lines(ctx: ToolContext, pattern: str, target: str, include: str | None) -> list[str]:
    """grep's matching lines (none when nothing matches); a ToolError when grep fails."""
    argv = ["grep", "-rnIE", "--exclude-dir=.git", "--color=never"]
    if include:
        argv.append(f"--include={include}")
    argv += ["-e", pattern, "--", in_workspace(target)]
    res = ctx.sandbox.exec(argv, timeout=ctx.config.command_timeout_s)
    if res.exit_code == 1:
        return []
    if res.exit_code != 0:
        raise ToolError(f"grep failed: {res.stderr.strip() or 'exit code ' + str(res.exit_code)} "
                        "(the pattern is an extended regular expression; escape ( ) [ ] { } . * + ? |)")
    return res.stdout.splitlines()


def last_part_pattern(pattern: str) -> str | None:
    """`pattern` with every dotted name (`CacheMemory.expire`, `a\\.b`) cut to its last part;
    None when it names none (pure).

    Agents grep for the name a task gives them, and `def CacheMemory.expire`
    matches nothing: Python writes a method as `def expire` inside its class.
    The demo's policy did so in most of its held-out attempts at dotted names,
    and never found the code (docs/log/2026-12-05-dotted-names.md)."""
    cut = _DOTTED.sub(lambda found: re.split(r"\\?\.", found.group(0))[-1], pattern)
    return None if cut == pattern else cut


@dataclass
class Chunk:
    path: str
    start: int                 # first line, 1-based
    lines: list[str]
    tf: Counter
    length: int


def _chunks(path: str, text: str) -> list[Chunk]:
    lines = text.splitlines()
    path_terms = terms(path.replace("/", " ").replace(".", " "))
    out = []
    for start in range(0, max(len(lines), 1), CHUNK_LINES):
        part = lines[start:start + CHUNK_LINES]
        words = terms("\n".join(part)) + path_terms
        out.append(Chunk(path, start + 1, part, Counter(words), len(words)))
    return out


def _index(ctx: ToolContext) -> list[Chunk]:
    """Chunks of every text file, re-reading only files whose size or mtime changed."""
    res = ctx.sandbox.exec(["find", ".", "-name", ".git", "-prune", "-o", "-type", "f",
                            "-size", f"-{MAX_FILE_BYTES // 1024}k", "-printf", "%P\\t%s\\t%T@\\n"], timeout=30)
    cache: dict[str, tuple[str, list[Chunk]]] = ctx.cache.setdefault("search_index", {})
    seen, chunks = set(), []
    for line in sorted(res.stdout.splitlines())[:MAX_FILES]:
        path, _, stamp = line.partition("\t")
        seen.add(path)
        if path not in cache or cache[path][0] != stamp:
            try:
                data = ctx.sandbox.read_bytes(path)
            except Exception:
                continue
            text = "" if b"\0" in data[:8192] else data.decode("utf-8", errors="replace")
            cache[path] = (stamp, _chunks(path, text) if text else [])
        chunks.extend(cache[path][1])
    for gone in set(cache) - seen:
        del cache[gone]
    return chunks


def bm25(chunks: list[Chunk], query: list[str]) -> list[tuple[float, Chunk]]:
    if not chunks or not query:
        return []
    n = len(chunks)
    avg = sum(c.length for c in chunks) / n or 1.0
    df = Counter(t for c in chunks for t in set(query) if t in c.tf)
    scored = []
    for c in chunks:
        score = 0.0
        for t in query:
            f = c.tf.get(t, 0)
            if f:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                score += idf * f * (K1 + 1) / (f + K1 * (1 - B + B * c.length / avg))
        if score > 0:
            scored.append((score, c))
    scored.sort(key=lambda sc: (-sc[0], sc[1].path, sc[1].start))
    return scored


def _snippet(chunk: Chunk, query: set[str], width: int = 6) -> tuple[int, list[str]]:
    """The `width` lines of the chunk where query words appear most (substring test: cheap)."""
    hits = [sum(t in low for t in query) for low in (line.lower() for line in chunk.lines)]
    best = max(range(max(1, len(hits) - width + 1)), key=lambda i: (sum(hits[i:i + width]), -i))
    return chunk.start + best, chunk.lines[best:best + width]


def codebase_search(ctx: ToolContext, query: str, max_results: int | None = None) -> str:
    words = terms(query)
    if not words:
        raise ToolError("the query has no searchable words; describe what the code does or name identifiers")
    ranked = bm25(_index(ctx), words)[: max_results or ctx.config.search_max_results]
    if not ranked:
        return f"nothing in the workspace matches {query!r}; try other words or grep"
    blocks = []
    for score, chunk in ranked:
        first, lines = _snippet(chunk, set(words))
        body = "\n".join(f"{n:>5}\t{line[:200]}" for n, line in enumerate(lines, first))
        end = chunk.start + len(chunk.lines) - 1
        blocks.append(f"{chunk.path}:{chunk.start}-{end} (score {score:.2f})\n{body}")
    return "\n\n".join(blocks)


TOOLS = [
    Tool("grep", "Search file contents with an extended regular expression; prints file:line: text. "
         "`include` filters file names (e.g. '*.py').",
         obj({"pattern": {"type": "string"}, "path": {"type": "string"}, "include": {"type": "string"}},
             ["pattern"]), grep),
    Tool("codebase_search", "Rank code passages by relevance to a natural-language query or identifiers.",
         obj({"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1}}, ["query"]),
         codebase_search),
]
