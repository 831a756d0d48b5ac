"""Options of one agent episode. Every limit here is recorded in the
trajectory (`Trajectory.limits`), so a run says what budget it had."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from atelier.config import AtelierConfig
from atelier.harness.tools import ToolsConfig


class SamplingConfig(AtelierConfig):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of each turn (0: greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling's mass (1: off; RL needs 1)."""
    max_tokens: int = Field(1024, gt=0)
    """Most tokens sampled in one turn."""
    seed: int | None = None
    """Turn t samples with seed + t, so a run is reproducible and turns differ."""


class AgentConfig(AtelierConfig):
    max_turns: int = Field(30, gt=0)
    """Model turns that may act (summary turns are not counted)."""
    max_tokens: int = Field(32768, gt=0)
    """Tokens the model may sample in the whole episode, summaries included."""
    max_context_tokens: int = Field(8192, gt=0)
    """Largest segment (prompt + turns + observations); a turn never samples past it."""
    wall_time_s: float = Field(1800.0, gt=0)
    """Seconds an episode may run, checked between turns."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How each turn is sampled."""
    summary_trigger_tokens: int | None = Field(None, gt=0)
    """Segment length at which the model is asked to summarise and the context
    restarts from the summary; None: never (the episode ends at max_context_tokens)."""
    summary_max_tokens: int = Field(1024, gt=0)
    """Tokens a summary turn may sample."""
    max_summaries: int = Field(8, ge=0)
    """Summaries an episode may make; past them it ends at the context limit."""
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    """The tools' caps and timeouts."""
    observation_role: Literal["user", "tool"] = "user"
    """Chat role of tool results: `user` (with <tool_response> tags) renders in
    every chat template; `tool` for templates with a tool role."""
    native_tools: bool = False
    """Chat backends only: pass the tools as OpenAI `tools` too."""

    def limits(self) -> dict:
        return {"max_turns": self.max_turns, "max_tokens": self.max_tokens,
                "max_context_tokens": self.max_context_tokens, "wall_time_s": self.wall_time_s,
                "summary_trigger_tokens": self.summary_trigger_tokens, "max_summaries": self.max_summaries,
                "turn_max_tokens": self.sampling.max_tokens,
                "command_timeout_s": self.tools.command_timeout_s,
                "output_cap_chars": self.tools.output_cap_chars}
