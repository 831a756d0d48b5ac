"""Mutation tasks (SWE-smith style): break a working repository with small
AST-level bugs and keep the bugs that its own tests catch.

What this covers, and what it does not:

- Operators act only inside function bodies. Module-level code is left
  alone: breaking it breaks imports, which makes every test fail for a reason
  that says nothing about behaviour.
- Test code (`tests/`, `test_*.py`, `*_test.py`, `conftest.py`) is never
  mutated, nor are `setup.py`, docs or examples.
- A mutation is a rewrite of one source span found from the node positions
  that `ast` reports (UTF-8 byte columns, converted to characters), so the
  rest of the file keeps its formatting and the gold patch is a few lines.
- `enumerate_mutations` is cheap: it does not parse its results. The builder
  parses each applied candidate and drops those that do not parse.
- A task is kept only when at least one test that passed in every clean run
  fails with the mutations applied (FAIL_TO_PASS); the other clean passes are
  PASS_TO_PASS; tests that failed or were flaky on the clean repo are in
  neither list. Candidates that break nothing, do not parse, time out or
  crash the runner are dropped with that reason. Nothing is invented.
- Combinations of two or three mutations are built only from mutations that
  each broke a test on their own, then tested together again, so every line
  of a gold patch is needed.
- No coverage guidance: candidates in untested code simply break nothing and
  are dropped, at the price of one test run each.
"""

from __future__ import annotations

import ast
import bisect
import difflib
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence


@dataclass(frozen=True)
class Mutation:
    """One span rewrite: `source[start:end] == original` becomes `mutated`.

    `start`/`end` are character offsets in the file and `line` is the 1-based
    line of `start`. `description` is for logs only: it names the fix, so it
    must never reach a prompt.
    """

    operator: str
    path: str
    function: str
    line: int
    start: int
    end: int
    original: str
    mutated: str
    description: str

    @property
    def label(self) -> str:
        return f"{self.path}:{self.line} {self.operator} in {self.function}"


# --- source positions --------------------------------------------------------


class _Source:
    """A file's text with line starts, to turn ast positions into offsets."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.split("\n")
        self.starts = [0]
        for line in self.lines[:-1]:
            self.starts.append(self.starts[-1] + len(line) + 1)

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        chars = col if line.isascii() else len(line.encode()[:col].decode())
        return self.starts[lineno - 1] + chars

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        return start, self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def seg(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self.starts, offset)


@dataclass
class _Context:
    src: _Source
    function: str
    parent: dict[int, ast.AST] = field(default_factory=dict)
    block: dict[int, list[ast.stmt]] = field(default_factory=dict)


Edit = tuple[int, int, str, str]  # start, end, replacement, description
_TIGHT = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)
_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.MatMult)


def _binds_tighter_than_minus(node: ast.expr) -> bool:
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _ARITH)
    if isinstance(node, ast.UnaryOp):
        return not isinstance(node.op, ast.Not)
    return isinstance(node, _TIGHT)


def _int(node: ast.AST) -> int | None:
    """The value of an int literal, `-1` included; None for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int(node.operand)
        return None if inner is None else -inner
    return None


# --- operators: (node, context) -> edits ---------------------------------------

_CMP_TOKEN = re.compile(r"<=|>=|==|!=|<|>|\bis\s+not\b|\bis\b|\bnot\s+in\b|\bin\b")
_CMP_FLIP = {
    ast.Lt: ">=", ast.GtE: "<", ast.Gt: "<=", ast.LtE: ">", ast.Eq: "!=",
    ast.NotEq: "==", ast.Is: "is not", ast.IsNot: "is", ast.In: "not in", ast.NotIn: "in",
}


def flip_comparison(node: ast.AST, ctx: _Context) -> Iterator[Edit]:
    """`a < b` -> `a >= b`, `==` <-> `!=`, `is` <-> `is not`, `in` <-> `not in`."""
    if not isinstance(node, ast.Compare):
        return
    start, end = ctx.src.span(node)
    text = ctx.src.text[start:end]
    operands = [node.left, *node.comparators]
    for i, op in enumerate(node.ops):
        gap = (ctx.src.span(operands[i])[1] - start, ctx.src.span(operands[i + 1])[0] - start)
        found = list(_CMP_TOKEN.finditer(text, *gap))
        if len(found) != 1:  # a comment in the gap: do not guess
            continue
        tok, new = found[0], _CMP_FLIP[type(op)]
        yield start, end, text[: tok.start()] + new + text[tok.end() :], f"`{tok.group()}` -> `{new}`"


_BOOL_TOKEN = re.compile(r"\b(?:and|or)\b")


def flip_boolop(node: ast.AST, ctx: _Context) -> Iterator[Edit]:
    """`a and b` -> `a or b` (every operator of one chain)."""
    if not isinstance(node, ast.BoolOp):
        return
    old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
    start, end = ctx.src.span(node)
    text = ctx.src.text[start:end]
    tokens = []
    for left, right in zip(node.values, node.values[1:]):
        found = list(_BOOL_TOKEN.finditer(text, ctx.src.span(left)[1] - start, ctx.src.span(right)[0] - start))
        if len(found) != 1 or found[0].group() != old:
            return
        tokens.append(found[0])
    for tok in reversed(tokens):
        text = text[: tok.start()] + new + text[tok.end() :]
    yield start, end, text, f"`{old}` -> `{new}`"


def _shift(node: ast.expr, ctx: _Context, delta: int) -> str:
    value = _int(node)
    if value is not None:
        return str(value + delta)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and _int(node.right) is not None:
        k = (_int(node.right) or 0) * (1 if isinstance(node.op, ast.Add) else -1) + delta
        left = ctx.src.seg(node.left)
        return left if k == 0 else f"{left} {'+' if k > 0 else '-'} {abs(k)}"
    text = ctx.src.seg(node)
    text = text if _binds_tighter_than_minus(node) else f"({text})"
    return f"{text} {'+' if delta > 0 else '-'} {abs(delta)}"


def _natural_delta(node: ast.expr, default: int) -> int:
    """Move `n + 1` back to `n` and `n - 1` up to `n`; otherwise `default`."""
    if isinstance(node, ast.BinOp) and _int(node.right) is not None:
        if isinstance(node.op, ast.Add):
            return -1
        if isinstance(node.op, ast.Sub):
            return 1
    return default


def off_by_one(node: ast.AST, ctx: _Context) -> Iterator[Edit]:
    """`range(n)` -> `range(n - 1)`; slice bounds moved by one."""
    bounds: list[tuple[ast.expr, int]] = []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        if 1 <= len(node.args) <= 3 and not any(isinstance(a, ast.Starred) for a in node.args):
            bounds.append((node.args[0] if len(node.args) == 1 else node.args[1], -1))
    elif isinstance(node, ast.Slice):
        if node.lower is not None:
            bounds.append((node.lower, 1))
        if node.upper is not None:
            bounds.append((node.upper, -1))
    for bound, default in bounds:
        start, end = ctx.src.span(bound)
        delta = _natural_delta(bound, default)
        yield start, end, _shift(bound, ctx, delta), f"bound {'+' if delta > 0 else '-'}1"


_SYMMETRIC_CALLS = {"max", "min", "print", "set", "sorted", "hash"}


def swap_args(node: ast.AST, ctx: _Context) -> Iterator[Edit]:
    """`f(a, b)` -> `f(b, a)` for each adjacent pair of positional arguments."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return
    if isinstance(node.func, ast.Name) and node.func.id in _SYMMETRIC_CALLS:
        return
    for a, b in zip(node.args, node.args[1:]):
        if isinstance(a, ast.Starred) or isinstance(b, ast.Starred):
            continue
        (a0, a1), (b0, b1) = ctx.src.span(a), ctx.src.span(b)
        text = ctx.src.text
        if text[a0:a1] != text[b0:b1]:
            yield a0, b1, text[b0:b1] + text[a1:b0] + text[a0:a1], "swap two arguments"


def _is_docstring_or_literal(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


def remove_statement(node: ast.AST, ctx: _Context) -> Iterator[Edit]:
    """Delete an expression statement or assignment (`pass` if it was alone)."""
    if not isinstance(node, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign)):
        return
    if _is_docstring_or_literal(node) or (isinstance(node, ast.AnnAssign) and node.value is None):
        return
    block = ctx.block.get(id(node))
    if block is None:
        return
    src = ctx.src
    start, end = src.span(node)
    i = next(j for j, s in enumerate(block) if s is node)
    shares_line = (i > 0 and block[i - 1].end_lineno == node.lineno) or (
        i + 1 < len(block) and block[i + 1].lineno == node.end_lineno
    )
    first, last = src.lines[node.lineno - 1], src.lines[node.end_lineno - 1]  # type: ignore[index]
    before = first[: start - src.starts[node.lineno - 1]]
    after = last[end - src.starts[node.end_lineno - 1] :].strip()  # type: ignore[index]
    if len(block) == 1 or shares_line or before.strip() or (after and not after.startswith("#")):
        yield start, end, "pass", "remove a statement"
        return
    line_start = src.starts[node.lineno - 1]
    line_end = min(src.starts[node.end_lineno - 1] + len(last) + 1, len(src.text))  # type: ignore[index]
    yield line_start, line_end, "", "remove a statement"


def remove_return(node: ast.AST, ctx: _Context) -> Iterator[Edit]:
    """`return x` -> `return None`."""
    if isinstance(node, ast.Return) and node.value is not None:
        if not (isinstance(node.value, ast.Constant) and node.value.value is None):
            start, end = ctx.src.span(node.value)
            yield start, end, "None", "return None"


def change_constant(node: ast.AST, ctx: _Context) -> Iterator[Edit]:
    """An int plus one, `True` <-> `False`, or a string with one letter's case swapped."""
    if not isinstance(node, ast.Constant) or isinstance(ctx.parent.get(id(node)), ast.Expr):
        return
    start, end = ctx.src.span(node)
    value = node.value
    if type(value) is bool:
        yield start, end, str(not value), "negate a bool"
    elif type(value) is int:
        yield start, end, str(value + 1), "int + 1"
    elif type(value) is str and value:
        text = ctx.src.text[start:end]
        quote = text[:1]
        if quote not in ("'", '"') or text[-1:] != quote or text[1:-1] != value or text.startswith(quote * 3):
            return  # prefixes, escapes, triple quotes, implicit concatenation
        i = next((j for j, ch in enumerate(value) if ch.swapcase() != ch and len(ch.swapcase()) == 1), None)
        if i is not None:
            changed = value[:i] + value[i].swapcase() + value[i + 1 :]
            yield start, end, quote + changed + quote, "swap a letter's case"


def invert_condition(node: ast.AST, ctx: _Context) -> Iterator[Edit]:
    """`if c:` -> `if not c:` (and `x if c else y`); `if not c` -> `if c`."""
    if not isinstance(node, (ast.If, ast.IfExp)):
        return
    test = node.test
    start, end = ctx.src.span(test)
    plain = (*_TIGHT, ast.Compare) + ((ast.BoolOp,) if isinstance(node, ast.If) else ())
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = ctx.src.seg(test.operand)
        new = inner if isinstance(test.operand, plain) and "\n" not in inner else f"({inner})"
    else:
        text = ctx.src.text[start:end]
        new = "not " + (text if isinstance(test, (*_TIGHT, ast.Compare)) else f"({text})")
    yield start, end, new, "invert a condition"


def _stmt_start(node: ast.stmt, src: _Source) -> int:
    decorators = getattr(node, "decorator_list", None) or []
    return min(src.span(n)[0] - (1 if n in decorators else 0) for n in [node, *decorators])


def _is_stub(body: Sequence[ast.stmt]) -> bool:
    if len(body) != 1:
        return False
    stmt = body[0]
    if isinstance(stmt, ast.Pass) or _is_docstring_or_literal(stmt):
        return True
    if isinstance(stmt, ast.Raise) and stmt.exc is not None:
        exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"
    return False


def remove_body(node: ast.AST, ctx: _Context) -> Iterator[Edit]:
    """A function's body (after its docstring) -> `raise NotImplementedError`."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return
    body = node.body[1:] if _is_docstring_or_literal(node.body[0]) else node.body
    if not body or _is_stub(body):
        return
    yield _stmt_start(body[0], ctx.src), ctx.src.span(body[-1])[1], "raise NotImplementedError", "remove the body"


OPERATORS: dict[str, Callable[[ast.AST, _Context], Iterator[Edit]]] = {
    op.__name__: op
    for op in (
        flip_comparison, flip_boolop, off_by_one, swap_args, remove_statement,
        remove_return, change_constant, invert_condition, remove_body,
    )
}


# --- enumeration, application, sampling -----------------------------------------

_SKIP_FIELDS = (ast.expr_context, ast.boolop, ast.operator, ast.unaryop, ast.cmpop)


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def _own_nodes(func: ast.AST, ctx: _Context) -> list[ast.AST]:
    """The function and the nodes of its body, not those of nested defs."""
    nodes: list[ast.AST] = [func]

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.JoinedStr)):
            return  # nested defs are functions of their own; f-string parts lack exact positions
        nodes.append(node)
        for name, value in ast.iter_fields(node):
            if name == "annotation":
                continue
            children = value if isinstance(value, list) else [value]
            if children and isinstance(children[0], ast.stmt):
                for child in children:
                    ctx.block[id(child)] = children
            for child in children:
                if isinstance(child, ast.AST) and not isinstance(child, _SKIP_FIELDS):
                    ctx.parent[id(child)] = node
                    visit(child)

    for stmt in func.body:  # type: ignore[attr-defined]
        ctx.block[id(stmt)] = func.body  # type: ignore[attr-defined]
        visit(stmt)
    return nodes


def enumerate_mutations(source: str, path: str, operators: Sequence[str] | None = None) -> list[Mutation]:
    """Every candidate mutation of one file, in a stable order.

    Candidates are not parsed: a few may not compile (the builder drops them).
    Files that do not parse, or use lone `\\r` line ends, yield nothing.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    if "\r" in source.replace("\r\n", ""):
        return []
    ops = {name: OPERATORS[name] for name in (operators or OPERATORS)}
    src = _Source(source)
    seen: set[tuple[int, int, str]] = set()
    found: list[Mutation] = []
    for qualname, func in _functions(tree):
        ctx = _Context(src, qualname)
        for node in _own_nodes(func, ctx):
            for name, op in ops.items():
                for start, end, new, description in op(node, ctx):
                    if new == source[start:end] or (start, end, new) in seen:
                        continue
                    seen.add((start, end, new))
                    found.append(Mutation(
                        name, path, qualname, src.line_of(start), start, end, source[start:end], new, description,
                    ))
    return found


def apply_mutations(files: dict[str, str], muts: Sequence[Mutation]) -> dict[str, str]:
    """A copy of `files` with `muts` applied; overlapping or stale spans raise."""
    out = dict(files)
    by_path: dict[str, list[Mutation]] = {}
    for m in muts:
        by_path.setdefault(m.path, []).append(m)
    for path, group in by_path.items():
        group.sort(key=lambda m: m.start, reverse=True)
        for later, earlier in zip(group, group[1:]):
            if earlier.end > later.start:
                raise ValueError(f"overlapping mutations: {earlier.label} and {later.label}")
        text = files[path]
        for m in group:
            if text[m.start : m.end] != m.original:
                raise ValueError(f"{m.label}: the source no longer has {m.original!r} there")
            text = text[: m.start] + m.mutated + text[m.end :]
        out[path] = text
    return out


def _overlaps(a: Mutation, b: Mutation) -> bool:
    return a.path == b.path and a.start < b.end and b.start < a.end


def _pick_group(
    muts: Sequence[Mutation], first: Mutation, k: int, rng: random.Random, spread: bool = False
) -> tuple[Mutation, ...] | None:
    """`first` and k-1 others that do not overlap it: other files first, then
    (unless `spread` demands one file each) other functions, then anything;
    None when there are not enough."""
    group = [first]
    while len(group) < k:
        free = [m for m in muts if m not in group and not any(_overlaps(m, g) for g in group)]
        tiers = [
            [m for m in free if m.path not in {g.path for g in group}],
            [m for m in free if (m.path, m.function) not in {(g.path, g.function) for g in group}],
            free,
        ]
        for tier in tiers[:1] if spread else tiers:
            if tier:
                group.append(rng.choice(tier))
                break
        else:
            return None
    return tuple(group)


def sample_combinations(
    muts: Sequence[Mutation], rng: random.Random, count: int, max_k: int = 3
) -> list[tuple[Mutation, ...]]:
    """Up to `count` distinct groups of 1..max_k non-overlapping mutations,
    spread across files where the repository allows."""
    combos: list[tuple[Mutation, ...]] = []
    seen: set[frozenset[Mutation]] = set()
    for _ in range(count * 20):
        if len(combos) >= count or not muts:
            break
        group = _pick_group(muts, rng.choice(list(muts)), rng.randint(1, max_k), rng)
        if group is not None and frozenset(group) not in seen:
            seen.add(frozenset(group))
            combos.append(group)
    return combos


def _interleave(muts: Sequence[Mutation], rng: random.Random) -> list[Mutation]:
    """Shuffle within each operator, then round-robin over operators, so that
    common operators (constants) do not crowd out rare ones."""
    groups: dict[str, list[Mutation]] = {}
    for m in muts:
        groups.setdefault(m.operator, []).append(m)
    names = sorted(groups)
    rng.shuffle(names)
    for name in names:
        rng.shuffle(groups[name])
    out: list[Mutation] = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out.extend(groups[name][i] for name in names if i < len(groups[name]))
    return out


# --- prompt and gold patch ----------------------------------------------------


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def terse_prompt(muts: Sequence[Mutation], failing_tests: Sequence[str], limit: int = 300) -> str:
    """Name what is broken (functions, failing tests), never how to fix it."""
    implement = list(dict.fromkeys((m.function, m.path) for m in muts if m.operator == "remove_body"))
    fix = [fp for fp in dict.fromkeys((m.function, m.path) for m in muts) if fp not in implement]
    parts = []
    if implement:
        parts.append("Implement " + _join([f"`{f}` in {p}" for f, p in implement]))
    if fix:
        parts.append("the failing behaviour of " + _join([f"`{f}` in {p}" for f, p in fix]))
        parts[-1] = ("fix " if implement else "Fix ") + parts[-1]
    head = "; ".join(parts)
    tests = sorted(failing_tests)
    for shown in range(min(3, len(tests)), 0, -1):
        more = f" and {len(tests) - shown} more" if len(tests) > shown else ""
        prompt = f"{head} (see {', '.join(tests[:shown])}{more})."
        if len(prompt) <= limit:
            return prompt
    return f"{head} ({len(tests)} failing tests)."


def gold_patch(before: dict[str, str], after: dict[str, str]) -> str:
    """A `git apply`-able unified diff that turns `before` into `after`."""
    chunks = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path, ""), after.get(path, "")
        if old == new:
            continue
        diff = difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}"
        )
        chunks.append(f"diff --git a/{path} b/{path}\n")
        for line in diff:
            chunks.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(chunks)


def _count_changed_lines(patch: str) -> int:
    return sum(
        1 for line in patch.splitlines() if line[:1] in "+-" and not line.startswith(("+++ ", "--- "))
    )
