"""Fixtures for the inference tests: a tiny model with spread-out logits, and engines over it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate_concurrently(engine, prompts, params, timeout: float) -> list[list[int] | None]:
    """Each of `prompts` generated from its own thread, all released at once so the engine
    batches them; `params[i]` samples prompt i. Returns the token ids (None where a thread
    did not finish within `timeout`)."""
    results: list[list[int] | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = engine.generate(prompts[i], params[i]).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    return results


@contextlib.contextmanager
def serving(engine, **options):
    """Serve `engine` with uvicorn on a free port in a thread (`options`: `create_app`'s); yield the
    base URL."""
    import uvicorn

    from atelier.inference.server import create_app

    srv = uvicorn.Server(uvicorn.Config(create_app(engine, **options), host="127.0.0.1", port=free_port(),
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    assert srv.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{srv.config.port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def spiky_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model initialised with larger weights, so greedy outputs vary from token to token.

    The default tiny model's logits are nearly flat and its greedy output repeats one token,
    which would make "equals the reference" checks weak.
    """
    from atelier.inference.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("spiky-model"), initializer_range=0.2)


@pytest.fixture(scope="module")
def engine(spiky_model_dir):
    from atelier.inference.engine import LocalEngine

    with LocalEngine(spiky_model_dir, dtype="float32", max_batch=8) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(spiky_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(spiky_model_dir).eval()


@pytest.fixture(scope="module")
def litellm():
    """The litellm module, imported without fetching its price list (skips where it is absent)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    module = pytest.importorskip("litellm")
    module.suppress_debug_info = True
    yield module
    mp.undo()


@contextlib.contextmanager
def atelier_serve(args: list[str], env: dict[str, str] | None = None):
    """`atelier serve ARGS` as a process of its own on a free port, until it answers /health;
    yields (base URL, what it wrote to stderr until then). Terminated on exit."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "atelier.cli.main", "serve", *args, "--port", str(port)],
                            env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = []
        assert proc.stderr is not None
        for line in proc.stderr:  # the "serving ..." line comes once the model is loaded
            lines.append(line)
            if line.startswith("serving "):
                break
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "".join(lines)
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "".join(lines)
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", "".join(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
