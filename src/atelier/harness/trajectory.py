"""The record of one agent episode, token-exact.

A trajectory is a list of *segments*. A segment is one growing token buffer:
the prompt, then every model turn's sampled tokens appended verbatim, then
each tool observation's tokens appended, and so on. Sampled tokens carry
`loss_mask=1`, their sampler logprob and the policy version that produced
each of them; prompt and tool-output tokens carry `loss_mask=0`, logprob 0.0
and version -1. Earlier tokens are never re-tokenized, so what the trainer
sees is exactly what was sampled. When the context is rebuilt (a
self-summary), a new segment starts; the chain of segments is one trajectory
and every segment receives the episode's reward.

`messages` keeps the same conversation as chat messages (for display,
the report's viewer, SFT data and chat-only backends).

MoE router replay: when the sampler returns the experts it chose
(`Generation.routes`), a segment keeps them in `routes`, one row per token
(a compact uint8/uint16 array [tokens, MoE layers, k]; the type's largest
value = no record). The rule for positions: every position the sampler fed
through the model has its row, prompt and tool-output tokens included (the
engine computes them in its prefill, or finds them with the prefix cache's
keys), since the trainer recomputes every position and each one shapes the
logprobs after it. Tokens the sampler never fed (the last sampled token,
tool output after the last turn) have no record; they precede no sampled
token, so routing them freely changes no trained logprob. When a later turn
reports a different route for a position already recorded (its prefix was
recomputed after a weight update), the first record stays: the tokens
sampled right after that position were computed with it. Saved as JSON, the
array is base64 (`encode_routes`), about L * k bytes per token.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from atelier.fsio import atomic_write
from atelier.inference.routes import decode_routes, encode_routes, merge_routes, pad_routes

NOT_SAMPLED = -1


def changed_lines(diff: str) -> int:
    """Added plus removed lines of a unified diff (file headers not counted): the size of an
    episode's edit, shared by the evaluation records (`diff_lines`) and RL's edit shaping."""
    return sum(1 for line in diff.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---")))


@dataclass
class Segment:
    """One context window's token buffer."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: Any = None             # MoE: packed experts per token (see the module docstring), or None

    def extend_prompt(self, token_ids: list[int]) -> None:
        """Append tokens the model did not sample (prompt, tool output)."""
        self.token_ids.extend(token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([NOT_SAMPLED] * len(token_ids))
        self.routes = pad_routes(self.routes, len(token_ids))   # recorded when the next turn feeds them

    def extend_sampled(self, token_ids: list[int], logprobs: list[float], versions: list[int],
                       routes: Any = None) -> None:
        """Append tokens exactly as the sampler produced them; `routes` (Generation.routes) covers
        the whole segment after them: the prompt the sampler was given and the new tokens."""
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError("sampled tokens, logprobs and versions must have equal lengths")
        self.token_ids.extend(token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        if routes is not None:
            if len(routes) != len(self.token_ids):
                raise ValueError(f"routes cover {len(routes)} tokens, the segment has {len(self.token_ids)}")
            self.routes = merge_routes(self.routes, routes)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class ToolCallRecord:
    """One tool call as the model wrote it and what it returned."""

    turn: int
    name: str
    arguments: dict[str, Any]
    output: str
    ok: bool                       # False: the call was broken (bad JSON, unknown tool, bad args) or failed
    broken: bool = False           # True only for malformed calls (counted for the broken-call penalty)
    duration_s: float = 0.0


@dataclass
class Trajectory:
    task_id: str
    model: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    turns: int = 0
    summaries: int = 0
    # Tokens by kind: "prompt", "completion", "tool_call", "tool_output", "final_message", "summary".
    tokens: dict[str, int] = field(default_factory=dict)
    todos: list[dict[str, Any]] = field(default_factory=list)
    final_diff: str = ""
    exit_reason: str = ""          # "submitted", "max_turns", "max_tokens", "max_context", "wall_time", "error"
    error: str | None = None       # error type and message when the episode ended on an exception
    reward: float | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    limits: dict[str, Any] = field(default_factory=dict)   # the limits this run used (docs/pitfalls.md)
    timings: dict[str, Any] = field(default_factory=dict)
    """Clock readings of the episode, what `atelier.sim` calibrates from: `generate`, one
    [start (Unix time), seconds, context tokens, sampled tokens] per model call
    (`record_generate`); RL's task rollouts add `episode_s` (sandbox, agent and close) and
    `grade_s`, the toy environment `env_s` (its latency)."""

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    @property
    def broken_calls(self) -> int:
        return sum(1 for call in self.tool_calls if call.broken)

    def add_tokens(self, kind: str, count: int) -> None:
        self.tokens[kind] = self.tokens.get(kind, 0) + count

    def record_generate(self, started_unix: float, seconds: float, context_tokens: int, sampled_tokens: int) -> None:
        """One model call's timing (see `timings`)."""
        self.timings.setdefault("generate", []).append(
            [round(started_unix, 4), round(seconds, 5), context_tokens, sampled_tokens])

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, segments=[]))
        data["segments"] = [{**asdict(replace(seg, routes=None)), "routes": encode_routes(seg.routes)}
                            for seg in self.segments]
        data["num_tool_calls"] = self.num_tool_calls
        data["broken_calls"] = self.broken_calls
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trajectory":
        data = {k: v for k, v in data.items() if k not in {"num_tool_calls", "broken_calls"}}
        data["segments"] = [Segment(**{**s, "routes": decode_routes(s.get("routes"))})
                            for s in data.get("segments", [])]
        data["tool_calls"] = [ToolCallRecord(**c) for c in data.get("tool_calls", [])]
        return cls(**data)

    def save(self, path: str | Path) -> Path:
        """Write as JSON through a temporary file, so a crash never leaves half a record."""
        return atomic_write(path, json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Trajectory":
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
