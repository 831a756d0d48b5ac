"""Strict checking of tool arguments against a small JSON-schema subset.

Training uses stricter argument checks than a lenient deployment would
(REFERENCE: the harness), so nothing is coerced: an unknown argument, a
missing required one or a wrong type is a broken call, and the message says
exactly what was wrong and what was expected. Supported keywords: type
(string, integer, number, boolean, array, object), properties, required,
additionalProperties (false is assumed), items, enum, minimum.
"""

from __future__ import annotations

from typing import Any

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,),
}


def _type_ok(value: Any, expected: str) -> bool:
    if expected in ("integer", "number") and isinstance(value, bool):
        return False  # JSON true is not 1
    return isinstance(value, _PY_TYPES[expected])


def _json_type(value: Any) -> str:
    for name in ("boolean", "integer", "number", "string", "array", "object"):
        if _type_ok(value, name):
            return name
    return "null" if value is None else type(value).__name__


def check(schema: dict[str, Any], value: Any, where: str = "arguments") -> list[str]:
    """Every problem of `value` against `schema`, each naming its place; [] when valid."""
    expected = schema.get("type")
    if expected and not _type_ok(value, expected):
        return [f"{where} must be {'an' if expected[0] in 'aeio' else 'a'} {expected}, got {_json_type(value)}"]
    problems: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where} must be one of {', '.join(map(repr, schema['enum']))}, got {value!r}")
    if "minimum" in schema and _type_ok(value, "number") and value < schema["minimum"]:
        problems.append(f"{where} must be >= {schema['minimum']}, got {value}")
    if expected == "object":
        props = schema.get("properties", {})
        for key in value:
            if key not in props:
                problems.append(f"unknown argument {where}.{key}" if where != "arguments"
                                else f"unknown argument {key!r} (expected: {', '.join(props) or 'none'})")
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"missing required argument {key!r}" if where == "arguments"
                                else f"{where} is missing {key!r}")
        for key, sub in props.items():
            if key in value:
                problems += check(sub, value[key], key if where == "arguments" else f"{where}.{key}")
    if expected == "array" and "items" in schema:
        for i, item in enumerate(value):
            problems += check(schema["items"], item, f"{where}[{i}]")
    return problems


def signature(name: str, schema: dict[str, Any]) -> str:
    """`read_file(path: string, start_line?: integer)`: the call's shape in one line."""
    required = set(schema.get("required", []))
    parts = [f"{key}{'' if key in required else '?'}: {sub.get('type', 'any')}"
             for key, sub in schema.get("properties", {}).items()]
    return f"{name}({', '.join(parts)})"
