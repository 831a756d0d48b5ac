"""`InferenceConfig`: which engine samples from a local model.

Kept apart from `atelier.inference.models`, which the CLI imports at start-up
and must stay free of pydantic; this module is imported by the configs of the
commands that sample (`[inference]` in train and run recipes) and by
`--engine`/`--vllm` of eval and agent.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

from pydantic import Field

from atelier.config import AtelierConfig, load_config
from atelier.inference.vllm_server import VLLMConfig


class BuiltinEngineConfig(AtelierConfig):
    """The built-in engine's own settings (`atelier.inference.engine.LocalEngine`)."""

    threads: Optional[int] = Field(None, ge=1)
    """CPU threads of each engine step. None: adapt, per step, between one and torch's thread count
    to what else wants the cores (`atelier.inference.threads`)."""
    compile: Optional[bool] = None
    """Build the decode step's kernels with `torch.compile` (None: where a C++ compiler or a GPU
    is found). False runs the same arithmetic eagerly, slower."""
    speculate: Optional[bool] = None
    """Decode speculatively: draft a few tokens, verify them in one pass. None: where the model has
    MTP heads (mtp.json beside its weights; `atelier mtp attach` trains them), and only while it
    measures faster than plain decoding; True: with whatever the model has (lookup drafts alone on
    a model without heads); False: never."""
    lookup: bool = True
    """Where speculating, draft by prompt lookup too: the tokens that followed the context's last
    few tokens where they occurred before (an agent's turns quote files and tool outputs). Free
    to draft, preferred to the heads where it finds a repeat."""
    speculate_max_batch: int = Field(16, ge=1)
    """No speculation above this many running sequences (a large batch on a CPU gains nothing)."""


class InferenceConfig(AtelierConfig):
    """Which engine samples from a model."""

    engine: Literal["builtin", "vllm"] = "builtin"
    """builtin: atelier's own engine (no extra dependencies; the laptop default). vllm: a vLLM
    server (what GPU users run), from the environment `make vllm-env` builds (see [inference.vllm])."""
    builtin: BuiltinEngineConfig = Field(default_factory=BuiltinEngineConfig)
    """The built-in engine's settings (engine = "builtin")."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """How atelier runs or reaches a vLLM server (engine = "vllm")."""


def inference_config(engine: str, vllm_sets: Sequence[str] = (), speculate: bool | None = None) -> InferenceConfig:
    """The `InferenceConfig` of the CLI's `--engine E --vllm KEY=VALUE ... [--speculate]` (typos fail
    like recipe keys)."""
    builtin = [] if speculate is None else [f"builtin.speculate={str(speculate).lower()}"]
    return load_config(InferenceConfig, None, [f"engine={engine}", *(f"vllm.{s}" for s in vllm_sets), *builtin])
