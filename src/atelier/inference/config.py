"""`InferenceConfig`: which engine samples from a local model.

Kept apart from `atelier.inference.models`, which the CLI imports at start-up
and must stay free of pydantic; this module is imported by the configs of the
commands that sample (`[inference]` in train and run recipes) and by
`--engine`/`--vllm` of eval and agent.
"""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import Field

from atelier.config import AtelierConfig, load_config
from atelier.inference.vllm_server import VLLMConfig


class InferenceConfig(AtelierConfig):
    """Which engine samples from a model."""

    engine: Literal["builtin", "vllm"] = "builtin"
    """builtin: atelier's own engine (no extra dependencies; the laptop default). vllm: a vLLM
    server (what GPU users run), from the environment `make vllm-env` builds (see [inference.vllm])."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


def inference_config(engine: str, vllm_sets: Sequence[str] = ()) -> InferenceConfig:
    """The `InferenceConfig` of the CLI's `--engine E --vllm KEY=VALUE ...` (typos fail like recipe keys)."""
    return load_config(InferenceConfig, None, [f"engine={engine}", *(f"vllm.{s}" for s in vllm_sets)])
