"""Entry point of the `atelier` command: the command list, and how errors look.

`atelier --help` must answer in well under a second, so this module and
every command module import only typer at the top. Each command imports its
heavy module (torch, ray, the sandbox backends) inside its own function body,
after the arguments are parsed. The commands are listed here, in the order
`--help` shows them; `rank` (what `atelier train` and `atelier pretrain`
start once per trainer rank) is internal and hidden from it.

`main` turns every `AtelierError` (a user error: bad config, missing tool)
into `error: ...` / `hint: ...` on stderr and exit status 2, never a
traceback. A `BugError` (a bug caught at a batch edge, which already wrote
its traceback to the run's failures.log) prints the same way and exits
with status 1. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import typer

from atelier.cli import (
    agent,
    base_eval,
    eval,
    models,
    pretrain,
    rank,
    report,
    run,
    sandbox,
    serve,
    simulate,
    tasks,
    train,
)

app = typer.Typer(
    name="atelier",
    help="Train and evaluate agentic coding models.",
    no_args_is_help=True,
    add_completion=False,
)

app.command("run")(run.run)
app.command("train")(train.train)
app.command("pretrain")(pretrain.pretrain_cmd)
app.command("eval")(eval.eval_cmd)
app.command("base-eval")(base_eval.base_eval_cmd)
app.command("agent")(agent.agent)
app.command("serve")(serve.serve)
app.command("report")(report.report_cmd)
app.add_typer(models.models_app, name="models")
app.add_typer(tasks.tasks_app, name="tasks")
app.add_typer(sandbox.sandbox_app, name="sandbox")
app.add_typer(simulate.simulate_app, name="simulate")
app.command("rank", hidden=True)(rank.rank_cmd)


def _show_version(value: bool) -> None:
    if value:
        from atelier import __version__

        typer.echo(f"atelier {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    """Options that come before any subcommand; `app`'s help is the user text."""


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; user errors print a message and a hint and exit with status 2."""
    from atelier.errors import AtelierError, BugError

    try:
        app(args=argv, prog_name="atelier")
    except (AtelierError, BugError) as exc:
        typer.secho("error: ", fg="red", bold=True, err=True, nl=False)
        typer.echo(exc.message, err=True)
        if exc.hint:
            typer.secho("hint: ", fg="cyan", bold=True, err=True, nl=False)
            typer.echo(exc.hint, err=True)
        raise SystemExit(1 if isinstance(exc, BugError) else 2) from None


if __name__ == "__main__":
    main()
