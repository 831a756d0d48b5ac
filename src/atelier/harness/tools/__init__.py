"""The agent's tools: one registry, one calling convention, strict arguments.

A tool is a function `fn(ctx, **arguments) -> str` with a JSON schema. The
string is the observation the model sees. A tool signals a failed but
well-formed call with `ToolError` (missing file, no unique match); `submit`
raises `Submitted`. `call_tool` checks the arguments against the schema
before running anything, so a bad call never half-runs.

Tools touch the workspace only through the `Sandbox` contract (`exec`,
`read_file`, `write_file`), so the same code runs over bubblewrap, a plain
subprocess or a remote sandbox. `ToolContext` carries the per-episode state
the tools share: the to-do list, the files viewed or edited recently (for
the prompt's recent-file information) and the search index cache.
"""

from __future__ import annotations

from atelier.harness.tools import edit, files, search, shell
from atelier.harness.tools.base import (
    Tool,
    ToolContext,
    ToolOutcome,
    ToolsConfig,
    call_tool,
    cap,
    in_workspace,
    obj,
    rel,
)

__all__ = ["Tool", "ToolContext", "ToolOutcome", "ToolsConfig", "call_tool", "cap", "default_tools", "in_workspace",
           "obj", "rel"]


def default_tools() -> dict[str, Tool]:
    """The full tool set, by name, in the order the prompt lists them."""
    tools = [*files.TOOLS[:3], *search.TOOLS, edit.TOOL, *files.TOOLS[3:], *shell.TOOLS]
    return {tool.name: tool for tool in tools}
