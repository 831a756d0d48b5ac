"""Option types shared by several commands (typer only: imported at start-up)."""

from __future__ import annotations

import enum


class Backend(str, enum.Enum):
    """Where commands run: `bwrap` isolates; `local` isolates nothing."""

    bwrap = "bwrap"
    local = "local"


class Engine(str, enum.Enum):
    """Which engine samples from a local model: atelier's own, or a vLLM server."""

    builtin = "builtin"
    vllm = "vllm"


ENGINE_HELP = "builtin (atelier's engine) or vllm (a vLLM server from `make vllm-env`)."
VLLM_HELP = "A vLLM option, e.g. --vllm tensor_parallel_size=2 or --vllm url=http://host:8000 (repeatable)."
RUN_DIR_HELP = ("The run directory (default: runs/<recipe name>). Run the same command again to continue "
                "the run it holds; with no recipe, the run continues with the config it began with.")
SET_HELP = "Override a recipe key, e.g. --set {example} (repeatable)."
