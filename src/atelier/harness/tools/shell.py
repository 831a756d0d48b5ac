"""Running commands, keeping a to-do list, and ending the episode."""

from __future__ import annotations

from atelier.harness.errors import Submitted, ToolError
from atelier.harness.tools.base import Tool, ToolContext, cap, obj
from atelier.sandbox.memory import allocation_failed

# Bytecode caches would show up in the final diff as binary files.
QUIET_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
TODO_STATUSES = ["pending", "in_progress", "completed", "cancelled"]


def run_terminal(ctx: ToolContext, command: str, timeout: int | float | None = None) -> str:
    if not command.strip():
        raise ToolError("command is empty")
    limit = min(float(timeout), ctx.config.command_timeout_s) if timeout else ctx.config.command_timeout_s
    res = ctx.sandbox.exec(command, timeout=limit, env=QUIET_ENV)
    budget = ctx.config.output_cap_chars - 200
    out = cap(res.stdout, budget if not res.stderr else budget * 2 // 3)
    err = cap(res.stderr, budget // 3 if res.stdout else budget)
    parts = [f"exit code: {res.exit_code}"]
    if res.timed_out:
        capped = f"; {timeout:g} s was asked for, the limit is {limit:g} s" if timeout and timeout > limit else ""
        parts[0] = f"timed out after {limit:g} s (the command was killed; exit code {res.exit_code}{capped})"
    elif res.oom_killed:
        # The agent's own command used too much memory: its doing, shown to it, not an infra failure.
        parts[0] = (f"exit code: {res.exit_code} (a process was killed for passing the sandbox's "
                    f"memory limit of {ctx.sandbox.config.memory_mb} MiB)")
    elif ctx.sandbox.memory_enforcement != "cgroup" and allocation_failed(res.exit_code, res.stderr):
        # Without a memory cgroup one process's limit is its address space: say so.
        parts[0] = (f"exit code: {res.exit_code} (an allocation may have failed: each process may "
                    f"use at most {ctx.sandbox.config.memory_mb} MiB of address space)")
    if out:
        parts.append(out.rstrip("\n"))
    if err:
        parts.append("[stderr]\n" + err.rstrip("\n"))
    return "\n".join(parts)


def render_todos(todos: list[dict]) -> str:
    marks = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]", "cancelled": "[-]"}
    return "\n".join(f"{marks[t['status']]} {t['content']}" for t in todos) or "(empty)"


def todo_write(ctx: ToolContext, items: list[dict]) -> str:
    ctx.todos[:] = [{"content": item["content"], "status": item.get("status", "pending")} for item in items]
    return "to-do list:\n" + render_todos(ctx.todos)


def submit(ctx: ToolContext, message: str = "") -> str:
    raise Submitted(message)


TODO_ITEM = obj({"content": {"type": "string"}, "status": {"type": "string", "enum": TODO_STATUSES}}, ["content"])

TOOLS = [
    Tool("run_terminal", "Run a shell command in the workspace (no network); returns exit code and output. "
         "`timeout` in seconds.",
         obj({"command": {"type": "string"}, "timeout": {"type": "number", "minimum": 1}}, ["command"]), run_terminal),
    Tool("todo_write", "Replace the to-do list with `items` (each {content, status}); keep it current.",
         obj({"items": {"type": "array", "items": TODO_ITEM}}, ["items"]), todo_write),
    Tool("submit", "Finish: your changes in the workspace are the result; `message` summarises them.",
         obj({"message": {"type": "string"}}, []), submit),
]
