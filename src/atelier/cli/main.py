"""Entry point of the `atelier` command: the command list, and how errors look.

`atelier --help` must answer in well under a second, so this module and
every command module import only typer at the top. Each command imports its
heavy module (torch, ray, the sandbox backends) inside its own function body,
after the arguments are parsed. The commands are listed here, in the order
`--help` shows them; `rank` (what `atelier train` and `atelier pretrain`
start once per trainer rank) is internal and hidden from it.

Help text is written as docstrings, wrapped for the source; `plain_help`
(applied to every command by `unbreak_help`) joins each paragraph's lines,
because typer's rich output keeps a docstring's line breaks and rewraps
around them, which broke sentences mid-line. Every command's help ends with
one real `Example:` line (tests/test_cli_help.py runs each through the
command's own parser).

`main` turns every `AtelierError` (a user error: bad config, missing tool)
into `error: ...` / `hint: ...` on stderr and exit status 2, never a
traceback. A `BugError` (a bug caught at a batch edge, which already wrote
its traceback to the run's failures.log) prints the same way and exits
with status 1. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import inspect
import re

import typer

from atelier.cli import (
    agent,
    base_eval,
    eval,
    models,
    mtp,
    pretrain,
    rank,
    report,
    results,
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
app.add_typer(mtp.mtp_app, name="mtp")
app.add_typer(tasks.tasks_app, name="tasks")
app.add_typer(sandbox.sandbox_app, name="sandbox")
app.add_typer(simulate.simulate_app, name="simulate")
app.add_typer(results.results_app, name="results")
app.command("rank", hidden=True)(rank.rank_cmd)


def plain_help(text: str | None) -> str | None:
    """`text` (a docstring) as help should show it: each paragraph on one line, for the terminal
    to wrap, and an `Example:` always a paragraph of its own (pure)."""
    if not text:
        return text
    paragraphs: list[str] = []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(text)):
        joined = " ".join(line.strip() for line in block.splitlines())
        before, mark, example = joined.partition("Example: ")
        paragraphs += [part for part in (before.strip(), (mark + example).strip()) if part]
    return "\n\n".join(paragraphs)


def unbreak_help(typer_app: typer.Typer) -> None:
    """Give every command and group of `typer_app` its `plain_help`, before typer reads them."""
    for info in typer_app.registered_commands:
        info.help = plain_help(info.help if isinstance(info.help, str) else inspect.getdoc(info.callback))
    callback = typer_app.registered_callback
    if isinstance(typer_app.info.help, str):   # typer's help= wins over a callback's docstring
        typer_app.info.help = plain_help(typer_app.info.help)
    elif callback is not None and callback.callback is not None:
        callback.help = plain_help(callback.help if isinstance(callback.help, str)
                                   else inspect.getdoc(callback.callback))
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            unbreak_help(group.typer_instance)


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


unbreak_help(app)


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
