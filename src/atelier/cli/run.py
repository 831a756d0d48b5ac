"""`atelier run RECIPE [--set key=value ...] [--out RUN_DIR]`: the whole job.

Imports only typer at the top; the pipeline (torch, transformers, the
sandboxes) is imported inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def run(
    recipe: Path = typer.Argument(..., help="A TOML recipe, e.g. recipes/demo.toml."),
    overrides: List[str] = typer.Option([], "--set", help="Override a recipe key: --set rl.trainer.steps=4 (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", help="The run directory (default: runs/<recipe name>). "
                                                           "Run the same command again to resume."),
    as_json: bool = typer.Option(False, "--json", help="Print every stage's outputs as one JSON object at the end."),
) -> None:
    """Get the model, build tasks, evaluate, SFT warm start, asynchronous RL,
    evaluate again, and write report.html comparing before and after.

    Example: atelier run recipes/demo.toml"""
    import json
    import time

    from rich.console import Console
    from rich.text import Text

    from atelier.config import load_config
    from atelier.pipeline.config import RunConfig
    from atelier.pipeline.stages import run_pipeline

    config = load_config(RunConfig, recipe, overrides)
    run_dir = out or Path("runs") / recipe.stem
    console = Console(stderr=True, highlight=False)
    start = time.monotonic()

    def say(line: str) -> None:
        elapsed = time.monotonic() - start
        console.print(Text.assemble((f"{int(elapsed // 60):02d}:{int(elapsed % 60):02d} ", "dim"), line))

    console.print(f"atelier run {recipe} → {run_dir}")
    done = run_pipeline(config, run_dir, recipe_dir=recipe.resolve().parent, say=say)
    report = done["report"]
    console.print(f"accuracy on the held-out tasks: before {_pct(report['accuracy_before'])}, "
                  f"after {_pct(report['accuracy_after'])}")
    if as_json:
        typer.echo(json.dumps(done, indent=1))
    typer.echo(report["path"])


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def register(app: typer.Typer) -> None:
    app.command("run")(run)
