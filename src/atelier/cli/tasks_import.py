"""`atelier tasks import …`: convert SWE-bench and Terminal-Bench/Harbor tasks.

Heavy modules are imported inside the commands so `atelier --help` stays fast.
"""

from __future__ import annotations

import typer

import_app = typer.Typer(help="Import tasks from other benchmark formats.", no_args_is_help=True)
