"""Lets `python -m atelier.cli` behave like the `atelier` console script."""

from atelier.cli.main import main

main()
