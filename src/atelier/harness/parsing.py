"""Reading tool calls out of a model turn.

Hermes style, which most open models were tuned on:

    <tool_call>
    {"name": "read_file", "arguments": {"path": "src/app.py"}}
    </tool_call>

Several blocks per turn are allowed and run in order. Anything malformed
(an unclosed or stray tag, bad JSON, a missing name, arguments that are not
an object) becomes a `FormatError` in its place among the calls, so the
model is told about it and the broken call is counted (a broken call is a
negative sample, never a discarded one). Native OpenAI `tool_calls` from a
chat backend go through `parse_native_calls` into the same shape.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Union

from atelier.harness.errors import FormatError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAG = re.compile(r"</?tool_call>")
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


@dataclass
class ToolCall:
    name: str
    arguments: Any           # a dict once checked; whatever the model wrote until then
    raw: str = ""
    id: str = ""


Item = Union[ToolCall, FormatError]


@dataclass
class ParsedTurn:
    items: list[Item] = field(default_factory=list)  # calls and format errors, in order of appearance
    prose: str = ""          # the text outside tool-call blocks (reasoning, final words)

    @property
    def calls(self) -> list[ToolCall]:
        return [i for i in self.items if isinstance(i, ToolCall)]

    @property
    def errors(self) -> list[FormatError]:
        return [i for i in self.items if isinstance(i, FormatError)]


def call_from_json(body: str, raw: str) -> Item:
    """One call from the JSON between the tags, or the FormatError saying what is wrong."""
    body = _FENCE.sub("", body.strip())
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return FormatError(f"the tool call is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                           'write {"name": "<tool>", "arguments": {...}} with double-quoted keys and strings', raw)
    if not isinstance(data, dict):
        return FormatError('a tool call must be a JSON object {"name": ..., "arguments": {...}}', raw)
    extra = set(data) - {"name", "arguments"}
    if extra:
        return FormatError(f"unexpected keys {sorted(extra)} in the tool call; only name and arguments", raw)
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return FormatError('the tool call has no "name" string', raw)
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return FormatError(f'"arguments" of {name} is a string that is not a JSON object', raw)
    if not isinstance(arguments, dict):
        return FormatError(f'"arguments" of {name} must be a JSON object', raw)
    return ToolCall(name, arguments, raw)


def parse_tool_calls(text: str) -> ParsedTurn:
    turn = ParsedTurn()
    prose: list[str] = []
    pos = 0
    while True:
        m = _TAG.search(text, pos)
        if m is None:
            prose.append(text[pos:])
            break
        prose.append(text[pos:m.start()])
        if m.group() == CLOSE:
            turn.items.append(FormatError(f"{CLOSE} without a matching {OPEN}", m.group()))
            pos = m.end()
            continue
        nxt = _TAG.search(text, m.end())
        if nxt is None or nxt.group() == OPEN:
            end = nxt.start() if nxt else len(text)
            turn.items.append(FormatError(f"{OPEN} is not closed; end each call with {CLOSE}", text[m.start():end]))
            pos = end
            continue
        turn.items.append(call_from_json(text[m.end():nxt.start()], text[m.start():nxt.end()]))
        pos = nxt.end()
    turn.prose = "".join(prose).strip()
    return turn


def parse_native_calls(tool_calls: list[dict[str, Any]], text: str = "") -> ParsedTurn:
    """OpenAI-style calls ({"id", "function": {"name", "arguments"}} or the
    normalised {"name", "arguments"}); Hermes blocks in `text` are read too."""
    turn = parse_tool_calls(text) if text else ParsedTurn()
    for i, call in enumerate(tool_calls):
        fn = call.get("function", call)
        name, arguments = fn.get("name"), fn.get("arguments", {})
        raw = json.dumps({"name": name, "arguments": arguments}, default=str)
        item = call_from_json(raw, raw)
        if isinstance(item, ToolCall):
            item.id = str(call.get("id") or f"native_{i}")
        turn.items.append(item)
    return turn


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """A call written the way the prompt asks the model to write it."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"
