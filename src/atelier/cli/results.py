"""`atelier results …`: the records of adopted runs, and the tables rendered from them."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

import typer

results_app = typer.Typer(help="Records of adopted runs and the tables rendered from them.", no_args_is_help=True)


@results_app.command("render")
def render_cmd(
    root: Path = typer.Option(Path("."), "--root", help="The repository (holding README.md and results/)."),
    check: bool = typer.Option(False, "--check", help="Change nothing; exit 1 when a table differs from its data."),
) -> None:
    """Render the tables of README.md and benchmarks/RESULTS.md from results/ and
    benchmarks/results/ (the docs build renders its pages from the same records).

    Example: atelier results render --check"""
    from atelier.pipeline.results import render

    stale = render(root, check=check)
    for path in stale:
        typer.echo(f"{'differs from its data' if check else 'rendered'}: {path}")
    if check and stale:
        raise typer.Exit(1)


@results_app.command("add")
def add_cmd(
    run_dir: Path = typer.Argument(..., help="A finished `atelier run` directory (it holds run.json)."),
    version: str = typer.Option(..., "--version", help="The recipe version the run belongs to (a row of the "
                                                       "README's table), e.g. 'ten passes'."),
    log: str = typer.Option(..., "--log", help="The log entry that tells the version, "
                                               "e.g. docs/log/2026-12-06-ten-passes.md."),
    commit: Optional[str] = typer.Option(None, "--commit", help="The commit that made the version (default: "
                                                                 "the run's)."),
    out: Path = typer.Option(Path("results/demo"), "--out", help="Where adopted records are kept."),
) -> None:
    """Keep a finished run's record in results/ as a run of a recipe version;
    then `atelier results render` puts it in the tables.

    Example: atelier results add runs/demo --version "ten passes" --log docs/log/2026-12-06-ten-passes.md"""
    import json

    from atelier.errors import AtelierError
    from atelier.pipeline.record import RECORD_FILE

    path = run_dir / RECORD_FILE
    if not path.is_file():
        raise AtelierError(f"{path} does not exist", hint="a run writes run.json when its report stage is done: "
                           "finish it with the same `atelier run` command first")
    record = json.loads(path.read_text())
    made_by = commit or record.get("commit")
    if not made_by:
        raise AtelierError("the run's record names no commit", hint="give the version's with --commit")
    record["version"] = {"name": version, "commit": made_by.split("+")[0], "log": log,
                         "date": (record.get("finished_utc") or time.strftime("%Y-%m-%dT%H:%M"))[:16]}
    slug = re.sub(r"[^a-z0-9]+", "-", version.lower()).strip("-")
    target = out / f"{record['version']['date'][:10]}-{slug}-seed{record.get('seed')}-{time.strftime('%H%M%S')}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    typer.echo(str(target))
