"""Trainer ranks of `atelier train` and `atelier pretrain`: starting them, and what each one runs.

With `trainer.ranks = N` (RL) or `ranks = N` (pretrain/SFT), the command
resolves the recipe once and `start_ranks` runs N ranks of the hidden command

    atelier rank {train|pretrain} CONFIG.json RUN_DIR --result RESULT.json

on this machine under torchrun's elastic agent (`atelier.train.launch`:
per-rank logs in RUN_DIR/logs/ranks, a failed rank stops the others and is
named), or, for RL with `launcher = "ray"`, as Ray actors
(`atelier.train.launch_ray`). Every rank validates the very config the
user's command resolved (it travels as JSON in a private temporary
directory); rank 0 writes the run's result (a JSON object) to --result.
The rank and the rendezvous come from torchrun's environment variables, so
`torchrun --nproc-per-node N -m atelier.cli rank ...` runs the same program,
and `torchrun --nproc-per-node N -m atelier.cli train RECIPE ...` runs the
user's command on every rank.

Only typer is imported at the top; the trainers load inside the functions.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Optional

import typer


def rank_cmd(
    kind: str = typer.Argument(..., help="train or pretrain."),
    config: Path = typer.Argument(..., help="The resolved config, as JSON."),
    run_dir: Path = typer.Argument(..., help="The run directory."),
    result: Optional[Path] = typer.Option(None, "--result", help="Where rank 0 writes the run's result."),
    quiet: bool = typer.Option(False, "--quiet", help="No per-step output."),
) -> None:
    """One trainer rank of a job `atelier train` or `atelier pretrain` started (internal)."""
    from atelier.errors import AtelierError
    from atelier.train.ranks import die_with_parent, exit_rank

    die_with_parent()
    try:
        out = run_rank(kind, config.read_text(), str(run_dir), quiet=quiet)
    except AtelierError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        exit_rank(2)
    if out is not None and result is not None:
        result.write_text(json.dumps(out))
    exit_rank(0)


def run_rank(kind: str, text: str, run_dir: str, *, quiet: bool = True) -> dict[str, Any] | None:
    """Run this process's rank of an `atelier train` / `pretrain` job (config as JSON text);
    rank 0 returns the run's summary, the other ranks None. Also what Ray rank actors call."""
    if kind == "train":
        from atelier.rl.config import TrainConfig
        from atelier.rl.run import run_training

        def on_step(r: dict) -> None:   # rank 0's one line a step, as `atelier train --quiet` prints it
            print(json.dumps(step_line(r)), flush=True)

        summary = run_training(TrainConfig.model_validate_json(text), run_dir, on_step=on_step)
        return summary.to_dict() if summary is not None else None
    if kind != "pretrain":
        raise ValueError(f"unknown kind of rank {kind!r}: train or pretrain")
    from atelier.pretrain.config import PretrainConfig
    from atelier.pretrain.train import run_pretrain

    out = run_pretrain(PretrainConfig.model_validate_json(text), run_dir, quiet=quiet)
    return out.to_dict() if os.environ.get("RANK", "0") == "0" else None


def prepare_run_dir(kind: str, config: Any, run_dir: Path) -> bool:
    """Freeze `config` in `run_dir` the way a `kind` run does, or check it against the run there;
    True when the run is continued (`atelier.rundir`)."""
    if kind == "train":
        from atelier.rl.run import prepare_run_dir as prepare
    else:
        from atelier.pretrain.train import prepare_run_dir as prepare
    return prepare(config, run_dir)


def step_line(record: dict[str, Any]) -> dict[str, Any]:
    """The few fields of an RL step's metrics printed one line a step."""
    return {k: record[k] for k in ("step", "reward_mean", "pass_rate", "staleness_max", "gen_tokens_per_s",
                                   "trainer_idle_fraction", "sync_bytes")}


def start_ranks(kind: str, config: Any, run_dir: Path, *, world: int, quiet: bool = True,
                strategy: str = "SPREAD") -> dict[str, Any] | None:
    """Run `world` ranks of `kind` on `config` (see the module docstring); rank 0's result.
    `strategy`: the Ray placement group's (SPREAD, or STRICT_SPREAD to insist on one node a rank)."""
    prepare_run_dir(kind, config, Path(run_dir))   # the run directory first: the ranks' logs go into it
    if kind == "train" and config.launcher == "ray":   # rank actors in a placement group, one GPU each on cuda
        from atelier.train.launch_ray import launch_ray

        t = config.trainer
        result, nodes = launch_ray(partial(run_rank, kind, config.model_dump_json(), str(Path(run_dir).resolve())),
                                   world, cpus_per_rank=t.threads, threads=t.threads,
                                   gpus_per_rank=1.0 if t.device == "cuda" else 0.0, strategy=strategy,
                                   what=f"atelier {kind} with {world} Ray ranks")
        return {**(result or {}), "rank_nodes": nodes}
    from atelier.train.launch import launch

    with tempfile.TemporaryDirectory(prefix="atelier-ranks-") as tmp:
        spec, result_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        spec.write_text(config.model_dump_json())
        argv = ["-m", "atelier.cli", "rank", kind, str(spec), str(run_dir), "--result", str(result_path)]
        launch([*argv, *(["--quiet"] if quiet else [])], world, log_dir=Path(run_dir) / "logs" / "ranks",
               what=f"atelier {kind} with {world} ranks")
        return json.loads(result_path.read_text()) if result_path.exists() else None
