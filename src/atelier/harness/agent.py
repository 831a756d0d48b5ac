"""The agent loop: one code path for `atelier agent`, RL rollouts and benchmarks.

Each turn samples from the model, runs the turn's tool calls in order and
shows their results; typed exceptions end it (`Submitted`, `LimitsExceeded`)
or steer it (`FormatError`: a broken call, shown to the model and counted).
When the segment reaches `summary_trigger_tokens` the model is asked for a
summary and the context restarts from system + task + summary + state.
`run_episode` returns the trajectory with the exit reason and the final
diff filled in; an infrastructure failure (`atelier.failures.is_infra`: the
sandbox died, the engine closed) ends it with exit reason "error" and the
error recorded. Any other exception is a bug and propagates, after the
diff and wall time are filled in.

Token kinds in `Trajectory.tokens`: prompt (each segment's first prompt),
completion (every sampled token), tool_call and thinking (the parts of
action turns inside and outside tool-call blocks), summary (summary turns),
final_message (the submit message), tool_output (observation tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from atelier.failures import is_infra
from atelier.harness.config import AgentConfig
from atelier.harness.context import ContextWindow, Result, Turn, open_window
from atelier.harness.errors import AgentStop, FormatError, LimitsExceeded, Submitted
from atelier.harness.parsing import ToolCall
from atelier.harness.prompt import SUMMARY_REQUEST, build_messages
from atelier.harness.tools import Tool, ToolContext, call_tool, default_tools
from atelier.harness.trajectory import ToolCallRecord, Trajectory
from atelier.inference.types import KnowsContextLength


@dataclass
class Event:
    """What `on_event` receives: kind is "turn", "tool_call", "summary" or "end"."""

    kind: str
    turn: int
    text: str = ""
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    output: str = ""
    ok: bool = True


def run_episode(model: Any, sandbox: Any, prompt: str, *, task_id: str = "", config: AgentConfig | None = None,
                on_event: Callable[[Event], None] | None = None, tools: dict[str, Tool] | None = None,
                past_messages: list[str] | None = None) -> Trajectory:
    """Run one episode of `model` (a `TokenModel`: token-exact segments; or a
    `ChatModel`: messages only) on `prompt` in `sandbox`. The returned
    trajectory says how it ended; only a bug raises (see the module docstring)."""
    config = config or AgentConfig()
    tools = tools or default_tools()
    emit = on_event or (lambda event: None)
    traj = Trajectory(task_id=task_id, model=model.name, limits=config.limits())
    ctx = ToolContext(sandbox, config.tools)
    window = open_window(model, config, traj,
                         [t.openai_schema() for t in tools.values()] if config.native_tools else None)
    # A model that knows its context length (the local engine) bounds the segment too.
    known = model.max_seq_len if isinstance(model, KnowsContextLength) else None
    limit = min(config.max_context_tokens, known or config.max_context_tokens)
    traj.limits["max_context_tokens"] = limit
    started = time.monotonic()
    try:
        window.start(build_messages(tools, prompt, past_messages=past_messages or []))
        while True:
            _check_limits(config, traj, started)
            trigger = config.summary_trigger_tokens
            if (trigger and window.size >= trigger and window.turns_in_segment
                    and traj.summaries < config.max_summaries):
                _summarize(window, tools, ctx, prompt, config, traj, past_messages or [], emit, limit)
            room = min(config.sampling.max_tokens, limit - window.size,
                       config.max_tokens - traj.tokens.get("completion", 0))
            if room <= 0:
                raise LimitsExceeded("context", f"segment holds {window.size} of {limit} tokens")
            turn = window.sample(room, _seed(config, traj.turns))
            traj.turns += 1
            emit(Event("turn", traj.turns, text=turn.text))
            window.observe(_act(turn, tools, ctx, traj, window, emit))
    except AgentStop as stop:
        traj.exit_reason = stop.exit_reason
    except Exception as exc:
        if not is_infra(exc):
            raise  # a bug: the caller's batch edge stops the run (atelier.failures)
        traj.exit_reason, traj.error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        traj.todos = [dict(t) for t in ctx.todos]
        traj.wall_s = time.monotonic() - started
        try:
            traj.final_diff = sandbox.diff()
        except Exception as exc:
            traj.error = traj.error or f"{type(exc).__name__}: cannot read the final diff: {exc}"
        emit(Event("end", traj.turns, text=traj.exit_reason))
    return traj


def _act(turn: Turn, tools: dict[str, Tool], ctx: ToolContext, traj: Trajectory, window: ContextWindow,
         emit: Callable[[Event], None]) -> list[Result]:
    """Run the turn's calls in order; a submit ends the episode after recording it."""
    items = turn.parsed.items or [FormatError(
        "no tool call found; call a tool inside <tool_call></tool_call> tags, or submit when done")]
    call_tokens = sum(window.count(c.raw) for c in turn.parsed.calls)
    traj.add_tokens("tool_call", call_tokens)
    traj.add_tokens("thinking", max(turn.sampled - call_tokens, 0))
    results = []
    for item in items:
        name = item.name if isinstance(item, ToolCall) else ""
        args = item.arguments if isinstance(item, ToolCall) and isinstance(item.arguments, dict) else {}
        record = ToolCallRecord(turn=traj.turns, name=name, arguments=args, output="", ok=False)
        traj.tool_calls.append(record)
        try:
            if isinstance(item, FormatError):
                raise item
            outcome = call_tool(tools, ctx, item.name, item.arguments)
            record.output, record.ok, record.duration_s = outcome.output, outcome.ok, outcome.duration_s
        except FormatError as exc:
            record.output, record.broken = f"error: {exc.message}", True
        except Submitted as done:
            record.output, record.ok = "submitted", True
            traj.add_tokens("final_message", window.count(done.message))
            emit(Event("tool_call", traj.turns, name=name, arguments=args, output=done.message))
            raise
        emit(Event("tool_call", traj.turns, name=name, arguments=args, output=record.output, ok=record.ok))
        results.append(Result(item, record.output, record.ok))
    return results


def _summarize(window: ContextWindow, tools: dict[str, Tool], ctx: ToolContext, prompt: str, config: AgentConfig,
               traj: Trajectory, past_messages: list[str], emit: Callable[[Event], None], limit: int) -> None:
    """Ask for a summary in the current segment, then restart the context from it."""
    window.add_messages([{"role": "user", "content": SUMMARY_REQUEST}])
    room = min(config.summary_max_tokens, limit - window.size,
               config.max_tokens - traj.tokens.get("completion", 0))
    if room <= 0:
        raise LimitsExceeded("context", "no room left to write a summary")
    turn = window.sample(room, _seed(config, 10_000 + traj.summaries))
    traj.summaries += 1
    traj.add_tokens("summary", turn.sampled)
    summary = turn.parsed.prose or turn.text
    emit(Event("summary", traj.turns, text=summary))
    window.start(build_messages(tools, prompt, recent_files=ctx.recent_files(), past_messages=past_messages,
                                summary=summary, todos=ctx.todos, summaries=traj.summaries))


def _check_limits(config: AgentConfig, traj: Trajectory, started: float) -> None:
    if traj.turns >= config.max_turns:
        raise LimitsExceeded("turns", f"{traj.turns} turns")
    if traj.tokens.get("completion", 0) >= config.max_tokens:
        raise LimitsExceeded("tokens", f"{traj.tokens['completion']} tokens sampled")
    if time.monotonic() - started >= config.wall_time_s:
        raise LimitsExceeded("wall_time", f"{config.wall_time_s:g} s")


def _seed(config: AgentConfig, turn: int) -> int | None:
    return None if config.sampling.seed is None else config.sampling.seed + turn
