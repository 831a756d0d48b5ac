"""Heads in a Hugging Face model directory: `mtp.safetensors` (their weights) and `mtp.json`.

`mtp.json` says what the heads are for: their count, the base model's type, architectures,
hidden size, vocabulary and layer count, the dtype of the saved tensors, how many training
tokens they have seen, `draft_vocab` (they were distilled on the first that many token ids
only: draft from no more; null: the whole vocabulary), and a free-form `training` record (trunk mode, init, the held-out
repositories of the run that trained them). The weights are named as `MTPHeads.state_dict()`
names them (`heads.0.block.self_attn.q_proj.weight`, ...): each head's block is named like the
base model's layers.

The directory stays a plain Hugging Face model: transformers reads `model.safetensors` and
never looks at `mtp.*`. Loaders that glob every `*.safetensors` file of a directory (vLLM's
default loader does, unless an index names the model's files) would take the heads' tensors
for the model's, so `save_mtp_heads` writes `model.safetensors.index.json` beside a
single-file model that has none; loaders that read an index, transformers included, then see
exactly the model's weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from atelier.fsio import atomic_write
from atelier.mtp.heads import MTPError, MTPHeads

WEIGHTS, META = "mtp.safetensors", "mtp.json"
MODEL_WEIGHTS, MODEL_INDEX = "model.safetensors", "model.safetensors.index.json"
FORMAT = 1
_CHECKED = ("model_type", "hidden_size", "vocab_size")


def has_mtp_heads(model_dir: str | Path) -> bool:
    return (Path(model_dir) / META).is_file()


def save_mtp_heads(model_dir: str | Path, heads: MTPHeads, *, state_dict: dict[str, torch.Tensor] | None = None,
                   num_hidden_layers: int | None = None) -> Path:
    """Write the heads into `model_dir` (weights, then mtp.json); `state_dict`: their weights when
    gathered elsewhere (from FSDP shards), named as `heads.state_dict()` names them."""
    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = state_dict if state_dict is not None else heads.state_dict()
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in tensors.values()})
    atomic_write(out / WEIGHTS, save(tensors))
    meta = {"format": FORMAT, "heads": len(heads), "model_type": heads.model_type,
            "architectures": heads.architectures, "hidden_size": heads.hidden_size,
            "vocab_size": heads.vocab_size, "num_hidden_layers": num_hidden_layers,
            "block": type(heads.heads[0].block).__name__, "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
            "tokens_seen": int(heads.tokens_seen), "draft_vocab": heads.draft_vocab, "training": heads.info}
    atomic_write(out / META, json.dumps(meta, indent=1) + "\n")
    write_weights_index(out)
    return out


def write_weights_index(model_dir: Path) -> None:
    """An index naming `model.safetensors` as the model's only weights file, where it is one file
    without an index (so `mtp.safetensors` is not read as part of the model)."""
    single = model_dir / MODEL_WEIGHTS
    if not single.is_file() or (model_dir / MODEL_INDEX).exists():
        return
    with safe_open(str(single), framework="pt") as f:
        names = list(f.keys())
    index = {"metadata": {"total_size": single.stat().st_size}, "weight_map": {n: MODEL_WEIGHTS for n in names}}
    atomic_write(model_dir / MODEL_INDEX, json.dumps(index, indent=1) + "\n")


def read_mtp_meta(model_dir: str | Path) -> dict[str, Any] | None:
    """mtp.json of `model_dir`, checked for the keys a load needs; None when there are no heads."""
    d = Path(model_dir)
    meta_path, weights_path = d / META, d / WEIGHTS
    if not meta_path.exists() and not weights_path.exists():
        return None
    if not meta_path.is_file() or not weights_path.is_file():
        there, missing = (META, WEIGHTS) if meta_path.is_file() else (WEIGHTS, META)
        raise MTPError(f"{d} has {there} but no {missing}: the heads were not saved whole",
                       hint=f"delete {d / there} (the model loads without heads), or save the heads again")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MTPError(f"{meta_path} is not valid JSON ({exc})", hint="save the heads again") from None
    wanted = {"heads": int, "model_type": str, "hidden_size": int, "vocab_size": int, "tokens_seen": int}
    wrong = [k for k, t in wanted.items() if not isinstance(meta.get(k) if isinstance(meta, dict) else None, t)]
    if wrong:
        raise MTPError(f"{meta_path} lacks {wrong} (or holds them with the wrong type)",
                       hint="it was not written by save_mtp_heads; save the heads again")
    if meta["heads"] < 1:
        raise MTPError(f"{meta_path} says heads = {meta['heads']}", hint="a saved set holds at least one head")
    return meta


def load_mtp_heads(model_dir: str | Path, base_model: nn.Module) -> MTPHeads | None:
    """The heads saved in `model_dir`, on `base_model`'s device and dtype; None when it has none."""
    meta = read_mtp_meta(model_dir)
    if meta is None:
        return None
    config = base_model.config
    for key in _CHECKED:
        if meta[key] != getattr(config, key, None):
            raise MTPError(f"{Path(model_dir) / META} was saved for {key} = {meta[key]!r}, but the model "
                           f"has {getattr(config, key, None)!r}",
                           hint="heads only work on the model they were trained for: train new heads "
                                "(atelier mtp attach), or delete mtp.json and mtp.safetensors")
    heads = MTPHeads(base_model, meta["heads"])
    try:
        state = load_file(str(Path(model_dir) / WEIGHTS))
    except (SafetensorError, OSError) as exc:
        raise MTPError(f"cannot read {Path(model_dir) / WEIGHTS}: {exc}", hint="save the heads again") from None
    expected = heads.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    bad_shapes = [k for k in set(expected) & set(state) if expected[k].shape != state[k].shape]
    if missing or unexpected or bad_shapes:
        raise MTPError(f"{Path(model_dir) / WEIGHTS} does not hold {meta['heads']} heads of this model: "
                       f"missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {bad_shapes[:3]}",
                       hint="mtp.json and mtp.safetensors disagree; save the heads again")
    param = next(base_model.parameters())
    heads.load_state_dict({k: v.to(device=param.device, dtype=expected[k].dtype) for k, v in state.items()})
    heads.tokens_seen = meta["tokens_seen"]
    heads.draft_vocab = meta.get("draft_vocab")
    heads.info = dict(meta.get("training") or {})
    return heads
