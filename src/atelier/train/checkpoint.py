"""Weights out of the ranks: the full state dict gathered on rank 0 (for publishing to
inference and for Hugging Face checkpoints), and model and optimizer state written and
read with `torch.distributed.checkpoint`, each rank its own shards.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from atelier.train.ranks import Ranks


def full_state_dict(module: nn.Module, ranks: Ranks, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0, on the CPU (empty on other ranks).

    Collective when sharded: every rank must call it.
    """
    if ranks.sharded:
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def save_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state with torch.distributed.checkpoint: each rank writes its shards."""
    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_sharded(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read what `save_sharded` wrote into `module` and `optimizer` (each rank its shards)."""
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
