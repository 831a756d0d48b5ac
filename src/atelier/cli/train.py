"""`atelier train RECIPE.toml [--set key=value ...] [--run-dir DIR] [--resume RUN_DIR]`.

Imports only typer at the top; the trainer (torch, transformers) is imported
inside the command, after the arguments are parsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def train(
    recipe: Optional[Path] = typer.Argument(None, help="A TOML recipe, e.g. recipes/rl-tiny.toml."),
    overrides: List[str] = typer.Option([], "--set", help="Override a recipe key: --set trainer.lr=1e-5 (repeatable)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Where the run writes (default: runs/<recipe>-<time>)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this directory after a crash or stop."),
    quiet: bool = typer.Option(False, "--quiet", help="No live view; one line per step."),
) -> None:
    """Asynchronous RL: rollouts in the agent harness, group advantages, full-parameter AdamW.

    Resume continues exactly: no sample is trained twice and none is lost
    (rollouts in flight at the crash are re-run). The run directory holds the
    resolved config, ledger.jsonl, metrics.jsonl, rollouts/ and checkpoints/.
    """
    import time

    from atelier.config import load_config
    from atelier.rl.config import TrainConfig
    from atelier.rl.run import RunDirError

    if resume is not None:
        if not (resume / "config.toml").exists():
            raise RunDirError(f"cannot resume {resume}: no config.toml there",
                              hint="pass the run directory a previous `atelier train` created")
        config = load_config(TrainConfig, resume / "config.toml", overrides)
        target, resuming = resume, True
    else:
        if recipe is None:
            raise RunDirError("no recipe given", hint="atelier train recipes/rl-tiny.toml, or --resume RUN_DIR")
        config = load_config(TrainConfig, recipe, overrides)
        target = run_dir or Path("runs") / f"{recipe.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        resuming = False
    _run(config, target, resuming, quiet)


def _run(config, run_dir: Path, resume: bool, quiet: bool) -> None:
    import json
    import os

    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from atelier.rl.run import run_training

    console = Console(stderr=True)
    ranks = config.trainer.ranks
    console.print(f"[bold]atelier train[/] → {run_dir}  ({config.rollout.mode}, launcher {config.launcher}"
                  f"{f', {ranks} trainer ranks' if ranks > 1 else ''}{', resuming' if resume else ''})")
    if ranks > 1 and "WORLD_SIZE" not in os.environ:   # start the ranks here (else torchrun did)
        if config.launcher == "ray":   # rank actors in a placement group, one GPU each on cuda
            from atelier.launch_ray import launch_ray_job

            result = launch_ray_job("train", config, run_dir, resume=resume, world=ranks,
                                    cpus_per_rank=config.trainer.threads, threads=config.trainer.threads,
                                    gpus_per_rank=1.0 if config.trainer.device == "cuda" else 0.0)
        else:
            from atelier.launch import launch_job

            result = launch_job("train", config, run_dir, resume=resume, quiet=True, world=ranks)
        console.print(json.dumps(result, indent=1))
        return
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

    if quiet or not console.is_terminal:
        def on_step(r: dict) -> None:
            print(json.dumps({k: r[k] for k in ("step", "reward_mean", "pass_rate", "staleness_max",
                                                 "gen_tokens_per_s", "trainer_idle_fraction", "sync_bytes")}),
                  flush=True)
        summary = run_training(config, run_dir, resume=resume, on_step=on_step)
    else:
        with Live(table(), console=console, refresh_per_second=4) as live:
            def on_step(r: dict) -> None:
                rows.append(r)
                live.update(table())
            summary = run_training(config, run_dir, resume=resume, on_step=on_step)
    if summary is not None:   # None on a follower rank under torchrun
        console.print(json.dumps(summary.to_dict(), indent=1))


def register(app: typer.Typer) -> None:
    app.command("train")(train)
