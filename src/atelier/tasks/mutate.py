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
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Sequence

from atelier.errors import AtelierError
from atelier.sandbox.base import SandboxConfig
from atelier.tasks.junit import JUnitError, parse_junit


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


class MutationBuildError(AtelierError):
    """The repository cannot yield mutation tasks (e.g. no test passes on it)."""


class TestRunError(RuntimeError):
    """The test runner gave no usable result (no report, internal error)."""

    __test__ = False  # not a pytest test class


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


# --- running tests ----------------------------------------------------------------

def run_pytest_local(repo_dir: Path, timeout: float = 300.0, python: str = sys.executable) -> dict[str, str]:
    """Run the repository's pytest suite in a subprocess on this host (no
    sandbox) and return test id -> status. Raises `TimeoutError` past
    `timeout` (the whole process group is killed) and `TestRunError` when
    pytest wrote no report or stopped with an internal or usage error."""
    repo_dir = Path(repo_dir)
    with tempfile.TemporaryDirectory(prefix="atelier-junit-") as tmp:
        report = Path(tmp) / "junit.xml"
        paths = [str(repo_dir)] + ([str(repo_dir / "src")] if (repo_dir / "src").is_dir() else [])
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [
            python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
            "--continue-on-collection-errors", f"--junitxml={report}",
        ]
        proc = subprocess.Popen(
            cmd, cwd=repo_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise TimeoutError(f"pytest ran past {timeout:g}s") from None
        if proc.returncode not in (0, 1) or not report.exists():
            raise TestRunError(f"pytest exited {proc.returncode} with no usable report: {output[-500:]}")
        try:
            statuses = dict(parse_junit(report.read_text()))
        except JUnitError as e:
            raise TestRunError(str(e)) from None
    if not statuses:
        raise TestRunError("pytest reported no tests")
    return statuses


def sandbox_pytest_runner(backend: str = "bwrap", timeout: float = 300.0) -> Runner:
    """A `run_tests` that runs the repository's pytest suite in a fresh sandbox
    (no network, nothing of the host writable), with the same environment
    grading uses: a venv of this Python that sees its site-packages."""
    from atelier.sandbox import SandboxError, create_sandbox
    from atelier.sandbox.base import WORKDIR
    from atelier.tasks.envs import ensure_python_env, env_mounts, env_python
    from atelier.tasks.schema import PythonEnv

    venv = ensure_python_env(PythonEnv(python=f"{sys.version_info.major}.{sys.version_info.minor}",
                                       system_site_packages=True))
    config = SandboxConfig(backend=backend, ro_mounts=env_mounts(venv), output_limit_bytes=16 * 2**20)

    def run(repo_dir: Path) -> dict[str, str]:
        report = "/tmp/atelier-mutate-junit.xml"
        argv = [env_python(venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
                "--continue-on-collection-errors", f"--junitxml={report}"]
        env = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": f"{WORKDIR}:{WORKDIR}/src"}
        with create_sandbox(repo_dir, config) as sb:
            res = sb.exec(argv, timeout=timeout, env=env)
            if res.timed_out:
                raise TimeoutError(f"pytest ran past {timeout:g}s")
            xml = sb.exec(["cat", report])
        if res.exit_code not in (0, 1) or xml.exit_code != 0:
            raise TestRunError(f"pytest exited {res.exit_code} with no usable report: "
                               f"{(res.stdout + res.stderr)[-500:]}")
        try:
            statuses = dict(parse_junit(xml.stdout))
        except (JUnitError, SandboxError) as e:
            raise TestRunError(str(e)) from None
        if not statuses:
            raise TestRunError("pytest reported no tests")
        return statuses

    return run


# --- building tasks ---------------------------------------------------------------

_IGNORE = shutil.ignore_patterns(
    ".git", ".hg", ".venv", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache",
    ".ruff_cache", ".tox", ".nox", "node_modules", "*.egg-info",
)
_NOT_SOURCE_DIRS = {"tests", "test", "testing", "docs", "doc", "examples", "build", "dist", "venv", "site-packages"}
_NOT_SOURCE_FILES = {"conftest.py", "setup.py", "noxfile.py", "fabfile.py"}


def source_files(root: Path) -> list[str]:
    """Repository-relative POSIX paths of the Python files worth mutating."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _NOT_SOURCE_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py") or name in _NOT_SOURCE_FILES:
                continue
            if name.startswith("test_") or name.endswith("_test.py"):
                continue
            found.append(PurePosixPath(Path(dirpath, name).relative_to(root)).as_posix())
    return sorted(found)


@dataclass
class Dropped:
    mutations: list[str]
    reason: str


@dataclass
class BuildReport:
    repo: str
    out: str
    seed: int
    requested: int
    candidates: int = 0
    clean_passing: int = 0
    test_runs: int = 0
    tasks: list[str] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


Runner = Callable[[Path], dict[str, str]]
Outcome = tuple[list[str], list[str]]  # fail_to_pass, pass_to_pass


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8")  # bytes: keep \r\n exactly


def _try(work: Path, files: dict[str, str], muts: Sequence[Mutation], run: Runner,
         clean: set[str], report: BuildReport) -> Outcome | str:
    """Apply, test and restore; the F2P/P2P split, or why the candidate is dropped."""
    mutated = apply_mutations(files, muts)
    changed = sorted({m.path for m in muts})
    for path in changed:
        try:
            ast.parse(mutated[path])
        except (SyntaxError, ValueError):
            return "syntax error"
    try:
        for path in changed:
            (work / path).write_bytes(mutated[path].encode())
        report.test_runs += 1
        statuses = run(work)
    except TimeoutError:
        return "timeout"
    except TestRunError as e:
        return f"test run failed: {str(e)[:200]}"
    finally:
        for path in changed:
            (work / path).write_bytes(files[path].encode())
    broken = sorted(t for t in clean if statuses.get(t) != "passed")
    if not broken:
        return "no test broke"
    return broken, sorted(clean - set(broken))


def _write_task(out: Path, work: Path, repo_name: str, files: dict[str, str], muts: Sequence[Mutation],
                outcome: Outcome, seed: int) -> str:
    """Write one task in the standard layout (`atelier.tasks.writer`): the
    mutated repository is the base state, the original code is the gold fix,
    and the files of the target tests are hidden tests (restored at grading)."""
    from atelier.tasks.schema import PythonEnv, TaskMetadata, TaskSpec, node_file
    from atelier.tasks.writer import write_task

    f2p, p2p = outcome
    key = "|".join(sorted(f"{m.path}:{m.start}:{m.end}:{m.mutated}" for m in muts))
    task_id = f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', repo_name)}-mut-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    mutated = apply_mutations(files, muts)
    changed = sorted({m.path for m in muts})
    patch = gold_patch({p: mutated[p] for p in changed}, {p: files[p] for p in changed})
    test_files = sorted({node_file(t) for t in f2p})
    spec = TaskSpec(
        id=task_id,
        prompt=terse_prompt(muts, f2p),
        env=PythonEnv(python=f"{sys.version_info.major}.{sys.version_info.minor}",
                      system_site_packages=True),
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        metadata=TaskMetadata(source="mutation", category=",".join(sorted({m.operator for m in muts})),
                              files_changed=len(changed), lines_changed=_count_changed_lines(patch)),
    )
    with tempfile.TemporaryDirectory(prefix="atelier-mutant-") as tmp:
        base = Path(tmp) / "repo"
        shutil.copytree(work, base, ignore=_IGNORE, symlinks=True)
        for path in changed:
            (base / path).write_bytes(mutated[path].encode())
        task = write_task(out / task_id, spec, base, {t: _read(work / t) for t in test_files}, patch,
                          overwrite=True)
    # What was mutated, for people reading the suite (outside repo/: never shown to the agent).
    (task.root / "mutations.json").write_text(json.dumps(
        {"seed": seed, "mutations": [{"operator": m.operator, "path": m.path, "line": m.line,
                                      "function": m.function} for m in muts]}, indent=2) + "\n")
    return task_id


def build_mutation_tasks(
    repo: Path, out: Path, n: int, seed: int = 0, run_tests: Runner | None = None, *,
    max_k: int = 3, clean_runs: int = 2, max_attempts: int | None = None,
) -> BuildReport:
    """Write up to `n` mutation tasks of `repo` under `out` (one directory each:
    `task.toml`, `repo/`, `tests/`, `gold.patch`) and `out/build_report.json`.

    `run_tests(repo_dir) -> {test_id: status}` runs the suite in a directory
    (default: `run_pytest_local`); it may raise `TimeoutError` or
    `TestRunError`. The clean repository is tested `clean_runs` times and only
    tests that passed every time count. Each task draws its size k from 1..max_k;
    every member of a combination broke a test alone first. At most
    `max_attempts` (default 20 n) single candidates are tested.
    """
    repo, out = Path(repo).resolve(), Path(out)
    run = run_tests or run_pytest_local
    rng = random.Random(seed)
    report = BuildReport(repo=str(repo), out=str(out), seed=seed, requested=n)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="atelier-mutate-") as tmp:
        work = Path(tmp) / repo.name
        shutil.copytree(repo, work, ignore=_IGNORE, symlinks=True)
        runs = [run(work) for _ in range(max(1, clean_runs))]
        report.test_runs += len(runs)
        clean = {t for t, s in runs[0].items() if s == "passed" and all(r.get(t) == "passed" for r in runs)}
        report.clean_passing = len(clean)
        if not clean:
            raise MutationBuildError(f"no test passes on the clean copy of {repo}",
                                     hint="mutation tasks need a repository whose own tests pass")
        files = {path: _read(work / path) for path in source_files(work)}
        candidates = _interleave([m for p, t in files.items() for m in enumerate_mutations(t, p)], rng)
        report.candidates = len(candidates)
        mutated_files = len({m.path for m in candidates})

        pool: list[tuple[Mutation, Outcome]] = []  # validated singles not yet used
        pending = iter(candidates)
        attempts, budget = 0, max_attempts if max_attempts is not None else 20 * n
        want, exhausted = rng.randint(1, max_k), False
        while len(report.tasks) < n:
            spread = not exhausted and want <= mutated_files  # wait for other files while it may pay
            group = _pick_group([m for m, _ in pool], pool[-1][0], want, rng, spread) if pool else None
            if group is not None:
                outcomes = dict(pool)
                pool = [(m, o) for m, o in pool if m not in group]
                if len(group) == 1:
                    outcome: Outcome | str = outcomes[group[0]]
                else:
                    outcome = _try(work, files, group, run, clean, report)
                if isinstance(outcome, str):
                    report.dropped.append(Dropped([m.label for m in group], outcome))
                else:
                    report.tasks.append(_write_task(out, work, repo.name, files, group, outcome, seed))
                want = rng.randint(1, max_k)
                continue
            candidate = next(pending, None) if attempts < budget else None
            if candidate is None:
                if not pool:
                    break
                if exhausted:
                    want = 1  # spend what is left one by one
                exhausted = True  # first try the drawn size without the one-file-each rule
                continue
            attempts += 1
            result = _try(work, files, (candidate,), run, clean, report)
            if isinstance(result, str):
                report.dropped.append(Dropped([candidate.label], result))
            else:
                pool.append((candidate, result))
    (out / "build_report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return report
