"""Entry point of the `atelier` command.

`atelier --help` must answer in well under a second, so this module imports
only typer at the top. Every command imports its heavy module (torch, ray,
the sandbox backends) inside its own function body, after the arguments are
parsed. Each command group lives in its own module of `atelier.cli` that
defines `register(app)`; `register_subcommands` finds those modules by listing
the package, so adding a command never touches this file.

`main` turns every `AtelierError` (a user error: bad config, missing tool)
into `error: ...` / `hint: ...` on stderr and exit status 2, never a
traceback. A `BugError` (a bug caught at a batch edge, which already wrote
its traceback to the run's failures.log) prints the same way and exits
with status 1. Any other exception is a bug and keeps its traceback.
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
    """Attach every command module's commands to `app` (once).

    A module of `atelier.cli` takes part by defining `register(app)`; each
    imports only typer at its top, so this stays cheap.
    """
    global _registered
    if _registered:
        return
    _registered = True
    import importlib
    import pkgutil

    import atelier.cli as package

    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name in {"main", "__main__", "options"}:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if callable(register):
            register(app)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; user errors print a message and a hint and exit with status 2."""
    from atelier.errors import AtelierError, BugError

    register_subcommands()
    try:
        app(args=argv, prog_name="atelier")
    except (AtelierError, BugError) as exc:
        typer.secho("error: ", fg="red", bold=True, err=True, nl=False)
        typer.echo(exc.message, err=True)
        if exc.hint:
            typer.secho("hint: ", fg="cyan", bold=True, err=True, nl=False)
            typer.echo(exc.hint, err=True)
        raise SystemExit(1 if isinstance(exc, BugError) else 2) from None


register_subcommands()

if __name__ == "__main__":
    main()
