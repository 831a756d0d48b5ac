"""Fixtures shared by every test package."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from atelier.sandbox import SandboxConfig, SandboxUnavailable


@pytest.fixture(scope="session")
def bwrap_ready() -> None:
    """Skip when this machine cannot run bubblewrap sandboxes, saying why."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (`bwrap`) is not on PATH")
    from atelier.sandbox.bwrap import BwrapSandbox, check_available

    try:
        check_available()
        with tempfile.TemporaryDirectory() as empty:
            BwrapSandbox(empty, SandboxConfig(timeout_s=5)).close()
    except SandboxUnavailable as exc:
        pytest.skip(f"bubblewrap sandboxes cannot run here: {exc}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Llama model with a ChatML BPE tokenizer, built once per test session."""
    from atelier.inference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
