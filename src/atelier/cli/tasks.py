"""`atelier tasks …`: inspect a task, grade a patch against it.

Heavy modules are imported inside the commands so `atelier --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from atelier.cli.options import Backend
from atelier.cli.tasks_build import build_app
from atelier.cli.tasks_import import import_app

tasks_app = typer.Typer(help="Tasks: build, import, show, grade, validate, stats.", no_args_is_help=True)
tasks_app.add_typer(build_app, name="build")
tasks_app.add_typer(import_app, name="import")


@tasks_app.command("grade")
def grade_cmd(
    task_dir: Path = typer.Argument(..., help="The task directory (task.toml, repo/, tests/, gold.patch)."),
    patch: Path = typer.Option(..., "--patch", help="A unified diff to grade; an empty file means no change."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
    backend: Backend = typer.Option(Backend.bwrap, "--backend", help="bwrap (isolated) or local (isolates nothing)."),
) -> None:
    """Apply PATCH in a fresh sandbox, run the hidden tests, print the reward.
    Example: atelier tasks grade tasks/calc-add --patch tasks/calc-add/gold.patch"""
    from atelier.tasks.grade import grade
    from atelier.tasks.loader import load_task
    from atelier.tasks.schema import TaskError

    task = load_task(task_dir)
    try:
        patch_text = patch.read_bytes().decode("utf-8")  # CRLF lines kept for git apply
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"cannot read patch {patch}: {exc}",
                        hint="pass a unified diff file; an empty file means no change") from None
    result = grade(task, patch_text, backend=backend.value)
    data = result.to_json()
    if as_json:
        print(json.dumps({k: data[k] for k in ("reward", "fail_to_pass", "pass_to_pass", "tests",
                                                "error", "infra_error", "exit_code", "timeout_s",
                                                "tampered", "tamper", "tamper_suspect")}))
        return
    f, p = result.fail_to_pass, result.pass_to_pass
    typer.echo(f"task {task.id}: reward {result.reward:g}")
    typer.echo(f"  fail_to_pass {f.passed}/{f.total}   pass_to_pass {p.passed}/{p.total}")
    for node, status in result.tests.items():
        typer.echo(f"  {status:8} {node}")
    for why in result.tamper:
        typer.echo(f"  TAMPERED: {why}")
    for finding in result.tamper_suspect:
        typer.echo(f"  tamper_suspect: {finding}")
    if result.error:
        kind = "infrastructure error" if result.infra_error else "grading error"
        typer.echo(f"  {kind}: {result.error}")
        if result.log_tail:
            typer.echo("  --- test output (tail) ---\n" + result.log_tail)


@tasks_app.command("show")
def show_cmd(task_dir: Path = typer.Argument(..., help="The task directory.")) -> None:
    """Load and check a task, then print a summary (the gold patch is not shown).

    Example: atelier tasks show tasks/calc-add"""
    from atelier.tasks.loader import load_task

    task = load_task(task_dir)
    m = task.metadata
    env = (f"python {task.env.python}, {len(task.env.requirements)} requirement(s)"
           + (", system site-packages" if task.env.system_site_packages else "")
           if task.env.kind == "python" else "none")
    lines = [
        f"task {task.id}  ({task.root})",
        f"  source {m.source}, category {m.category}, "
        f"{m.files_changed} file(s) / {m.lines_changed} line(s) changed",
        f"  env: {env}",
        f"  test command: {task.test_command}",
        f"  hidden tests: {', '.join(task.hidden_tests) or '(none)'}",
        f"  fail_to_pass ({len(task.fail_to_pass)}):",
        *[f"    {n}" for n in task.fail_to_pass],
        f"  pass_to_pass ({len(task.pass_to_pass)}):",
        *[f"    {n}" for n in task.pass_to_pass],
        f"  gold patch: {len(task.gold_patch.splitlines())} line(s)",
        "  prompt:",
        *[f"    {line}" for line in task.prompt.splitlines()],
    ]
    typer.echo("\n".join(lines))


@tasks_app.command("validate")
def validate_cmd(
    path: Path = typer.Argument(..., help="A task directory or a suite of them."),
    runs: int = typer.Option(3, "--runs", min=1, help="Gold must pass in every one of these runs."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
    backend: Backend = typer.Option(Backend.bwrap, "--backend", help="bwrap (isolated) or local (isolates nothing)."),
) -> None:
    """Check each task: gold passes in every run, the empty patch fails.
    Exit 1 when any task is invalid. Example: atelier tasks validate suites/mut --runs 3"""
    from atelier.tasks.validate import summarize, task_dirs, validate

    if as_json:
        checks = validate(path, runs, backend=backend.value)
    else:
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            bar = progress.add_task("validating", total=len(task_dirs(path)))
            checks = validate(path, runs, backend=backend.value,
                              on_task=lambda c: progress.update(bar, advance=1, description=c.id))
    summary = summarize(checks)
    if as_json:
        print(json.dumps(summary))
    else:
        typer.echo(f"{summary['valid']}/{summary['tasks']} task(s) valid "
                   f"(gold x{runs}, empty x1); {summary['flaky']} flaky")
        for bad in summary["invalid"]:
            typer.echo(f"  INVALID {bad['id']}: {bad['reason']}")
        if summary["tampered"]:
            typer.echo(f"  gold graded tampered (a grader false positive): {', '.join(summary['tampered'])}")
        if summary["tamper_suspect"]:
            typer.echo(f"  gold flagged tamper_suspect by the static screen: "
                       f"{', '.join(summary['tamper_suspect'])}")
    if summary["invalid"]:
        raise typer.Exit(1)


@tasks_app.command("stats")
def stats_cmd(
    path: Path = typer.Argument(..., help="A task directory or a suite of them."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
) -> None:
    """Task counts per source and median prompt size and gold-patch size,
    beside the reference figures. Example: atelier tasks stats suites/mut"""
    from atelier.tasks.loader import load_task
    from atelier.tasks.stats import suite_stats
    from atelier.tasks.validate import task_dirs

    stats = suite_stats(load_task(d) for d in task_dirs(path))
    if as_json:
        print(json.dumps(stats))
        return

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    ref = stats["reference"]
    typer.echo(f"{stats['tasks']} task(s): "
               + ", ".join(f"{k} {v}" for k, v in stats["sources"].items()))
    typer.echo(f"  median prompt chars   {fmt(stats['median_prompt_chars']):>8}"
               f"   (reference benchmark {ref['reference benchmark']['prompt_chars']})")
    typer.echo(f"  median lines changed  {fmt(stats['median_lines_changed']):>8}"
               f"   (reference benchmark {ref['reference benchmark']['lines_changed']}, "
               f"SWE-bench {ref['SWE-bench']['lines_changed']})")
    typer.echo(f"  median files changed  {fmt(stats['median_files_changed']):>8}")
