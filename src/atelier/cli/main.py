"""Entry point of the `atelier` command.

`atelier --help` must answer in well under a second, so this module imports
only typer at the top. Every command imports its heavy module (torch, ray,
the sandbox backends) inside its own function body, after the arguments are
parsed. Sub-apps live in their own modules (`atelier.cli.sandbox` defines
`sandbox_app`, `atelier.cli.tasks` defines `tasks_app`) and are attached by
`register_subcommands`.

`main` turns every `AtelierError` (a user error: bad config, missing tool)
into `error: ...` / `hint: ...` on stderr and exit status 2, never a
traceback. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="atelier",
    help="Train and evaluate agentic coding models.",
    no_args_is_help=True,
    add_completion=False,
)

_registered = False


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


def register_subcommands() -> None:
    """Attach the sub-apps to `app` (once)."""
    global _registered
    if _registered:
        return
    _registered = True
    # Each sub-app module imports only typer at its top, so this stays cheap.
    from atelier.cli.sandbox import sandbox_app
    from atelier.cli.tasks import tasks_app

    app.add_typer(sandbox_app, name="sandbox")
    app.add_typer(tasks_app, name="tasks")


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; user errors print a message and a hint and exit with status 2."""
    from atelier.errors import AtelierError

    register_subcommands()
    try:
        app(args=argv, prog_name="atelier")
    except AtelierError as exc:
        typer.secho("error: ", fg="red", bold=True, err=True, nl=False)
        typer.echo(exc.message, err=True)
        if exc.hint:
            typer.secho("hint: ", fg="cyan", bold=True, err=True, nl=False)
            typer.echo(exc.hint, err=True)
        raise SystemExit(2) from None


register_subcommands()

if __name__ == "__main__":
    main()
