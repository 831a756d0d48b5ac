"""Step checkpoints: RUN_DIR/checkpoints/step-<k>/ with the model (Hugging Face
format, loadable by every atelier command), optimizer, RNG states (one file
per trainer rank) and a meta.json (step, task cursor, ledger position).

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
        trainer.save(tmp, tokenizer)   # every rank writes its RNG states there too (`save_rng`)
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=1) + "\n")
        crash_point("checkpoint.before_rename")
    for old in sorted(root.glob("step-*"), key=lambda p: p.name)[:-KEEP]:
        if old != final and not old.name.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


def rng_file(ckpt: Path, rank: int) -> Path:
    """Rank 0's RNG states are rng.pt (as before ranks had their own); rank r's rng-rank<r>.pt."""
    return ckpt / ("rng.pt" if rank == 0 else f"rng-rank{rank}.pt")


def save_rng(ckpt: Path, rank: int) -> None:
    """This process's python, numpy, torch (and CUDA) RNG states, as rank `rank` of the trainer."""
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               rng_file(ckpt, rank))


def start_rng(seed: int, rank: int, ckpt: Path | None) -> None:
    """Set this rank's RNGs as a run with `seed` has them at the start of its next step.

    A fresh run seeds python, numpy and torch (every device) from the run's
    seed and the rank (`rank_seed`: ranks draw different dropout masks for
    their different samples), so a run is reproducible from its seed alone
    whatever ran in the process before (another run, an SFT phase, a model
    built from random init). A resumed run takes the states each rank saved
    with the checkpoint (a checkpoint written before ranks saved their own:
    rank 0's for every rank). Called as the last thing before the first
    step, so whatever is built between a checkpoint and the next step (the
    engine, the weight sync) draws nothing from a state that must match.
    """
    if ckpt is None:
        s = rank_seed(seed, rank)
        random.seed(s)
        np.random.seed(s)
        torch.manual_seed(s)   # every CUDA device too
        return
    path = rng_file(ckpt, rank)
    state = torch.load(path if path.exists() else rng_file(ckpt, 0), weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_seed(seed: int, rank: int) -> int:
    """The 32-bit seed of trainer rank `rank` (torch's CPU generator keeps 32 bits of a seed):
    the run's seed on rank 0, a hash of (seed, rank) on the others."""
    if rank == 0:
        return seed % 2**32
    return int(np.random.SeedSequence([seed % 2**32, rank]).generate_state(1)[0])


def read_meta(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "meta.json").read_text())
