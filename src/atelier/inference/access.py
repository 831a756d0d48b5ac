"""Who may call `atelier serve`, and what `/v1/weights` may load.

- An API key (`--api-key KEY`, or the `ATELIER_API_KEY` environment
  variable, as vLLM's `--api-key` and `VLLM_API_KEY`): every path but
  `/health` then answers 401 unless the request carries `Authorization:
  Bearer KEY`. The comparison takes the same time whatever the bytes sent
  (`hmac.compare_digest`), so timing does not reveal the key. `/health`
  stays open for load balancers and `kubectl`-style probes.
- Weight updates are off unless the server is started with a directory
  (`--enable-weight-updates DIR`): `/v1/weights` then loads only files under
  it. The named path is resolved (every symbolic link followed) and so is
  each `*.safetensors` file of a named directory; one that lands outside the
  directory is refused. The files are opened by their resolved paths, so a
  link swapped in after the check leads nowhere new, short of the directory's
  owner replacing the files themselves.
- `exposed(host)`: whether a bind address reaches beyond this machine, for the
  warning `atelier serve` prints when such a server has no key.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from pathlib import Path
from typing import Any

from atelier.inference.openai_requests import BadRequest

API_KEY_ENV = "ATELIER_API_KEY"
OPEN_PATHS = frozenset({"/health"})


class RequireApiKey:
    """ASGI middleware: 401 in OpenAI's error shape for a request without the key.

    Plain ASGI rather than Starlette's `BaseHTTPMiddleware`, which would sit
    between a handler and its client's disconnect message (the server cancels
    a request whose client went away)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {
            "message": "missing or wrong API key", "type": "invalid_request_error", "param": None,
            "code": "invalid_api_key",
            "hint": "send the header `Authorization: Bearer KEY` with the key the server was started with "
                    f"(--api-key or {API_KEY_ENV}); OpenAI clients send their api_key this way"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope) -> bool:
        sent = [value for name, value in scope["headers"] if name == b"authorization"]
        return len(sent) == 1 and hmac.compare_digest(sent[0], self._expected)


def exposed(host: str) -> bool:
    """Whether binding `host` listens beyond the loopback interface."""
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True  # a host name: it may well resolve to a public address


def weight_files(root: Path, requested: str) -> list[Path]:
    """The resolved `*.safetensors` files `requested` names under `root` (a file, or a directory
    and its files; relative paths are taken from `root`); a 400 for anything outside it."""
    root = root.resolve()
    try:
        target = (root / requested).resolve()
    except (OSError, ValueError) as exc:  # a NUL byte, a loop of links, a name too long
        raise BadRequest(f"weights path {requested!r} cannot be resolved: {exc}", param="path",
                         hint="name a file or directory under the weights directory") from exc

    def inside(path: Path) -> Path:
        if not path.is_relative_to(root):
            raise BadRequest(f"weights path {requested!r} leads outside the weights directory", param="path",
                             hint="name a file or directory under the directory given to "
                                  "--enable-weight-updates (symbolic links out of it are refused)")
        return path

    inside(target)
    files = sorted(target.glob("*.safetensors")) if target.is_dir() else [target]
    files = [inside(f.resolve()) for f in files]
    if not files or not all(f.is_file() for f in files):
        raise BadRequest(f"no safetensors weights at {requested!r} in the weights directory", param="path",
                         hint="name a .safetensors file or a directory that holds some, relative to the "
                              "weights directory")
    return files


def load_weights(root: Path, requested: str) -> dict[str, Any]:
    """The tensors of the safetensors files `requested` names under `root` (`weight_files`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in weight_files(root, requested):
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as exc:
            raise BadRequest(f"cannot read safetensors weights from {requested!r}: {exc}", param="path",
                             hint="write the weights with safetensors' save_file") from exc
    return tensors
