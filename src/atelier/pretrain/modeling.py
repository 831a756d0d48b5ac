"""Loading models for training and evals; rotary-base scaling; device and precision.

transformers 5 keeps the rotary base in `config.rope_parameters["rope_theta"]`
(4.x had a top-level `config.rope_theta`); `scale_rope_theta` writes whichever
the config uses and rebuilds the model's rotary embedding, whose inverse
frequencies are computed once at construction and would otherwise keep the
old base. The saved config then carries the new base, so a checkpoint loads
with the frequencies it was trained with.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from atelier.inference.models import ModelNotFound, resolve_model


def resolve_model_path(spec: str) -> Path:
    """A model spec (a Hugging Face directory, or a known name pulled into the cache) as a directory."""
    return Path(resolve_model(spec))


def load_model_and_tokenizer(spec: str, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keeps --json output one line; our own logs say what loads
    path = resolve_model_path(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ModelNotFound(f"cannot load a causal LM and tokenizer from {path}: {exc}",
                            hint="the directory needs config.json, weights and tokenizer files") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(config.rope_theta)


def scale_rope_theta(model, factor: float, max_positions: int | None = None) -> float:
    """Multiply the rotary base by `factor` in the config and in the live model; return the new base."""
    config = model.config
    new = rope_theta(config) * factor
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        config.rope_parameters = {**params, "rope_theta": new}
    else:
        config.rope_theta = new
    if max_positions and max_positions > getattr(config, "max_position_embeddings", 0):
        config.max_position_embeddings = max_positions
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is not None:
        device = rotary.inv_freq.device
        base.rotary_emb = type(rotary)(config=config).to(device)
    return new


def autocast(device: str, precision: str):
    """bf16 autocast where asked for (or, with "auto", on a GPU that supports it); else a no-op."""
    import torch

    use_bf16 = precision == "bf16" or (
        precision == "auto" and device == "cuda" and torch.cuda.is_bf16_supported())
    if use_bf16:
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
    return contextlib.nullcontext()
