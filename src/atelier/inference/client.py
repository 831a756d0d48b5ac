"""HTTP clients: a `TokenModel` over our `/v1/generate`, a `ChatModel` over any OpenAI endpoint.

- `GenerateClient(base_url, tokenizer=None, api_key=None)`: token ids in,
  token ids, logprobs and versions out, against `atelier serve` (`api_key`:
  the server's `--api-key`). The tokenizer is passed in, or loaded from the
  `tokenizer_path` that `/v1/models` advertises (which works when client
  and server share a filesystem).
- `OpenAIChatModel(base_url, api_key=None, model=None)`: chat messages in, an
  assistant message out, against any OpenAI-compatible server (ours, vLLM,
  SGLang, a hosted API). Native `tool_calls` are returned normalised to
  `{"id", "name", "arguments"}` with `arguments` parsed from JSON when it is
  valid JSON, else left as the raw string (the harness counts it as broken).
- `connect(url, **kwargs)`: the first when the server is ours, else the second.

Both are thread-safe (one pooled `httpx.Client`), so many rollouts can share one.
A base URL may be given with or without the trailing `/v1`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from atelier.errors import AtelierError, InfraError
from atelier.inference.routes import decode_routes
from atelier.inference.types import ChatReply, Generation, SamplingParams


class ServerError(AtelierError):
    """The inference server could not be reached or refused a request."""


class ServerUnreachable(ServerError, InfraError):
    """No answer, or one that says the server cannot serve now (5xx, 429): infrastructure."""


def _root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _http(base_url: str, timeout: float, api_key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=_root(base_url), timeout=timeout, headers=headers,
                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise ServerUnreachable(f"cannot reach the inference server at {client.base_url}: {exc}",
                                hint="start it with `atelier serve --model M --port P`, or check the URL") from exc
    if response.status_code >= 400:
        try:
            error = response.json().get("error", {})
        except ValueError:
            error = {}
        message = error.get("message") if isinstance(error, dict) else None
        kind = ServerUnreachable if response.status_code >= 500 or response.status_code == 429 else ServerError
        raise kind(f"{path} answered {response.status_code}: {message or response.text[:300]}",
                   hint=(error.get("hint") if isinstance(error, dict) else None))
    return response.json()


def _sampling_body(params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": params.max_tokens, "temperature": params.temperature,
                            "top_p": params.top_p}
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    return body


class GenerateClient:
    """A `TokenModel` served by `atelier serve` (see the module docstring)."""

    def __init__(self, base_url: str, tokenizer: Any = None, *, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        self.base_url = _root(base_url)
        self._client = _http(base_url, timeout, api_key)
        entry = _call(self._client, "GET", "/v1/models")["data"][0]
        self.name = entry["id"]
        meta = entry.get("atelier") or {}
        self.max_seq_len: int | None = meta.get("max_seq_len")
        if tokenizer is None:
            path = meta.get("tokenizer_path")
            if not path:
                raise ServerError(f"{self.base_url} does not advertise a tokenizer",
                                  hint="pass tokenizer= to GenerateClient")
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except Exception as exc:
                raise ServerError(f"cannot load the server's tokenizer from {path}: {exc}",
                                  hint="pass tokenizer= (the model's tokenizer) to GenerateClient") from exc
        self.tokenizer = tokenizer

    @property
    def version(self) -> int:
        return int(_call(self._client, "GET", "/health")["version"])

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Generation:
        params = params or SamplingParams()
        body = {"prompt_ids": list(prompt_ids), **_sampling_body(params)}
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        out = _call(self._client, "POST", "/v1/generate", json=body)

        return Generation(token_ids=out["token_ids"], logprobs=out["logprobs"], versions=out["versions"],
                          finish_reason=out["finish_reason"], text=out.get("text", ""),
                          routes=decode_routes(out.get("routes")))

    def update_weights_from_path(self, path: str, version: int) -> int:
        """Ask the server to load safetensors weights from `path` as `version`: a path on the
        server's filesystem under the directory it was started with (`--enable-weight-updates
        DIR`), absolute or relative to it."""
        return int(_call(self._client, "POST", "/v1/weights", json={"path": str(path), "version": version})["tensors"])

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "GenerateClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parse_tool_calls(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` -> `[{"id", "name", "arguments"}]` (arguments parsed when valid JSON)."""
    calls = []
    for call in raw or []:
        function = call.get("function") or {}
        arguments: Any = function.get("arguments", "")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # keep the raw string: a malformed call the harness reports
        calls.append({"id": call.get("id"), "name": function.get("name", ""), "arguments": arguments})
    return calls


class OpenAIChatModel:
    """A `ChatModel` over any OpenAI-compatible `/v1/chat/completions` (see the module docstring)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, *,
                 timeout: float = 600.0) -> None:
        self.base_url = _root(base_url)
        self._client = _http(base_url, timeout, api_key)
        if model is None:
            data = _call(self._client, "GET", "/v1/models").get("data") or []
            if not data:
                raise ServerError(f"{self.base_url} lists no models", hint="pass model=")
            model = data[0]["id"]
        self.name = model

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
             tools: list[dict[str, Any]] | None = None) -> ChatReply:
        params = params or SamplingParams()
        body: dict[str, Any] = {"model": self.name, "messages": messages, **_sampling_body(params)}
        if tools:
            body["tools"] = tools
        out = _call(self._client, "POST", "/v1/chat/completions", json=body)
        choice = out["choices"][0]
        message = choice.get("message") or {}
        usage = out.get("usage") or {}
        return ChatReply(text=message.get("content") or "", tool_calls=parse_tool_calls(message.get("tool_calls")),
                         finish_reason=choice.get("finish_reason") or "stop",
                         prompt_tokens=int(usage.get("prompt_tokens") or 0),
                         completion_tokens=int(usage.get("completion_tokens") or 0))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "OpenAIChatModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(url: str, *, api_key: str | None = None, model: str | None = None, tokenizer: Any = None,
            timeout: float = 600.0):
    """A `GenerateClient` when `url` is an atelier server whose tokenizer we can load, else an `OpenAIChatModel`."""
    probe = _http(url, timeout, api_key)
    try:
        data = _call(probe, "GET", "/v1/models").get("data") or []
    finally:
        probe.close()
    if data and data[0].get("atelier") and (tokenizer is not None or _loadable(data[0]["atelier"])):
        return GenerateClient(url, tokenizer, api_key=api_key, timeout=timeout)
    return OpenAIChatModel(url, api_key, model, timeout=timeout)


def _loadable(meta: dict[str, Any]) -> bool:
    path = meta.get("tokenizer_path")
    return bool(path) and Path(path).is_dir()
