"""`atelier pretrain RECIPE`: continued pretraining, long-context extension and SFT.

Only typer is imported at the top; torch and the trainer load inside the command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer


def pretrain_cmd(
    recipe: Optional[Path] = typer.Argument(None, help="A TOML recipe (recipes/pretrain-*.toml)."),
    overrides: List[str] = typer.Option([], "--set", help="Override a recipe key, e.g. --set seed=1 --set data.heldout_fraction=0.1"),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Resume the run in this directory from its last checkpoint."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Where the run writes (default runs/pretrain-<recipe>-<time>)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary only."),
) -> None:
    """Run every phase of RECIPE; checkpoints and the final model are Hugging Face directories.
    Example: atelier pretrain recipes/pretrain-tiny.toml --set model=build/tiny-model"""
    import os
    import time

    from atelier.config import load_config
    from atelier.pretrain.config import PretrainConfig
    from atelier.pretrain.train import RunDirError, RunResult, run_pretrain

    if resume is not None:
        if recipe is not None:
            raise RunDirError("give either a RECIPE or --resume RUN_DIR, not both",
                              hint="a resumed run uses the config.toml its directory holds")
        config = load_config(PretrainConfig, resume / "config.toml", overrides)
        target = resume
    elif recipe is None:
        raise RunDirError("no recipe given", hint="atelier pretrain recipes/pretrain-tiny.toml, or --resume RUN_DIR")
    else:
        config = load_config(PretrainConfig, recipe, overrides)
        target = run_dir or Path("runs") / f"pretrain-{recipe.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if config.ranks > 1 and "WORLD_SIZE" not in os.environ:   # start the ranks here (else torchrun did)
        from atelier.launch import launch_job

        out = launch_job("pretrain", config, target, resume=resume is not None, quiet=as_json, world=config.ranks)
        if out is None:
            raise RunDirError("the ranks finished without a result", hint="see the messages above")
        result = RunResult(Path(out["run_dir"]), Path(out["final_model"]) if out["final_model"] else None,
                           out["global_step"], out["stopped"], out["losses"], out["evals"])
    else:
        result = run_pretrain(config, target, resume=resume is not None, quiet=as_json)
        if int(os.environ.get("RANK", "0")) != 0:
            return
    summary = {"run_dir": str(result.run_dir), "final_model": str(result.final_model) if result.final_model else None,
               "global_step": result.global_step, "stopped": result.stopped,
               "last_loss": result.losses[-1] if result.losses else None, "evals": result.evals}
    if as_json:
        print(json.dumps(summary))
        return
    typer.echo(f"run directory: {result.run_dir}")
    if result.stopped:
        typer.echo(f"stopped after step {result.global_step}; continue with --resume {result.run_dir}")
    else:
        typer.echo(f"final model: {result.final_model}  (loss curves: {result.run_dir / 'loss.png'})")


def register(app: typer.Typer) -> None:
    app.command("pretrain")(pretrain_cmd)
