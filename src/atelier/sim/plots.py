"""The sweep's plots (PNG), one function per figure of `atelier.sim.sweep`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_split(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for gpus in sorted({r["gpus"] for r in rows}):
        mine = sorted((r for r in rows if r["gpus"] == gpus), key=lambda r: r["inference_share"])
        ax.plot([r["inference_share"] for r in mine], [r["samples_per_s"] for r in mine], marker="o",
                label=f"{gpus} GPUs")
    ax.set_xlabel("share of the GPUs serving inference")
    ax.set_ylabel("samples trained per second")
    ax.set_yscale("log")
    ax.set_title(f"{title}: the split of the GPUs", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_staleness(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    labels = ["sync" if r["mode"] == "sync" else f"S={r['max_staleness']}" for r in rows]
    ax.bar(labels, [r["samples_per_s"] for r in rows], color="#4c72b0")
    ax.set_ylabel("samples trained per second")
    twin = ax.twinx()
    twin.plot(labels, [r["mean_staleness"] for r in rows], color="#dd8452", marker="o")
    twin.set_ylabel("mean staleness of trained tokens (versions)", color="#dd8452")
    ax.set_title(f"{title}: the staleness bound", fontsize=10)
    return _save(fig, path)


def plot_speedup(speedups: dict[int, float | None], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    gpus = sorted(g for g, s in speedups.items() if s is not None)
    ax.plot(gpus, [speedups[g] for g in gpus], marker="o")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (each at its best split)")
    ax.set_ylabel("async throughput / sync throughput")
    ax.set_title(f"{title}: asynchronous over synchronous", fontsize=10)
    return _save(fig, path)


def plot_outages(rows: Sequence[dict[str, Any]], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    hit = [r for r in rows if r["outage"] != "none"]
    done = [r for r in hit if not r.get("run_stopped")]
    ax.barh([r["outage"] for r in done], [r["extra_wall_s"] / 60 for r in done], color="#c44e52")
    for r in hit:
        if r.get("run_stopped"):   # no bar: a stopped run has no added time, it has a stop
            ax.barh([r["outage"]], [0.0])
            ax.annotate(f"run stopped after step {r['steps_done']}", (0, r["outage"]), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=8)
    ax.set_xlabel(f"minutes added to the run by an outage of {hit[0]['outage_s'] / 60:.0f} min" if hit else "")
    ax.set_title(f"{title}: what an outage costs", fontsize=10)
    return _save(fig, path)
