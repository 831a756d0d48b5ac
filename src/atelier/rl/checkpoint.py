"""Step checkpoints: RUN_DIR/checkpoints/step-<k>/ with the model (Hugging Face
format, loadable by every atelier command), optimizer, RNG states and a
meta.json (step, task cursor, ledger position).

A checkpoint is written into a temporary directory and renamed
(`atelier.fsio.atomic_dir`); step k is committed
once its line is in metrics.jsonl, the last write of a step (see
`atelier.rl.metrics`). A run resumes from the newest checkpoint whose step
is committed (`committed_checkpoint`); newer ones are deleted. The slot
ledger is its own append-only file; on resume, its `trained` events newer
than that step are undone (`Ledger.load(path, committed_step)`), so a sample
is never trained twice and never lost whatever moment `kill -9` hits.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atelier.fsio import atomic_dir, crash_point

KEEP = 2


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return None
    done = [p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
            and (p / "meta.json").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def committed_checkpoint(run_dir: Path, last_committed_step: int) -> Path | None:
    """The newest checkpoint of a step that is committed (<= the step of the
    last metrics line); checkpoints beyond it (the process died before the
    step's line was written) are deleted, and will be written again."""
    while (ckpt := latest_checkpoint(run_dir)) is not None and read_meta(ckpt)["step"] > last_committed_step:
        shutil.rmtree(ckpt)
    return ckpt


def save_checkpoint(run_dir: Path, step: int, trainer, tokenizer, meta: dict[str, Any]) -> Path:
    root = checkpoints_dir(run_dir)
    final = root / f"step-{step:06d}"
    with atomic_dir(final) as tmp:
        trainer.save(tmp, tokenizer)
        torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   tmp / "rng.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1) + "\n")
        crash_point("checkpoint.before_rename")
    for old in sorted(root.glob("step-*"), key=lambda p: p.name)[:-KEEP]:
        if old != final and not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


def restore_rng(ckpt: Path) -> None:
    state = torch.load(ckpt / "rng.pt", weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_meta(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "meta.json").read_text())
