"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when something first imports it, and torch.compile (which the
# engine uses) imports it: set here, before any test, so the kernel tests run it interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny tied-embedding model vLLM's CPU build runs (head size 32), with spread-out logits."""
    from atelier.inference.tiny import VLLM_SHAPE, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm-model"), initializer_range=0.2, **VLLM_SHAPE)


VLLM_TEST_CHUNK = 8


@pytest.fixture(scope="session")
def vllm_engine(vllm_model_dir, tmp_path_factory: pytest.TempPathFactory):
    """One real vLLM server (CPU build, fp32, eager) for the whole session; skips when its environment
    is absent."""
    from atelier.inference.vllm_server import VLLMConfig, VLLMUnavailable, find_vllm_python

    try:
        find_vllm_python(VLLMConfig())
    except VLLMUnavailable as exc:
        pytest.skip(f"the vLLM environment is absent ({exc.message}); `make vllm-env` builds it")
    from atelier.inference.vllm_engine import VLLMEngine

    config = VLLMConfig(dtype="float32", chunk_tokens=VLLM_TEST_CHUNK, enforce_eager=True, kv_cache_gb=1,
                        max_model_len=1024)
    with VLLMEngine(vllm_model_dir, config, work_dir=tmp_path_factory.mktemp("vllm-work")) as engine:
        yield engine


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray instance for a module's `ray` tests; one an earlier module started is shared."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'atelier-rl[ray]'")
    if ray.is_initialized():
        yield ray
        return
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


# Under pytest-xdist (`make test` runs two workers), tests go to workers by `xdist_group`: a file's
# tests stay together (its module fixtures are built once), and every test of the one vLLM server,
# or of the shared Ray instance, runs on one worker, so each is started once per session.
SHARED_ONCE = {"vllm_engine": "vllm", "ray_instance": "ray"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        shared = [group for fixture, group in SHARED_ONCE.items() if fixture in item.fixturenames]
        item.add_marker(pytest.mark.xdist_group(shared[0] if shared else item.nodeid.split("::")[0]))
