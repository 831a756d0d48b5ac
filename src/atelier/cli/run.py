"""`atelier run RECIPE [--set key=value ...] [--run-dir DIR]`: the whole job.

Imports only typer at the top; the pipeline (torch, transformers, the
sandboxes) is imported inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from atelier.cli.options import SET_HELP


def run(
    recipe: Path = typer.Argument(..., help="A TOML recipe, e.g. recipes/demo.toml."),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP.format(example="rl.trainer.steps=4")),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="The run directory (default: runs/<recipe "
                                           "name>). Run the same command again to continue the run it holds."),
    as_json: bool = typer.Option(False, "--json", help="Print every stage's outputs as one JSON object at the end."),
) -> None:
    """Get the model, build tasks, evaluate, SFT warm start, evaluate, asynchronous
    RL, evaluate again; write summary.json and report.html comparing the three.

    Example: atelier run recipes/demo.toml"""
    import json
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    from atelier.config import load_config
    from atelier.pipeline.config import RunConfig
    from atelier.pipeline.runner import run_pipeline
    from atelier.pipeline.stages import STAGE_NAMES

    config = load_config(RunConfig, recipe, overrides)
    run_dir = run_dir or Path("runs") / recipe.stem
    console = Console(stderr=True, highlight=False)
    start = time.monotonic()
    view = Progress(TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[note]}"), console=console, transient=False)
    bars = {stage: view.add_task(stage, total=None, start=False, note="", visible=False) for stage in STAGE_NAMES}
    current: list[str] = []

    def say(line: str) -> None:
        elapsed = time.monotonic() - start
        view.console.print(Text.assemble((f"{int(elapsed // 60):02d}:{int(elapsed % 60):02d} ", "dim"), line))
        if line.startswith("[") and "]" in line:  # a stage line: "[stage] ..." starts it, any other ends it
            stage, rest = line[1:].split("]", 1)
            if stage in bars and rest.strip() == "...":
                current[:] = [stage]
                view.update(bars[stage], visible=True)
                view.start_task(bars[stage])
            elif stage in bars:
                total = view.tasks[bars[stage]].total
                view.update(bars[stage], visible=True, total=total or 1, completed=total or 1,
                            note="done earlier" if "done earlier" in rest else "done")
                view.stop_task(bars[stage])

    def progress(stage: str, done: int, total: int) -> None:
        if stage not in bars:  # evaluation progress is labelled by its run directory's name
            stage = current[0] if current else stage
        view.update(bars[stage], total=total, completed=done)

    console.print(f"atelier run {recipe} → {run_dir}")
    with view:
        done = run_pipeline(config, run_dir, recipe_dir=recipe.resolve().parent, say=say, progress=progress,
                            recipe=str(recipe))
    summary = json.loads(Path(done["report"]["summary"]).read_text())
    console.print(final_table(summary))
    if as_json:
        typer.echo(json.dumps(done, indent=1))
    typer.echo(done["report"]["path"])


def final_table(summary: dict):
    """Before / after SFT / after RL, the headline test and the run's peak memory (a rich `Table`)."""
    from rich.table import Table

    evals = summary["evaluations"]
    head = summary["headline"]
    measure = head["measure"]
    table = Table(title="held-out tasks", caption=_caption(summary))
    table.add_column("")
    labels = {"before": "before", "after_sft": "after SFT", "after_rl": "after RL"}
    keys = [k for k in labels if k in evals]
    for k in keys:
        table.add_column(labels[k], justify="right")

    def interval(iv) -> str:  # in whole percent, so a cell fits an 80-column terminal on one line
        return f" [{100 * iv[0]:.0f}-{100 * iv[1]:.0f}%]" if iv else ""

    table.add_row("pass rate [95%]", *(_pct(evals[k]["pass_rate"]) + interval(evals[k]["pass_rate_interval_95"])
                                       for k in keys))
    table.add_row("best-of-K", *(_pct(evals[k]["best_of_k"]) for k in keys))
    table.add_row("mean reward", *("n/a" if evals[k]["mean_reward"] is None else f"{evals[k]['mean_reward']:.3f}"
                                   for k in keys))
    if measure != "pass":
        table.add_row(f"{measure} rate [95%]", *(_pct(evals[k][measure]["rate"])
                                                 + interval(evals[k][measure]["interval_95"]) for k in keys))
    table.add_row("attempts", *(str(evals[k]["valid_attempts"]) for k in keys))
    return table


def _caption(summary: dict) -> str:
    head = summary["headline"]
    parts = []
    if "p_value" in head:
        parts.append(f"headline ({head['measure']}, named in the recipe): after RL vs after SFT, "
                     f"{head['improved']} improved / {head['worsened']} worsened of {head['pairs']} pairs, "
                     f"one-sided exact McNemar p = {head['p_value']:.2g}"
                     + (" (significant)" if head["significant"] else " (not significant)"))
    own, measure = summary.get("rl_tasks"), head["measure"]
    if own and measure in own["tests"]:
        test, before, after = own["tests"][measure], own["evaluations"]["after_sft"], own["evaluations"]["after_rl"]
        parts.append(f"on RL's own training tasks ({measure}, not held out): {before[measure]['successes']} -> "
                     f"{after[measure]['successes']} of {test['pairs']}, {test['improved']} improved / "
                     f"{test['worsened']} worsened, p = {test['p_value']:.2g}")
    zero = (summary.get("rl") or {}).get("zero_variance_fraction_all")
    if zero is not None:
        parts.append(f"RL groups with zero reward variance: {zero:.0%}")
    pss, rss = summary.get("peak_pss_mb_run"), summary.get("peak_rss_mb_run")
    if pss is None or rss is None:
        parts.append("peak memory: not measured (no /proc)")
    else:  # MiB to GB (10^9 bytes), the unit budgets are set in
        parts.append(f"peak memory of the whole process tree: {pss * 2 ** 20 / 1e9:.2f} GB (PSS: a page shared by "
                     f"n processes counts 1/n in each; summed RSS: {rss * 2 ** 20 / 1e9:.2f} GB)")
    parts.append(f"wall time: {summary.get('wall_s_total', 0) / 60:.1f} min")
    return "\n".join(parts)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"
