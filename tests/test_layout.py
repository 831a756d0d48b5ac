"""The shape of the trees: the tests' and the source's.

Test folders have no `__init__.py`, so pytest imports each test module by its
basename: two `test_x.py` in different folders stop collection of the whole
suite ("import file mismatch"). The first guard names the clash instead. The
others hold the source to its rules: where imports go, and how long a
function may be. (ruff and import-linter, run by `make test`, check the rest:
pyflakes, import order and the layer table.)
"""

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent


def test_no_two_test_modules_share_a_basename():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"rename one of each group (pytest imports test modules by basename): {clashes}"


# --- the source tree's shape ---------------------------------------------------------

SRC = TESTS.parent / "src" / "atelier"
ROOTS = [SRC, TESTS, TESTS.parent / "benchmarks", TESTS.parent / "experiments"]
HEAVY = {"torch", "transformers", "tokenizers", "safetensors", "gguf", "numpy", "matplotlib", "fastapi", "uvicorn"}
"""Packages slow to import: a module that must import fast may import them inside the function that needs them."""
OPTIONAL = {"ray", "triton", "vllm", "wandb", "datasets", "huggingface_hub", "openai", "litellm"}
"""Packages a default install may lack: imported inside the function that needs them, anywhere."""
TRITON_IMPORTERS = ("torch._dynamo", "torch._inductor")
"""torch's compiler: importing it imports Triton, which reads TRITON_INTERPRET once; deferred anywhere."""
ENTRY_POINTS = ("atelier.cli", "atelier.tasks.reporter")
"""Modules whose function bodies import what they run: the CLI (`atelier --help` imports typer only) and the
grader's reporter (it runs in the task's interpreter, importing in the order its docstring gives)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _top_level_imports(tree: ast.Module) -> set[str]:
    """Modules a module imports when it is imported (not under `if TYPE_CHECKING`)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(part)

    visit(tree.body)
    return found


def _inner_imports(tree: ast.Module, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function or class body (`from package import
    module` names the module)."""
    found = []
    for scope in ast.walk(tree):
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for node in ast.walk(scope):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, alias.name) for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                    found += [(node.lineno, n if n in modules else node.module or "") for n in names]
    return sorted(set(found))


def _weights(modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """The atelier modules that import a heavy package when imported (directly or through other
    modules, their packages included), and those that import an optional one."""
    imports = {m: _top_level_imports(ast.parse(p.read_text())) for m, p in modules.items()}

    def reaches(kinds: set[str]) -> set[str]:
        marked = {m for m, deps in imports.items() if any(d.split(".")[0] in kinds for d in deps)}
        while True:
            more = {m for m, deps in imports.items() if m not in marked
                    and (any(d in marked for d in deps) or any(m.startswith(p + ".") for p in marked))}
            if not more:
                return marked
            marked |= more

    return reaches(HEAVY | OPTIONAL), reaches(OPTIONAL)


def test_imports_inside_functions_only_defer_what_is_heavy_or_optional():
    """Imports go at the top of a module, where they show its dependencies, unless a module that
    imports fast defers a heavy one (torch, transformers and the like, or an atelier module that
    imports one) to the function that needs it, or any module defers an optional one (Ray,
    Triton, vLLM). Entry points aside: see ENTRY_POINTS."""
    modules = _modules()
    heavy, optional = _weights(modules)
    wrong = []
    for name, path in sorted(modules.items()):
        if name.startswith(ENTRY_POINTS):
            continue
        for line, target in _inner_imports(ast.parse(path.read_text()), modules):
            top = target.split(".")[0]
            if top in OPTIONAL or target in optional or target.startswith(TRITON_IMPORTERS):
                continue
            if (top in HEAVY or target in heavy) and name not in heavy:
                continue
            why = "it is imported already" if name in heavy else "it is neither heavy nor optional"
            wrong.append(f"{path.relative_to(TESTS.parent)}:{line}: {target} ({why}: import it at the top)")
    assert not wrong, "\n".join(wrong)


def test_no_function_is_longer_than_80_lines():
    """Functions read in one screen: a longer one is split where its steps are."""
    long = []
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 80:
                        long.append(f"{path.relative_to(TESTS.parent)}:{node.lineno}: {node.name}, {lines} lines")
    assert not long, "\n".join(long)
