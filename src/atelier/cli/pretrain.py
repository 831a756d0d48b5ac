"""`atelier pretrain [RECIPE] [--set key=value ...] [--run-dir DIR]`: continued pretraining,
long-context extension and SFT.

Only typer is imported at the top; torch and the trainer load inside the command.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer

from atelier.cli.options import RUN_DIR_HELP, SET_HELP


def pretrain_cmd(
    recipe: Optional[Path] = typer.Argument(None, help="A TOML recipe (recipes/pretrain-*.toml)."),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP.format(example="data.heldout_fraction=0.1")),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help=RUN_DIR_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary only."),
) -> None:
    """Run every phase of RECIPE; checkpoints and the final model are Hugging Face directories.
    Example: atelier pretrain recipes/pretrain-tiny.toml --set model=build/tiny-model"""
    from atelier.pretrain.config import PretrainConfig
    from atelier.rundir import resolve_run

    config, target = resolve_run(PretrainConfig, recipe, overrides, run_dir, "atelier pretrain")
    result = run_on_ranks(config, target, as_json)
    if result is None:
        return
    summary = {"run_dir": str(result.run_dir), "final_model": str(result.final_model) if result.final_model else None,
               "global_step": result.global_step, "stopped": result.stopped,
               "last_loss": result.losses[-1] if result.losses else None, "evals": result.evals}
    if as_json:
        print(json.dumps(summary))
        return
    typer.echo(f"run directory: {result.run_dir}")
    if result.stopped:
        typer.echo(f"stopped after step {result.global_step}; run the same command again to continue")
    else:
        typer.echo(f"final model: {result.final_model}  (loss curves: {result.run_dir / 'loss.png'})")


def run_on_ranks(config, target: Path, quiet: bool):
    """Freeze the run, run it on `config.ranks` ranks (started here, or by torchrun); the result on
    rank 0, None on the others."""
    from atelier.cli.rank import start_ranks
    from atelier.pretrain.train import RunResult, prepare_run_dir, run_pretrain
    from atelier.rundir import RunDirError

    if os.environ.get("RANK", "0") == "0":   # under torchrun every rank runs this command; rank 0 freezes
        prepare_run_dir(config, target)
    if config.ranks > 1 and "WORLD_SIZE" not in os.environ:   # start the ranks here (else torchrun did)
        out = start_ranks("pretrain", config, target, world=config.ranks, quiet=quiet)
        if out is None:
            raise RunDirError("the ranks finished without a result", hint="see the messages above")
        return RunResult.from_dict(out)
    result = run_pretrain(config, target, quiet=quiet)
    return result if int(os.environ.get("RANK", "0")) == 0 else None
