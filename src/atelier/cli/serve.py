"""`atelier serve`: the OpenAI-compatible inference server over a local engine.

Heavy modules are imported inside the command so `atelier --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from atelier.inference.types import DEFAULT_KV_CACHE_TOKENS, DEFAULT_PREFIX_CACHE_TOKENS


def serve(
    model: str = typer.Option("smollm2-135m", "--model", "-m",
                              help="A model directory, a known name (smollm2-135m) or a cached hub id."),
    port: int = typer.Option(8000, "--port", "-p", help="TCP port to listen on."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (0.0.0.0 for all)."),
    device: str = typer.Option("cpu", "--device", help="torch device: cpu, cuda, cuda:1 ..."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="float32, bfloat16 or auto (the default: bf16 on GPUs and on CPUs with "
                              "AMX or AVX512-BF16, else fp32)."),
    max_batch: int = typer.Option(32, "--max-batch", help="Most sequences decoded together."),
    kv_cache_tokens: int = typer.Option(
        DEFAULT_KV_CACHE_TOKENS, "--kv-cache-tokens", min=64,
        help="The engine's whole KV memory, in token positions; requests wait when it is full."),
    prefix_cache_tokens: int = typer.Option(
        DEFAULT_PREFIX_CACHE_TOKENS, "--prefix-cache-tokens", min=0,
        help="Of that, tokens of earlier prompts kept for reuse (0: no prefix caching)."),
    max_queue: int = typer.Option(
        256, "--max-queue", min=0, help="Requests allowed to wait; past it the server answers 503."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", envvar="ATELIER_API_KEY", show_envvar=True,
        help="Require `Authorization: Bearer KEY` on every endpoint but /health (401 otherwise)."),
    weights_dir: Optional[Path] = typer.Option(
        None, "--enable-weight-updates", metavar="DIR", file_okay=False,
        help="Turn POST /v1/weights on, loading only safetensors files under DIR (off: 404)."),
    threads: Optional[int] = typer.Option(
        None, "--threads", min=1, help="CPU threads per engine step (default: chosen per step, as many as pay)."),
    compile: Optional[bool] = typer.Option(
        None, "--compile/--no-compile", help="Build the decode kernels with torch.compile (default: where a "
                                             "C++ compiler is found)."),
    speculate: Optional[bool] = typer.Option(
        None, "--speculate/--no-speculate", help="Decode speculatively (default: where the model has MTP "
                                                 "heads, while that is faster; --speculate on a model "
                                                 "without heads drafts by lookup alone)."),
    lookup: bool = typer.Option(
        True, "--lookup/--no-lookup", help="Where speculating, also draft the tokens that followed the "
                                           "context's last tokens where they occurred before."),
) -> None:
    """Serve MODEL over HTTP: /v1/chat/completions and /v1/completions (OpenAI, streaming,
    logprobs, echo), /v1/models, /v1/generate (token ids), /health, and /v1/weights when
    weight updates are on.
    Example: ATELIER_API_KEY=s3cret atelier serve --model smollm2-135m --host 0.0.0.0 --port 8000
    --enable-weight-updates /srv/weights"""
    from atelier.errors import AtelierError
    from atelier.inference.models import is_url, open_model

    if is_url(model):
        raise AtelierError(f"--model {model} is a server URL; `atelier serve` serves a local model",
                           hint="pass a model directory or a known name such as smollm2-135m")
    import uvicorn

    from atelier.inference.access import exposed
    from atelier.inference.server import create_app

    if weights_dir is not None and not weights_dir.is_dir():
        raise AtelierError(f"--enable-weight-updates {weights_dir}: no such directory",
                           hint="create it, or name the directory the trainer writes weights to")
    if exposed(host) and not api_key:
        typer.echo(f"warning: serving on {host} without an API key: anyone who reaches port {port} can use "
                   "the model; pass --api-key KEY (or set ATELIER_API_KEY)", err=True)
    from atelier.train.devices import return_freed_memory

    return_freed_memory()   # a request's large activations go back to the OS when it ends
    with open_model(model, device=device, dtype=dtype, max_batch=max_batch, kv_cache_tokens=kv_cache_tokens,
                    prefix_cache_tokens=prefix_cache_tokens, max_queue=max_queue, threads=threads,
                    compile=compile, speculate=speculate, lookup=lookup) as engine:
        typer.echo(f"serving {engine.name} ({str(engine.dtype).removeprefix('torch.')}, KV "
                   f"{engine.kv_bytes / 2**20:.0f} MiB for {engine.kv_cache_tokens} tokens) on "
                   f"http://{host}:{port}/v1{', API key required' if api_key else ''}"
                   f"{f', weight updates from {weights_dir}' if weights_dir else ''}"
                   f"{speculation(engine)}", err=True)
        app = create_app(engine, api_key=api_key, weights_dir=weights_dir)
        uvicorn.run(app, host=host, port=port, log_level="warning")



def speculation(engine) -> str:
    """What the start-up line says of the engine's speculative decoding ('' where it has none)."""
    names = {"heads": "its MTP heads", "lookup": "lookup drafts"}
    drafters = [names[d] for d in getattr(engine, "drafters", ())]
    return f", speculating with {' and '.join(drafters)}" if drafters else ""
