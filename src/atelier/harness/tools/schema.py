"""Strict checking of tool arguments: `jsonschema`, with messages the model can act on.

Training uses stricter argument checks than a lenient deployment would
(REFERENCE: the harness), so nothing is coerced: an unknown argument, a
missing required one or a wrong type is a broken call, and the message says
exactly what was wrong and what was expected. Validation is jsonschema's
(the schema's own draft; `additionalProperties: false` is added to every
object that does not say otherwise); only the wording is ours, because the
model reads it: "unknown argument 'file' (expected: path, start_line)"
rather than "Additional properties are not allowed ('file' was unexpected)".

Cost: a validator is built once per schema; a check is a small part of the
harness's per-call budget (docs/log/2026-12-03-figures-from-the-code.md;
`benchmarks/harness.py` measures the whole).
"""

from __future__ import annotations

import threading
from typing import Any

import jsonschema


def _json_type(value: Any) -> str:
    for name, types in (("boolean", bool), ("integer", int), ("number", float), ("string", str),
                        ("array", list), ("object", dict)):
        if isinstance(value, types):
            return name
    return "null" if value is None else type(value).__name__


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with `additionalProperties: false` on every object that does not set it."""
    out = dict(schema)
    if out.get("type") == "object":
        out.setdefault("additionalProperties", False)
        out["properties"] = {k: _strict(v) for k, v in out.get("properties", {}).items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"])
    return out


_validators: dict[int, tuple[dict[str, Any], Any]] = {}
_lock = threading.Lock()


def _validator(schema: dict[str, Any]) -> Any:
    """One validator per schema object (tool schemas live as long as the process)."""
    with _lock:
        hit = _validators.get(id(schema))
        if hit is None or hit[0] is not schema:  # the schema kept alive, so its id is not reused
            strict = _strict(schema)
            base = jsonschema.validators.validator_for(strict)
            # Nothing coerced: 3.0 is not an integer argument (JSON Schema says it is).
            cls = jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine(
                "integer", lambda checker, v: isinstance(v, int) and not isinstance(v, bool)))
            hit = (schema, cls(strict))
            _validators[id(schema)] = hit
        return hit[1]


def _place(path: list[Any], where: str) -> str:
    """`arguments`, `status`, `items[0].status`: the place the model wrote a value."""
    out = where
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = part if out == "arguments" else f"{out}.{part}"
    return out


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeio' else 'a'} {kind}"


def _messages(error: Any, where: str) -> list[str]:
    place, value, kind = _place(list(error.absolute_path), where), error.instance, error.validator
    if kind == "type":
        return [f"{place} must be {_a(error.validator_value)}, got {_json_type(value)}"]
    if kind == "enum":
        return [f"{place} must be one of {', '.join(map(repr, error.validator_value))}, got {value!r}"]
    if kind == "minimum":
        return [f"{place} must be >= {error.validator_value}, got {value}"]
    if kind == "additionalProperties":
        props = error.schema.get("properties", {})
        return [f"unknown argument {key!r} (expected: {', '.join(props) or 'none'})" if place == "arguments"
                else f"unknown argument {place}.{key}" for key in value if key not in props]
    if kind == "required":  # one error per missing key; `check` drops the repeats
        return [f"missing required argument {key!r}" if place == "arguments" else f"{place} is missing {key!r}"
                for key in error.validator_value if key not in value]
    return [f"{place}: {error.message}"]


_ORDER = {"type": 0, "enum": 1, "minimum": 2, "additionalProperties": 3, "required": 4}


def check(schema: dict[str, Any], value: Any, where: str = "arguments") -> list[str]:
    """Every problem of `value` against `schema`, each naming its place; [] when valid.

    Order: a place before the places inside it; at one place, its type (which
    alone is reported when wrong), then enum, minimum, unknown and missing keys."""
    errors = list(_validator(schema).iter_errors(value))
    mistyped = {tuple(e.absolute_path) for e in errors if e.validator == "type"}
    errors = [e for e in errors if e.validator == "type" or tuple(e.absolute_path) not in mistyped]
    errors.sort(key=lambda e: (len(e.absolute_path), [str(p) for p in e.absolute_path],
                               _ORDER.get(e.validator, 9)))
    return list(dict.fromkeys(message for e in errors for message in _messages(e, where)))


def signature(name: str, schema: dict[str, Any]) -> str:
    """`read_file(path: string, start_line?: integer)`: the call's shape in one line."""
    required = set(schema.get("required", []))
    parts = [f"{key}{'' if key in required else '?'}: {sub.get('type', 'any')}"
             for key, sub in schema.get("properties", {}).items()]
    return f"{name}({', '.join(parts)})"
