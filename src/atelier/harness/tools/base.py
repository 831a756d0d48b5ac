"""The tools' common ground: the `Tool` type, the per-episode `ToolContext`, the caps of
`ToolsConfig`, argument helpers, and `call_tool`, the one calling convention (see
`atelier.harness.tools`)."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import Field

from atelier.config import AtelierConfig
from atelier.harness.errors import FormatError, ToolError
from atelier.harness.tools.schema import check, signature
from atelier.sandbox.base import Sandbox, SandboxPathError, workspace_relpath


class ToolsConfig(AtelierConfig):
    """Caps that keep observations small and commands bounded."""

    output_cap_chars: int = Field(8000, gt=100)
    """Longest observation; longer ones keep their head and tail with a marker."""
    command_timeout_s: float = Field(60.0, gt=0)
    """Default and maximum wall-clock limit of one `run_terminal` command."""
    read_max_lines: int = Field(400, gt=0)
    """Lines `read_file` shows when no range is given."""
    grep_max_matches: int = Field(100, gt=0)
    """Matches `grep` shows at most."""
    list_max_entries: int = Field(300, gt=0)
    """Entries `list_dir` shows at most."""
    search_max_results: int = Field(8, gt=0)
    """Results `codebase_search` returns at most."""
    recent_files: int = Field(10, ge=0)
    """How many recently viewed or edited files the prompt lists after a summary."""


@dataclass
class ToolContext:
    sandbox: Sandbox
    config: ToolsConfig = field(default_factory=ToolsConfig)
    todos: list[dict[str, Any]] = field(default_factory=list)
    recent: "OrderedDict[str, str]" = field(default_factory=OrderedDict)  # path -> "viewed" | "edited"
    cache: dict[str, Any] = field(default_factory=dict)

    def touch(self, path: str, how: str) -> None:
        """Remember that `path` was viewed or edited (an edit is never downgraded)."""
        how = "edited" if self.recent.get(path) == "edited" else how
        self.recent.pop(path, None)
        self.recent[path] = how
        while len(self.recent) > max(self.config.recent_files, 1) * 4:
            self.recent.popitem(last=False)

    def recent_files(self) -> list[tuple[str, str]]:
        items = list(self.recent.items())[::-1]
        return items[: self.config.recent_files]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str]

    @property
    def signature(self) -> str:
        return signature(self.name, self.parameters)

    def openai_schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def rel(path: str) -> str:
    """A model-given path as one relative to the workspace; a bad one is a ToolError."""
    try:
        return workspace_relpath(path)
    except SandboxPathError as exc:
        raise ToolError(str(exc)) from None


def in_workspace(path: str) -> str:
    """A workspace-relative path for a command's argv. Commands start in the
    workspace root on every backend (which may not be mounted at /workspace),
    and the ./ prefix keeps a name like "-rf" from reading as an option."""
    return f"./{path}" if path else "."


def cap(text: str, limit: int) -> str:
    """Keep the head and tail of an over-long observation, saying how much was cut."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n... [{len(text) - head - tail} characters cut] ...\n{text[-tail:]}"


@dataclass
class ToolOutcome:
    output: str
    ok: bool
    duration_s: float


def call_tool(tools: dict[str, Tool], ctx: ToolContext, name: str, arguments: Any) -> ToolOutcome:
    """Check and run one call. Raises `FormatError` for an unknown tool or bad
    arguments (a broken call) and lets `Submitted` through; a `ToolError` or
    a sandbox path error becomes a failed outcome."""
    tool = tools.get(name)
    if tool is None:
        raise FormatError(f"unknown tool {name!r}; available tools: {', '.join(tools)}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise FormatError(f"arguments of {name} are not valid JSON: {exc}") from None
    problems = check(tool.parameters, arguments)
    if problems:
        raise FormatError(f"bad arguments for {name}: {'; '.join(problems)}. Expected {tool.signature}")
    start = time.perf_counter()
    try:
        output, ok = tool.fn(ctx, **arguments), True
    except (ToolError, SandboxPathError) as exc:
        output, ok = f"error: {exc}", False
    return ToolOutcome(cap(output, ctx.config.output_cap_chars), ok, time.perf_counter() - start)
