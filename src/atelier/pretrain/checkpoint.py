"""Checkpoints: a Hugging Face model directory plus the trainer's state.

`<run>/checkpoints/step-000120/` holds `save_pretrained` output and the
tokenizer (so `atelier serve/agent/train` load it as a model directory) and
`trainer_state.pt` (optimizer, RNG states, phase, step, data cursor).
`state.json` is written last: a directory without it is a checkpoint cut off
by a kill and is ignored (and replaced) on resume. With N ranks the optimizer
is sharded under `sharded/` (torch.distributed.checkpoint) instead.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atelier.fsio import atomic_write, crash_point, told_when_disk_full
from atelier.mtp.heads import MTPHeads
from atelier.mtp.policy import MTPPolicyHead
from atelier.mtp.store import save_mtp_heads
from atelier.train.checkpoint import full_state_dict, save_sharded
from atelier.train.collectives import barrier, named_failure
from atelier.train.head import unwrap
from atelier.train.ranks import ONE_CPU_RANK

CHECKPOINTS = "checkpoints"


def save_checkpoint(run_dir: Path, head, tokenizer, optimizer, state: dict[str, Any], keep: int,
                    ranks=None, carried: MTPHeads | None = None) -> Path:
    """Write step `state['global_step']`; collective when `ranks` is sharded (every rank calls it).

    Rank 0 writes the Hugging Face model from the gathered full weights; with
    N ranks the optimizer goes to `sharded/` (torch.distributed.checkpoint,
    each rank its shards), with one rank into trainer_state.pt as before.
    `state.json`, written last by rank 0 after every rank's shards are down,
    commits the checkpoint. MTP heads go beside the model (`save_model_dir`).
    """
    ranks = ranks or ONE_CPU_RANK
    root = Path(run_dir) / CHECKPOINTS
    out = root / f"step-{state['global_step']:06d}"
    if ranks.main:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
    barrier(ranks)
    with told_when_disk_full(out, "writing the checkpoint"):
        with named_failure("writing a checkpoint"):
            weights = full_state_dict(head, ranks)
            if ranks.sharded and optimizer is not None:
                save_sharded(out / "sharded", head, optimizer)
            barrier(ranks)
        if not ranks.main:
            return out
        save_model_dir(out, head, tokenizer, weights, carried)
        torch.save({
            "optimizer": optimizer.state_dict() if optimizer is not None and not ranks.sharded else None,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
        }, out / "trainer_state.pt")
    crash_point("pretrain.before_commit")
    atomic_write(out / "state.json", json.dumps(state, indent=1) + "\n")
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def save_model_dir(out: Path, head, tokenizer, weights: dict[str, Any], carried: MTPHeads | None = None) -> None:
    """A Hugging Face model directory from the policy head's full weights (`lm.*`), the tokenizer,
    and MTP heads: the head's own (`mtp.*`, an MTPPolicyHead's) or `carried` ones, unchanged."""
    model = unwrap(head)
    model.save_pretrained(out, state_dict={k.removeprefix("lm."): v for k, v in weights.items()
                                           if not k.startswith("mtp.")})
    tokenizer.save_pretrained(out)
    layers = model.config.num_hidden_layers
    if isinstance(head, MTPPolicyHead):
        save_mtp_heads(out, head.mtp, state_dict={k.removeprefix("mtp."): v for k, v in weights.items()
                                                  if k.startswith("mtp.")}, num_hidden_layers=layers)
    elif carried is not None:
        save_mtp_heads(out, carried, num_hidden_layers=layers)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / "state.json").is_file())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def load_trainer_state(checkpoint: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON state and the torch payload (optimizer state and RNG states)."""
    state = json.loads((checkpoint / "state.json").read_text())
    payload = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    return state, payload


def restore_rng(payload: dict[str, Any]) -> None:
    torch.set_rng_state(payload["torch_rng"])
    if payload.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["cuda_rng"])
    np.random.set_state(payload["numpy_rng"])
    random.setstate(payload["python_rng"])
