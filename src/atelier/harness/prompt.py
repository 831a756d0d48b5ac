"""What the model is shown: the prompt of a segment and the observations.

A segment's prompt is two messages. The system message holds the
instructions, the tool-call format specification and every tool's JSON
schema. The user message holds the context — recent file information
(files viewed or edited recently), past user messages, after a
self-summary the summary and the state (to-do list, number of earlier
summaries) — and then the current task. Nothing here depends on the
backend: token-exact rendering happens in `atelier.harness.context`.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from atelier.harness.parsing import CLOSE, OPEN, format_call
from atelier.harness.tools import Tool
from atelier.harness.tools.shell import render_todos

INSTRUCTIONS = """You are a software engineering agent working in a repository at /workspace.
Solve the user's task by reading the code, editing files and running commands with the tools below.
Work in small steps: look before you edit, run the relevant tests after editing, and keep the to-do list current
on longer tasks. Paths are relative to the workspace. There is no network access.
When the task is done, call submit with a short message that says what you changed."""

FORMAT = f"""# Tool calls
Call a tool by writing a JSON object inside {OPEN} {CLOSE} tags:
{format_call("read_file", {"path": "src/app.py", "start_line": 1, "end_line": 40})}
You may write several calls in one turn; they run in order and each result comes back inside
<tool_response> tags. Arguments must match the schema exactly: unknown, missing or wrongly typed arguments
are rejected. Every turn must contain at least one tool call until you call submit."""

SUMMARY_REQUEST = """Your context is nearly full. Write a summary that lets you continue the task from it alone:
what the task is, what you have found (files, functions, causes), what you have changed so far, what is left to do
and what you were about to do next. Write plain text, at most about 500 words, with no tool calls."""


def system_message(tools: dict[str, Tool]) -> str:
    schemas = "\n".join(json.dumps(t.openai_schema()["function"], ensure_ascii=False) for t in tools.values())
    return f"{INSTRUCTIONS}\n\n{FORMAT}\n\n# Tools\n{schemas}"


def user_message(task: str, *, recent_files: Sequence[tuple[str, str]] = (), past_messages: Sequence[str] = (),
                 summary: str | None = None, todos: Sequence[dict[str, Any]] = (), summaries: int = 0) -> str:
    parts = []
    if recent_files:
        lines = "\n".join(f"- {path} ({how})" for path, how in recent_files)
        parts.append(f"<recent_files>\nFiles viewed or edited recently, most recent first:\n{lines}\n</recent_files>")
    if past_messages:
        lines = "\n".join(f"- {m}" for m in past_messages)
        parts.append(f"<past_user_messages>\n{lines}\n</past_user_messages>")
    if summary is not None:
        parts.append(f"<summary number=\"{summaries}\">\nThe context was reset {summaries} time(s). "
                     f"Your summary of the work so far:\n{summary}\n</summary>")
    if todos:
        parts.append(f"<todo_list>\n{render_todos(list(todos))}\n</todo_list>")
    parts.append(f"<task>\n{task}\n</task>")
    return "\n\n".join(parts)


def build_messages(tools: dict[str, Tool], task: str, **context: Any) -> list[dict[str, Any]]:
    """The two messages a segment starts from; `context` as for `user_message`."""
    return [{"role": "system", "content": system_message(tools)},
            {"role": "user", "content": user_message(task, **context)}]


def tool_response(name: str, output: str, ok: bool) -> str:
    return f'<tool_response name="{name}" status="{"ok" if ok else "error"}">\n{output}\n</tool_response>'
