"""The docs' two reference pages, generated from the code at every docs build (the hook in
`docs/hooks/generate.py` calls these), so they cannot drift from it:

- `cli_reference()`: every visible command of the typer app (`atelier.cli.main.app`), its help,
  usage and options, in the order `atelier --help` lists them;
- `config_reference()`: every field of the pydantic configs a recipe or a file of atelier's is
  validated by (`RECIPES`): its dotted key, type, default and the docstring written right after
  it in the source (read with `ast`, so inherited fields keep their own class's text). Each
  config class has one section; a field holding another config links to that one's.

Like every module of the CLI, this one imports only typer at the top; the config models are
imported inside the functions.
"""

from __future__ import annotations

import ast
import enum
import inspect
import re
import textwrap
import types
import typing
from typing import Any

import typer

RECIPES = (
    ("`atelier run` recipe (`recipes/demo.toml`)", "atelier.pipeline.config", "RunConfig"),
    ("`atelier train` recipe (`recipes/rl-*.toml`)", "atelier.rl.config", "TrainConfig"),
    ("`atelier pretrain` recipe (`recipes/pretrain-*.toml`)", "atelier.pretrain.config", "PretrainConfig"),
    ("`atelier eval` recipe", "atelier.eval.runner", "EvalRecipe"),
    ("`atelier base-eval` recipe", "atelier.pretrain.config", "BaseEvalConfig"),
    ("`atelier agent --config`", "atelier.harness.config", "AgentConfig"),
    ("A sandbox (`atelier sandbox run`, a task's limits)", "atelier.sandbox.base", "SandboxConfig"),
    ("A task's `task.toml`", "atelier.tasks.schema", "TaskSpec"),
    ("A suite spec (`suites/*.toml`)", "atelier.tasks.suite", "SuiteSpec"),
)
"""(what it configures, module, class) of every top-level config, in the page's order."""


# --- the configuration reference -----------------------------------------------------------

def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right after its annotation) in `cls` and its
    bases, the nearest class's first (pure but for reading the source)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef)), [])
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it in TOML terms (pure)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f'`{a!r}`'.replace("'", '"') for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("none" if a is type(None) else type_name(a) for a in args)
    if origin is tuple and args and Ellipsis not in args:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    if origin in (list, tuple, set, frozenset):
        inner = ", ".join(type_name(a) for a in args if a is not Ellipsis)
        return f"list of {inner}" if inner else "list"
    if origin is dict:
        return "table"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f'`"{m.value}"`' for m in annotation)
    names = {str: "string", int: "integer", float: "float", bool: "boolean"}
    if annotation in names:
        return names[annotation]
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _models_in(annotation: Any) -> list[type]:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def _default(field: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "its defaults"
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        value = value.value
    return "`" + ("true" if value is True else "false" if value is False else repr(value).replace("'", '"')) + "`"


def anchor(cls: type) -> str:
    return cls.__name__.lower()


def _model_section(cls: type, where: list[str]) -> tuple[str, list[type]]:
    """The section of one config class and the config classes its fields hold."""
    docs, nested = field_docs(cls), []
    rows = ["| key | type | default | what it is |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        models = _models_in(field.annotation)
        nested += models
        kind = " \\| ".join(f"[{m.__name__}](#{anchor(m)})" for m in models) or type_name(field.annotation)
        if models and typing.get_origin(field.annotation) in (list, tuple):
            kind = f"list of {kind}"
        if models and type(None) in typing.get_args(field.annotation):
            kind += " \\| none"
        text = " ".join((docs.get(name) or "").split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {kind} | {_default(field)} | {text} |")
    head = [f"### {cls.__name__}", "", *([f"At {', '.join(sorted(set(where)))}.", ""] if where else [])]
    intro = inspect.cleandoc(cls.__doc__) if cls.__doc__ and cls.__doc__ != _BASE_DOC else ""
    return "\n".join([*head, *([" ".join(intro.split()), ""] if intro else []), *rows, ""]), nested


_BASE_DOC = "Base of every component config: an unknown key is an error, not ignored."


def config_reference() -> str:
    """The page: each top-level config, then every config class reachable from them."""
    import importlib

    out = ["# Configuration reference", "",
           "Generated from the config models at every docs build: each key's type, default and the "
           "text written beside it in the code. A recipe is TOML; `--set key=value` sets any key by its "
           "dotted path (`--set rl.trainer.lr=2e-5`). An unknown key, or a value of the wrong type, is an "
           "error that names the key.", "", "## Top-level configs", ""]
    order: list[type] = []
    where: dict[type, list[str]] = {}
    for what, module, name in RECIPES:
        cls = getattr(importlib.import_module(module), name)
        out.append(f"- {what}: [{name}](#{anchor(cls)})")
        where.setdefault(cls, [])
        order.append(cls)
    out += ["", "## Every config", ""]
    done: set[type] = set()
    while order:
        cls = order.pop(0)
        if cls in done:
            continue
        done.add(cls)
        section, nested = _model_section(cls, where.get(cls, []))
        out.append(section)
        for model in nested:
            holders = [f"`{f}` of {cls.__name__}" for f, fld in cls.model_fields.items()
                       if model in _models_in(fld.annotation)]
            where.setdefault(model, []).extend(holders)
            order.append(model)
    return "\n".join(out).rstrip() + "\n"


# --- the CLI reference ---------------------------------------------------------------------

def _commands(command: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    found = [(path, command)]
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            found += _commands(sub, (*path, name))
    return found


def _option_row(param: Any, ctx: typer.Context) -> str:
    names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts]) or f"`{param.name.upper()}`"
    shown = param.display_type(ctx).strip("<>")      # typer's own name of the type: "int range", "bwrap|local"
    if getattr(param, "is_flag", False):
        kind = "flag"
    elif "|" in shown:
        kind = " \\| ".join(f"`{c}`" for c in shown.split("|"))
    else:
        kind = shown.removesuffix(" range")
        inner = kind[5:-1] if kind.startswith("list[") else None
        kind = {"str": "text", "Path": "path"}.get(inner or kind, inner or kind) + (", repeatable" if inner else "")
    default = param.default.value if isinstance(param.default, enum.Enum) else param.default
    default = "required" if param.required else (
        "—" if default in (None, (), [], False) or callable(default) else f"`{default}`")
    help_text = " ".join((getattr(param, "help", None) or "").split()).replace("|", "\\|")
    return f"| {names} | {kind} | {default} | {help_text} |"


def _usage(line: str) -> str:
    """A usage line with its arguments in capitals, as the terminal's help writes them (pure)."""
    return re.sub(r"[{\[]([a-z_]+)[}\]]", lambda m: ("[" if m.group(0)[0] == "[" else "") + m.group(1).upper()
                  + ("]" if m.group(0)[0] == "[" else ""), line)


def _slug(title: str) -> str:
    """The anchor Markdown's table of contents gives a heading (pure)."""
    return re.sub(r"[^a-z0-9-]", "", title.lower().replace(" ", "-"))


def cli_reference() -> str:
    """The page: one section per command, groups first, as `--help` shows them."""
    from typer.main import get_command

    from atelier.cli.main import app

    out = ["# CLI reference", "", "Generated from the `atelier` command at every docs build; `atelier COMMAND "
           "--help` says the same in the terminal.", ""]
    for path, command in _commands(get_command(app), ("atelier",)):
        title = " ".join(path)
        out += [f"## {title}", "", *(p + "\n" for p in (command.help or "").split("\n\n"))]
        ctx = typer.Context(command, info_name=path[-1])
        usage = _usage(command.get_usage(ctx).removeprefix("Usage: ").strip())
        out += ["```", " ".join(path[:-1] + (usage,)), "```", ""]
        params = [p for p in command.params if p.name != "help" and not getattr(p, "hidden", False)]
        if params:
            out += ["| argument or option | type | default | what it does |", "|---|---|---|---|",
                    *(_option_row(p, ctx) for p in params), ""]
        if hasattr(command, "commands"):
            subs = [name for name, sub in command.commands.items() if not sub.hidden]
            out += ["Commands: " + ", ".join(f"[{name}](#{_slug(f'{title} {name}')})" for name in subs), ""]
    return "\n".join(out).rstrip() + "\n"
