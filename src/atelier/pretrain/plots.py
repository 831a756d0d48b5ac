"""Loss curves and eval charts written into a run directory (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(metrics_path: str | Path, out_png: str | Path) -> Path | None:
    """Training loss per step, coloured by phase, with validation loss where logged."""
    path = Path(metrics_path)
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    val = [r for r in records if r.get("val_loss") is not None]
    if not train:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    phases = list(dict.fromkeys(r["phase"] for r in train))
    for phase in phases:
        rows = [r for r in train if r["phase"] == phase]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=f"train: {phase}")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", label="held-out")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)


def plot_evals(results: dict[str, Any], out_png: str | Path) -> Path:
    """Per-repository NLL/token and per-history state-tracking scores side by side."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    repos = results.get("perplexity", {}).get("repos", [])
    left.barh([Path(r["repo"]).name for r in repos], [r["nll_per_token"] for r in repos])
    left.set_xlabel("NLL per token (nats)")
    left.set_title("codebase perplexity")
    items = results.get("state_tracking", {}).get("items", [])
    right.bar(range(len(items)), [i["score"] for i in items])
    right.set_xticks(range(len(items)), [i["file"] for i in items], rotation=30, ha="right")
    right.set_ylim(0, 1)
    right.set_xlabel("file history")
    right.set_ylabel("edit-distance similarity")
    right.set_title("state tracking")
    fig.suptitle(results.get("model", ""))
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
