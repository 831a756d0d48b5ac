"""Option types shared by several commands (typer only: imported at start-up)."""

from __future__ import annotations

import enum


class Backend(str, enum.Enum):
    """Where commands run: `bwrap` isolates; `local` isolates nothing."""

    bwrap = "bwrap"
    local = "local"
