"""`atelier report`: one self-contained HTML page over run directories."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer


def report_cmd(
    run_dirs: List[Path] = typer.Argument(..., help="Evaluation runs, training runs, or directories of them."),
    out: Path = typer.Option(Path("report.html"), "--out", help="Where to write the page."),
    title: str = typer.Option("atelier report", "--title", help="The page's title."),
    max_trajectories: int = typer.Option(300, "--max-trajectories", min=0,
                                         help="Most trajectories the viewer embeds."),
) -> None:
    """Summary, pass@k, accuracy-against-cost, training curves, per-task table and
    trajectories in one HTML file. Example: atelier report runs/base runs/rl --out report.html"""
    from atelier.eval.report import build_report

    path = build_report(run_dirs, out, max_trajectories=max_trajectories, title=title)
    typer.echo(str(path))
