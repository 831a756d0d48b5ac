"""Tool-call parsing: good, malformed, several per turn, native calls."""

from __future__ import annotations

from atelier.harness.errors import FormatError
from atelier.harness.parsing import ToolCall, format_call, parse_native_calls, parse_tool_calls


def test_one_good_call_and_prose():
    turn = parse_tool_calls('I will read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
                            "</tool_call>")
    assert [(c.name, c.arguments) for c in turn.calls] == [("read_file", {"path": "a.py"})]
    assert turn.prose == "I will read it." and not turn.errors


def test_several_calls_in_order_with_errors_in_place():
    text = (format_call("read_file", {"path": "a"}) + "\n<tool_call>{'name': 'x'}</tool_call>\n"
            + format_call("grep", {"pattern": "b"}))
    items = parse_tool_calls(text).items
    assert [type(i) for i in items] == [ToolCall, FormatError, ToolCall]
    assert items[0].name == "read_file" and items[2].name == "grep"
    assert "not valid JSON" in items[1].message and items[1].raw.startswith("<tool_call>")


def test_malformed_blocks_each_say_what_is_wrong():
    cases = {
        "<tool_call>[1, 2]</tool_call>": "must be a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': 'no "name"',
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>': "must be a JSON object",
        '<tool_call>{"name": "a", "args": {}}</tool_call>': "unexpected keys ['args']",
        '<tool_call>{"name": "a", "arguments": {}}': "is not closed",
        '{"name": "a"}</tool_call>': "without a matching",
        '<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>': "not a JSON object",
    }
    for text, expected in cases.items():
        turn = parse_tool_calls(text)
        assert not turn.calls, text
        assert len(turn.errors) == 1 and expected in turn.errors[0].message, (text, turn.errors[0].message)


def test_unclosed_block_does_not_swallow_the_next_call():
    text = '<tool_call>{"name": "a"}\n' + format_call("submit", {})
    items = parse_tool_calls(text).items
    assert isinstance(items[0], FormatError) and isinstance(items[1], ToolCall) and items[1].name == "submit"


def test_lenient_forms_models_commonly_write():
    fenced = parse_tool_calls('<tool_call>\n```json\n{"name": "submit", "arguments": {}}\n```\n</tool_call>')
    assert fenced.calls[0].name == "submit"
    no_args = parse_tool_calls('<tool_call>{"name": "list_dir"}</tool_call>')
    assert no_args.calls[0].arguments == {}
    encoded = parse_tool_calls('<tool_call>{"name": "glob", "arguments": "{\\"pattern\\": \\"*.py\\"}"}</tool_call>')
    assert encoded.calls[0].arguments == {"pattern": "*.py"}


def test_no_calls_is_an_empty_turn():
    turn = parse_tool_calls("I think the answer is 42.")
    assert turn.items == [] and turn.prose == "I think the answer is 42."


def test_native_openai_calls():
    turn = parse_native_calls([
        {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
        {"name": "submit", "arguments": {"message": "ok"}},
        {"id": "call_3", "function": {"name": "grep", "arguments": "{bad"}},
    ], text="reading")
    assert [(c.id, c.name, c.arguments) for c in turn.calls] == [
        ("call_1", "read_file", {"path": "a.py"}), ("native_1", "submit", {"message": "ok"})]
    assert len(turn.errors) == 1 and turn.prose == "reading"
