"""`atelier tasks build …`: make tasks from real code (release diffs, mutations, suites).

Heavy modules are imported inside the commands so `atelier --help` stays fast.
"""

from __future__ import annotations

import typer

build_app = typer.Typer(help="Build tasks from real code.", no_args_is_help=True)
