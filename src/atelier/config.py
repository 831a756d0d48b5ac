"""Recipes: TOML files plus `--set key=value` overrides, validated by pydantic.

Each component declares its options as a pydantic model next to its code
(`class TrainerConfig(AtelierConfig)`), and a run is composed from a short
TOML recipe in `recipes/`. Typos must fail loudly and usefully, so unknown
keys are forbidden and every validation problem becomes a `ConfigError` that
names the full dotted key and what it accepts, instead of pydantic's raw text.

`dump_config` writes the resolved config back as TOML so that a run directory
records exactly what ran; `load_config(Model, dumped_path, [])` restores it.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from datetime import date, datetime, time
from pathlib import Path
from typing import Any, Sequence, TypeVar

import tomli_w
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticUndefined

from atelier.compat import tomllib
from atelier.errors import AtelierError

M = TypeVar("M", bound=BaseModel)

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


class AtelierConfig(BaseModel):
    """Base of every component config: an unknown key is an error, not ignored."""

    model_config = ConfigDict(extra="forbid")


class ConfigError(AtelierError):
    """A recipe or override that cannot become a valid config."""


def load_config(model_cls: type[M], path: str | Path | None, overrides: Sequence[str] = ()) -> M:
    """Read the recipe at `path` (none: start empty), apply `overrides`, validate.

    Overrides are applied in order, so a later `--set` wins over an earlier one
    and both win over the file.
    """
    data = read_recipe(path) if path is not None else {}
    origins: dict[str, str] = {}  # dotted key -> the --set that wrote it
    for text in overrides:
        keys, value = parse_override(text)
        _set_path(data, keys, value)
        origins[".".join(keys)] = text
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise _from_validation(model_cls, exc, path, origins) from None


def read_recipe(path: str | Path) -> dict[str, Any]:
    """Parse a TOML recipe, turning file and syntax problems into `ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise ConfigError(f"recipe file not found: {path}{where}", _missing_hint(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read recipe {path}: {exc}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _from_toml_error(path, text, exc) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (["a", "b", "c"], parsed value).

    The value is read as a TOML value when it is one (`3e-4`, `true`, `"x"`,
    `[1, 2]`, `{a = 1}`); otherwise it is a plain string (`host`), and a
    bracketed list of bare words (`[a,b]`) is a list of such values. Quote a
    value to force a string: `name='"true"'`.
    """
    key, sep, raw = text.partition("=")
    keys = [part.strip() for part in key.split(".")]
    if not sep or not all(_BARE_KEY.match(part) for part in keys):
        raise ConfigError(
            f"bad override {text!r}: expected the form key=value with a dotted key",
            hint="e.g. --set trainer.lr=3e-4 or --set tasks.names=[a,b]",
        )
    return keys, _parse_value(raw.strip())


def dump_config(model: BaseModel) -> str:
    """Write `model` as TOML for a run directory to keep.

    Fields that are None are left out (TOML has no null), so reloading the dump
    gives the same model when those fields default to None.
    """
    data = model.model_dump(mode="json", exclude_none=True)
    try:
        return tomli_w.dumps(data)
    except (TypeError, ValueError) as exc:  # a None inside a list, an object JSON mode left as is
        raise ConfigError(f"cannot write the config as TOML: {exc}", hint="TOML has no null") from exc


# --- overrides -------------------------------------------------------------
def _parse_value(raw: str) -> Any:
    if "\n" in raw:  # never let one --set smuggle in more TOML lines
        return raw
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if raw.startswith("[") and raw.endswith("]"):
            return [_parse_value(item) for item in _split_items(raw[1:-1])]
        return raw
    return raw if isinstance(value, (date, time, datetime)) else value  # pydantic parses dates


def _split_items(inner: str) -> list[str]:
    """Split on commas that are not inside brackets, braces or quotes."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(inner):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(inner[start:i])
            start = i + 1
    items.append(inner[start:])
    return [item.strip() for item in items if item.strip()]


def _set_path(data: dict[str, Any], keys: list[str], value: Any) -> None:
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            section = ".".join(keys[: i + 1])
            message = f"cannot set '{'.'.join(keys)}': '{section}' is a value, not a section"
            raise ConfigError(message, hint=f"set it directly, e.g. --set {section}=...")
        node = child
    node[keys[-1]] = value


# --- error messages --------------------------------------------------------
def _missing_hint(path: Path) -> str:
    names = [p.name for p in path.parent.glob("*.toml")] if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.name, names, n=1)
    if close:
        return f"did you mean {path.parent / close[0]}?"
    return "check the path, or create the file (recipes live in recipes/*.toml)"


def _from_toml_error(path: Path, text: str, exc: Exception) -> ConfigError:
    found = re.search(r"line (\d+)", str(exc))  # tomllib says "(at line 3, column 6)"
    line = int(found.group(1)) if found else 0
    lines = text.splitlines()
    where = f"{path}:{line}" if line else str(path)
    shown = f"\n  {line} | {lines[line - 1]}" if 0 < line <= len(lines) else ""
    return ConfigError(
        f"malformed TOML in {where}: {exc}{shown}",
        hint='fix the syntax there; strings need quotes, e.g. network = "host"',
    )


def _from_validation(
    model_cls: type[BaseModel], exc: ValidationError, path: str | Path | None,
    origins: dict[str, str],
) -> ConfigError:
    messages, hints = [], []
    for err in exc.errors():
        key, parent = _walk(model_cls, err)
        message, hint = _describe(err, key, parent)
        messages.append(message + _origin(key, path, origins))
        if hint and hint not in hints:
            hints.append(hint)
    text = messages[0] if len(messages) == 1 else (
        f"{len(messages)} problems in the config:\n  - " + "\n  - ".join(messages))
    return ConfigError(text, hint="; ".join(hints) or None)


def _describe(err: Any, key: str, parent: Any) -> tuple[str, str | None]:
    kind, got = err["type"], err.get("input")
    if kind == "extra_forbidden":
        allowed = [field.alias or name for name, field in _fields(parent).items()]
        close = difflib.get_close_matches(key.rsplit(".", 1)[-1], allowed, n=1)
        level = f"'{key.rpartition('.')[0]}'" if "." in key else "the top level"
        message = f"unknown key '{key}'; allowed keys at {level}: {', '.join(allowed) or '(none)'}"
        return message, (f"did you mean '{close[0]}'?" if close else None)
    if kind == "missing":
        how = "add it to the recipe" + ("" if "[" in key else f" or pass --set {key}=VALUE")
        return f"missing required key '{key}'", how
    if kind in ("literal_error", "enum"):
        allowed = err["ctx"]["expected"]  # pydantic's own list: "'a', 'b' or 'c'"
        close = difflib.get_close_matches(str(got), re.findall(r"'([^']*)'", allowed), n=1)
        message = f"invalid value {got!r} for '{key}'; allowed values: {allowed}"
        return message, (f"did you mean '{close[0]}'?" if close else None)
    shown = f"{got!r} " if not isinstance(got, (dict, list)) or len(repr(got)) <= 80 else ""
    return f"invalid value {shown}for '{key}': {err['msg'].removeprefix('Value error, ')}", (
        None if kind == "value_error" else _fix(key, parent))  # a validator's own message says the fix


def _fix(key: str, parent: Any) -> str | None:
    """How to write `key` right: a section's form, or its default as an example value.
    (Named `_fix`, not a hint per pydantic error type: the default shows type and range at once.)"""

    field = _fields(parent).get(key.rsplit(".", 1)[-1])
    if field is None:
        return None
    if any(_fields(m) for m in _members(field.annotation)):
        return f"'{key}' is a section: write [{key}] in the recipe, or --set {key}.KEY=VALUE"
    if field.default is PydanticUndefined and field.default_factory is None:
        return None
    try:
        example = json.dumps(field.get_default(call_default_factory=True))
    except (TypeError, ValueError):
        return None
    return f"set '{key}' to a value like its default, {example}"


def _origin(key: str, path: str | Path | None, origins: dict[str, str]) -> str:
    """Say where the bad value came from: the --set that wrote it, or the file."""
    for written in reversed(origins):  # the last --set on a path is the one that counts
        short, long = sorted((key, written), key=len)  # one must lie inside the other
        if long == short or long.startswith((short + ".", short + "[")):
            return f" (from --set {origins[written]})"
    return f" (in {path})" if path is not None else ""


def _walk(model_cls: type[BaseModel], err: Any) -> tuple[str, Any]:
    """Follow pydantic's error location through the model's annotations.

    Returns the dotted key (list indices as `[i]`) and the annotation that
    holds the last key (a model, whose fields an unknown key is told about).
    Inside a union pydantic puts a member's name or tag in the location; that
    picks the member and is not a key.
    """
    key, parent, members, loc = "", None, [model_cls], err["loc"]
    for i, part in enumerate(loc):
        # A smart union names the member in the location; a discriminated one, its tag.
        named = [m for m in members if getattr(m, "__name__", None) == part or any(
            part in typing.get_args(f.annotation) for f in _fields(m).values())]
        holders = [m for m in members if part in _fields(m)]
        unknown_key = i == len(loc) - 1 and err["type"] == "extra_forbidden"
        if len(members) > 1 and (named or not (holders or unknown_key)):
            members = _members(named[0]) if named else members
            continue
        parent = (holders or members)[0]
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
        members = _members(_child(parent, part))
    return key, parent


def _child(annotation: Any, part: Any) -> Any:
    """The annotation of `part` (a field name, list index or dict key) inside `annotation`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, set, frozenset, tuple) and args and isinstance(part, int):
        items = [a for a in args if a is not Ellipsis]
        return items[min(part, len(items) - 1)]
    if origin is dict and len(args) == 2:
        return args[1]
    field = _fields(annotation).get(part)
    return field.annotation if field is not None else None


def _members(annotation: Any) -> list[Any]:
    """The types a value may have: Annotated and Optional stripped, unions split."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) if a is not type(None) for m in _members(a)]
    return [annotation]


def _fields(annotation: Any) -> dict[str, Any]:
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation.model_fields if is_model else {}
