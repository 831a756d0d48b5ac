"""Parse pytest's JUnit XML into `{node id: status}` (pure, no I/O).

Only the XML counts: whatever a test prints (a fake "PASSED" line, even
XML-looking text) sits escaped inside `<system-out>` and is ignored.

Node ids are rebuilt the way pytest writes them, `path/to/test_x.py::Class::name`:
from the `file` attribute when present (pytest writes it with
`-o junit_family=xunit1`), else by splitting the dotted `classname` at the
module that matches one of `known_files`, else at the first part that looks
like a test class (capitalised), which is a guess.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Iterable, Literal

Status = Literal["passed", "failed", "error", "skipped"]

_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


class JUnitError(ValueError):
    """The result file is not JUnit XML we can read."""


def parse_junit(xml_text: str, known_files: Iterable[str] = ()) -> dict[str, Status]:
    """Map each test case to its status. A test reported twice (a failing
    teardown after a passing call) keeps its worst status."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise JUnitError(f"result file is not valid XML: {exc}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise JUnitError(f"result file's root element is <{root.tag}>, not <testsuites>")
    modules = {_module_of(f): f for f in known_files}
    results: dict[str, Status] = {}
    for case in root.iter("testcase"):
        node = node_id(case.get("classname", ""), case.get("name", ""), case.get("file"), modules)
        status = _status(case)
        old = results.get(node)
        if old is None or _RANK[status] > _RANK[old]:
            results[node] = status
    return results


def node_id(classname: str, name: str, file: str | None = None,
            modules: dict[str, str] | None = None) -> str:
    """pytest's node id for a `<testcase classname=… name=… file=…>`."""
    parts = [p for p in classname.split(".") if p]
    if file:
        file = file.replace("\\", "/")
        module = _module_of(file).split(".")
        if parts[: len(module)] == module:
            return "::".join([file, *parts[len(module):], name])
        # `file` names where an inherited test method is defined, not the
        # module that collected it: fall back to the classname below.
    for i in range(len(parts), 0, -1):  # longest matching module wins
        path = (modules or {}).get(".".join(parts[:i]))
        if path is not None:
            return "::".join([path, *parts[i:], name])
    classes = _classes_guess(parts)
    module = parts[: len(parts) - len(classes)]
    path = "/".join(module) + ".py" if module else ""
    return "::".join([p for p in (path, *classes, name) if p])


def _classes_guess(parts: list[str]) -> list[str]:
    for i, part in enumerate(parts):
        if i > 0 and part[:1].isupper():
            return parts[i:]
    return []


def _module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def _status(case: ET.Element) -> Status:
    tags = {child.tag for child in case}
    if "error" in tags:
        return "error"
    if "failure" in tags:
        return "failed"
    if "skipped" in tags:
        return "skipped"
    return "passed"
