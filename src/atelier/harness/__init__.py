"""Tools, prompt, tool-call parsing, the agent loop and token-exact trajectories.

Must not import torch: the harness drives any backend through
`atelier.inference.types.TokenModel` or an OpenAI-compatible endpoint.

Modules: `tools` (the registry, `ToolContext`, strict argument checks),
`parsing` (Hermes `<tool_call>` blocks and native calls), `prompt`,
`context` (the token-exact context window), `agent` (`run_episode`),
`config` (`AgentConfig`), `replay` (gold patches as tool calls),
`trajectory` (the record). The names below are imported on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "run_episode": "agent", "Event": "agent", "AgentConfig": "config", "SamplingConfig": "config",
    "Trajectory": "trajectory", "Segment": "trajectory", "ToolCallRecord": "trajectory",
    "default_tools": "tools", "ToolContext": "tools", "ToolsConfig": "tools", "call_tool": "tools",
    "gold_patch_script": "replay", "gold_patch_calls": "replay",
    "Submitted": "errors", "LimitsExceeded": "errors", "FormatError": "errors", "ToolError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'atelier.harness' has no attribute {name!r}")
