"""Typed exceptions that end or steer the agent loop (mini-swe-agent style).

`Submitted` and `LimitsExceeded` end an episode; `FormatError` and
`ToolError` become observations the model can act on and never end it.
"""

from __future__ import annotations

from atelier.errors import AtelierError


class AgentStop(Exception):
    """Base of the exceptions that end an episode normally."""

    exit_reason = "stopped"


class Submitted(AgentStop):
    """The model called `submit`; `message` is its final message to the user."""

    exit_reason = "submitted"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class LimitsExceeded(AgentStop):
    """A budget ran out: `kind` is "turns", "tokens", "wall_time" or "context"."""

    _REASONS = {"turns": "max_turns", "tokens": "max_tokens", "wall_time": "wall_time", "context": "max_context"}

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind} limit reached" + (f": {detail}" if detail else ""))
        self.kind = kind
        self.exit_reason = self._REASONS.get(kind, kind)


class FormatError(Exception):
    """A tool call the harness could not read (bad JSON, unknown tool, bad
    arguments, no call at all). Shown to the model; counted as a broken call."""

    def __init__(self, message: str, raw: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.raw = raw


class ToolError(Exception):
    """A well-formed call that failed (missing file, no unique match …): the
    message is the observation, and the call counts as failed, not broken."""


class HarnessError(AtelierError):
    """A user error in setting up an episode (bad model object, bad script)."""
