"""Fixtures for evaluation tests: the two-task suite of `tests.helpers.build_suite` and one
venv cache for the session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import build_suite


@pytest.fixture
def suite(tmp_path: Path, bwrap_ready: None) -> Path:
    return build_suite(tmp_path)


@pytest.fixture(scope="session")
def env_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One venv cache for the session: the calc env is built once."""
    return str(tmp_path_factory.mktemp("eval-envs"))
