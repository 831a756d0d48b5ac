"""`atelier train [RECIPE.toml] [--set key=value ...] [--run-dir DIR]`: asynchronous RL.

Imports only typer at the top; the trainer (torch, transformers) is imported
inside the command, after the arguments are parsed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer

from atelier.cli.options import RUN_DIR_HELP, SET_HELP


def train(
    recipe: Optional[Path] = typer.Argument(None, help="A TOML recipe, e.g. recipes/rl-tiny.toml."),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP.format(example="trainer.lr=1e-5")),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help=RUN_DIR_HELP),
    quiet: bool = typer.Option(False, "--quiet", help="No live view; one line per step."),
) -> None:
    """Asynchronous RL: rollouts in the agent harness, group advantages, full-parameter AdamW.

    Running the same command again continues exactly: no sample is trained
    twice and none is lost (rollouts in flight at a crash are re-run). The
    run directory holds the resolved config, ledger.jsonl, metrics.jsonl,
    rollouts/ and checkpoints/.

    Example: atelier train recipes/rl-tiny.toml --run-dir runs/rl-tiny
    """
    from rich.console import Console

    from atelier.cli.rank import start_ranks
    from atelier.rl.config import TrainConfig
    from atelier.rl.run import prepare_run_dir
    from atelier.rundir import resolve_run

    config, run_dir = resolve_run(TrainConfig, recipe, overrides, run_dir, "atelier train")
    # rank 0 freezes the config (under torchrun every rank runs this command; the others follow it)
    continuing = prepare_run_dir(config, run_dir) if os.environ.get("RANK", "0") == "0" else True
    console = Console(stderr=True)
    ranks = config.trainer.ranks
    console.print(f"[bold]atelier train[/] → {run_dir}  ({config.rollout.mode}, launcher {config.launcher}"
                  f"{f', {ranks} trainer ranks' if ranks > 1 else ''}{', continuing' if continuing else ''})")
    if ranks > 1 and "WORLD_SIZE" not in os.environ:   # start the ranks here (else torchrun did)
        console.print(json.dumps(start_ranks("train", config, run_dir, world=ranks), indent=1))
        return
    summary = _train_here(config, run_dir, quiet or not console.is_terminal, console)
    if summary is not None:   # None on a follower rank under torchrun
        console.print(json.dumps(summary.to_dict(), indent=1))


def _train_here(config, run_dir: Path, quiet: bool, console):
    """This process's rank of the run: one line a step, or a live table of the last steps."""
    from rich.live import Live
    from rich.table import Table

    from atelier.cli.rank import step_line
    from atelier.rl.run import run_training

    if quiet:
        return run_training(config, run_dir, on_step=lambda r: print(json.dumps(step_line(r)), flush=True))
    rows: list[dict] = []

    def table() -> Table:
        t = Table(box=None, header_style="bold")
        for col in ("step", "reward", "pass", "best@K", "stale≤", "gen tok/s", "busy", "sync KB", "KL"):
            t.add_column(col, justify="right")
        for r in rows[-12:]:
            t.add_row(str(r["step"]), f"{r['reward_mean']:.3f}", f"{r['pass_rate']:.2f}", f"{r['best_of_k']:.2f}",
                      str(r["staleness_max"]), f"{r['gen_tokens_per_s']:.0f}", f"{1 - r['trainer_idle_fraction']:.0%}",
                      f"{r['sync_bytes'] / 1024:.0f}", f"{r['kl_k1']:.4f}")
        return t

    with Live(table(), console=console, refresh_per_second=4) as live:
        def on_step(r: dict) -> None:
            rows.append(r)
            live.update(table())
        return run_training(config, run_dir, on_step=on_step)
