"""`atelier tasks import …`: convert SWE-bench and Terminal-Bench/Harbor tasks.

Heavy modules are imported inside the commands so `atelier --help` stays fast.
Each command imports what it can, reports every task it could not import
with the reason, and exits 1 when any failed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from atelier.cli.options import Backend

import_app = typer.Typer(help="Import tasks from other benchmark formats.", no_args_is_help=True)


def _report(report: dict, out: Path, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
    else:
        typer.echo(f"imported {len(report['imported'])} task(s)")
        for key, label in (("needs_docker", "NEEDS DOCKER"), ("failed", "FAILED")):
            for item in report.get(key, []):
                typer.echo(f"  {label} {item['id']}: {item['reason']}")
        if report["imported"]:
            typer.echo(f"next: atelier tasks validate {out} (gold must pass 3 times, empty must fail)")
    if report["failed"]:
        raise typer.Exit(1)


@import_app.command("swebench")
def swebench_cmd(
    instances: Path = typer.Argument(..., help="SWE-bench instances: a JSON list or JSONL."),
    repos: Path = typer.Option(..., "--repos", help="Mirror dir: REPOS/<owner>__<name> or REPOS/<owner>/<name> "
                               "git clones."),
    out: Path = typer.Option(..., "--out", help="Suite directory; one task directory per instance."),
    env_spec: Optional[Path] = typer.Option(None, "--env-spec", help='TOML: ["owner/repo@version"] requirements '
                                            '= [...] (python = "3.x"); default: what the repository declares.'),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace tasks that already exist."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
) -> None:
    """Import SWE-bench instances from local mirrors (no network, no history).
    Example: atelier tasks import swebench lite.jsonl --repos ~/mirrors --out suites/swe"""
    from atelier.tasks.swebench import import_file

    _report(import_file(instances, repos, out, overwrite=overwrite, env_spec=env_spec), out, as_json)


@import_app.command("harbor")
def harbor_cmd(
    path: Path = typer.Argument(..., help="A Harbor task directory (instruction.md …) or a directory of them."),
    out: Path = typer.Option(..., "--out", help="Suite directory; one task directory per task."),
    backend: Backend = typer.Option(Backend.bwrap, "--backend", help="Sandbox that runs solve.sh: bwrap or local "
                                    "(isolates nothing)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace tasks that already exist."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
) -> None:
    """Import Harbor / Terminal-Bench tasks that need no custom Docker image;
    the others are listed as needing one. Gold = the diff solve.sh leaves.
    Example: atelier tasks import harbor ~/terminal-bench/tasks --out suites/tb"""
    from atelier.tasks.harbor import import_dir

    _report(import_dir(path, out, backend=backend.value, overwrite=overwrite), out, as_json)
