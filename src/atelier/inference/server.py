"""An OpenAI-compatible HTTP server over a `LocalEngine`, plus token-level endpoints.

`create_app(engine, *, api_key=None, weights_dir=None) -> FastAPI`;
`atelier serve --model M --port P [--api-key KEY] [--enable-weight-updates DIR]`
runs it. With `api_key`, every path but `/health` answers 401 without
`Authorization: Bearer KEY`; `/v1/weights` answers 404 unless `weights_dir`
is given, and then loads only from under it (see `atelier.inference.access`).

Endpoints:

- `GET /health` -> `{"status": "ok", "model", "version"}`.
- `GET /v1/models` -> the OpenAI list; the one entry carries an `atelier`
  object: `version`, `tokenizer_path` (the model directory, from which a
  client on the same filesystem loads the tokenizer) and `max_seq_len`.
- `POST /v1/chat/completions` (OpenAI): `n` choices, `logprobs` with
  `top_logprobs` (N most likely per token), `usage`, `stream: true`
  (server-sent events, `stream_options.include_usage`). Every choice, and
  every streamed chunk, carries an `atelier` extension: `token_ids`,
  `logprobs`, `versions` of the tokens it covers (the final choice also has
  `prompt_token_ids`), so a client that streams still gets every token id
  exactly once. When the request declares `tools` (and `tool_choice` is not
  "none"), well-formed `<tool_call>` blocks in a non-streamed reply come back
  as native `tool_calls` (finish_reason "tool_calls"); streamed replies carry
  the text as generated.
- `POST /v1/completions` (OpenAI's legacy API, as vLLM serves it): `prompt`
  is a string, a list of token ids, or a list of either (one choice per
  prompt per `n`, `index = prompt * n + j`); `logprobs: N` gives each
  token's logprob and the N most likely tokens; `echo` puts the prompt before
  the completion, and with `logprobs` scores it (its first token's logprob is
  null), and allows `max_tokens: 0` (the prompt alone, what lm-evaluation-
  harness's loglikelihood tasks ask for). Shapes: `atelier.inference.openai_replies`.
- `POST /v1/generate`: `{"prompt_ids": [...], "max_tokens", "temperature",
  "top_p", "seed", "stop_token_ids", "stop"}` -> `{"token_ids", "logprobs",
  "versions", "finish_reason", "text"}`, plus `"routes"` on an MoE model: the
  experts chosen for every position of prompt + tokens, `{"dtype", "shape",
  "b64"}` (atelier.inference.routes; router replay).
- `POST /v1/weights` (only with `weights_dir`): `{"path": "<file.safetensors
  or directory, under weights_dir>", "version": N}` loads the tensors (model
  `state_dict` names; a subset is fine) between decode steps and answers
  `{"version": N, "tensors": count}` once they are live. In-flight requests
  continue on the new weights; the versions in their replies show where the
  change happened.

Sampling: logprobs, the prompt's included, are those of the request's
temperature (greedy: the untempered distribution), before top-p
(`atelier.inference.sampling`). `n` > 1 submits n requests that the engine
batches; with a `seed`, choice j samples with seed + j, so a seeded request
reproduces.

Errors a client causes answer a 4xx with OpenAI's error shape plus a hint,
`{"error": {"message", "type", "param", "code", "hint"}}`:

- 400: a body that is not JSON or not an object, a field of the wrong type, a
  field this server does not implement (named; see
  `atelier.inference.openai_requests` for those accepted at a value that asks
  for nothing), an empty `messages` list, `max_tokens` below 1 (0 with
  `echo`) or above the model's context, a prompt that does not fit the
  context, a `temperature` below 0 or not finite, `top_p` outside (0, 1], a
  `seed` wider than 64 bits, an empty stop string, `n` outside [1, 128] or
  more choices than the queue holds, `logprobs`/`top_logprobs` above 20,
  logprobs with `stream`, a chat template that cannot render the messages,
  bad weights or a weights path outside `weights_dir`;
- 401: no or a wrong API key (when the server has one);
- 404: a `model` that is not the one served (its name, its directory, or the
  directory's base name; leaving `model` out is fine), `/v1/weights` when
  weight updates are off, an unknown path;
- 503 with `Retry-After`: more than `max_queue` requests already wait for the
  engine (the `openai` client retries these by itself).

Concurrency and cancellation: handlers are coroutines. A request's choices go
to the engine with `engine.submit` and the handler awaits their completion,
so any number of clients wait without a thread each, and the engine batches
them. While it waits, the handler also listens for the client going away: a
non-streaming client that disconnects, or a streaming one whose connection
drops (Starlette cancels the stream), cancels its requests, which leave the
engine within one step and give back their KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from atelier.errors import AtelierError, InfraError
from atelier.inference import openai_replies as replies
from atelier.inference.access import RequireApiKey, load_weights
from atelier.inference.engine import EngineBusy
from atelier.inference.openai_replies import split_tool_calls, visible_text  # noqa: F401  (re-exported)
from atelier.inference.openai_requests import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    WeightsRequest,
    validation_message,
    with_limits,
)
from atelier.inference.routes import encode_routes
from atelier.inference.streaming import Choice, stream, submit_all
from atelier.inference.types import Generation, SamplingParams


class ServedEngine(Protocol):
    """What `create_app` needs of an engine (`LocalEngine` has it all)."""

    name: str
    path: Path
    tokenizer: Any
    version: int
    max_seq_len: int
    max_queue: int | None
    waiting: int
    pool: Any

    def check_request(self, prompt_tokens: int, max_tokens: int, *, strict: bool = False,
                      scoring: bool = False) -> None: ...

    def submit(self, prompt_ids: list[int], params: SamplingParams, on_token=None, on_done=None): ...

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None: ...


def _error(status: int, message: str, hint: str | None = None, *, type_: str = "invalid_request_error",
           param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={"error": {
        "message": message, "type": type_, "param": param, "code": code, "hint": hint}})


class _ClientGone(Exception):
    """The HTTP client disconnected before its request finished."""


def create_app(engine: ServedEngine, *, api_key: str | None = None, weights_dir: str | Path | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (a `LocalEngine`); see the module docstring.

    `api_key`: required of every request but `/health` (None: no authentication).
    `weights_dir`: turns `/v1/weights` on, for files under this directory (None: 404).
    """
    app = FastAPI(title="atelier inference")
    served = _Served(engine)
    _add_error_handlers(app)
    _add_atelier_routes(app, served, None if weights_dir is None else Path(weights_dir))
    _add_openai_routes(app, served)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.openapi = lambda: _openapi_with_limits(app, engine)  # type: ignore[method-assign]
    return app


def _openapi_with_limits(app: FastAPI, engine: ServedEngine) -> dict[str, Any]:
    """FastAPI's schema of `app`, with this engine's limits (`with_limits`)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        app.openapi_schema = with_limits(schema, engine.max_seq_len, len(engine.tokenizer))
    return app.openapi_schema


def _add_error_handlers(app: FastAPI) -> None:
    """Errors as OpenAI-style JSON bodies: a full queue 503 with Retry-After, bad requests 4xx."""

    @app.exception_handler(EngineBusy)
    async def _busy(request: Request, exc: EngineBusy) -> JSONResponse:
        return _error(503, exc.message, exc.hint, type_="server_busy", code="queue_full",
                      headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc.status, exc.message, exc.hint, param=exc.param, code=exc.code)

    @app.exception_handler(AtelierError)
    async def _user_error(request: Request, exc: AtelierError) -> JSONResponse:
        if isinstance(exc, InfraError):  # the engine closed under the request: not the client's doing
            return _error(503, exc.message, exc.hint, type_=type(exc).__name__, headers={"Retry-After": "5"})
        return _error(400, exc.message, exc.hint, type_=type(exc).__name__)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, hint = validation_message(list(exc.errors()))
        return _error(400, message, hint, param=param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        hint = ("see GET /docs for the endpoints" if exc.status_code in (404, 405)
                else "send a UTF-8 JSON object" if exc.status_code == 400 else None)
        return _error(exc.status_code, str(exc.detail), hint, headers=getattr(exc, "headers", None))


def _add_atelier_routes(app: FastAPI, served: _Served, weights_dir: Path | None) -> None:
    """/health, /v1/models, /v1/generate (token ids in and out) and /v1/weights."""
    engine = served.engine

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.name, "version": engine.version,
                "waiting": engine.waiting, "kv_blocks_used": engine.pool.used,
                "kv_blocks": engine.pool.num_blocks}

    @app.get("/v1/models")
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": engine.name, "object": "model", "created": 0, "owned_by": "atelier",
            "atelier": {"version": engine.version, "tokenizer_path": str(engine.path),
                        "max_seq_len": engine.max_seq_len},
        }]}

    @app.post("/v1/generate")
    async def generate(req: GenerateRequest, request: Request):
        params = served.checked(req.prompt_ids, req.params(256), req.max_tokens_given)
        try:
            [gen] = await _complete(engine, [(req.prompt_ids, params)], request)
        except _ClientGone:
            return Response(status_code=499)
        out = {"token_ids": gen.token_ids, "logprobs": gen.logprobs, "versions": gen.versions,
               "finish_reason": gen.finish_reason, "text": gen.text}
        if gen.routes is not None:
            out["routes"] = encode_routes(gen.routes)
        return out

    @app.post("/v1/weights")
    def weights(req: WeightsRequest) -> dict[str, Any]:
        if weights_dir is None:
            raise BadRequest("weight updates are off on this server", status=404, code="weight_updates_off",
                             hint="start it with `atelier serve --enable-weight-updates DIR` to load "
                                  "weights from under DIR")
        tensors = load_weights(weights_dir, req.path)
        engine.update_weights(tensors, req.version)
        return {"version": engine.version, "tensors": len(tensors)}


def _add_openai_routes(app: FastAPI, served: _Served) -> None:
    """/v1/completions and /v1/chat/completions (streaming or not)."""
    engine = served.engine

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        served.check_model(req.model)
        n, params = req.check(), req.sampling()
        prompts, texts = await run_in_threadpool(served.completion_prompts, req.prompt)
        served.check_choices(n * len(prompts))
        fitted = [served.checked(prompt, params, req.max_tokens_given) for prompt in prompts]
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": engine.name}
        jobs = [(i * n + j, prompt, _seeded(fitted[i], j)) for i, prompt in enumerate(prompts) for j in range(n)]
        echoes = [texts[k // n] if req.echo else "" for k, _, _ in jobs]
        if req.stream:
            choices = [Choice(k, prompt, p, echo) for (k, prompt, p), echo in zip(jobs, echoes)]
            return stream(engine, choices, base, chat=False, include_usage=req.include_usage, prompts=prompts)
        try:
            gens = await _complete(engine, [(prompt, p) for _, prompt, p in jobs], request)
        except _ClientGone:
            return Response(status_code=499)
        return await run_in_threadpool(served.completion_reply, base, req, jobs, echoes, gens, prompts)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        served.check_model(req.model)
        n, params = req.check(), req.sampling()
        served.check_choices(n)
        prompt = await run_in_threadpool(served.chat_prompt, req)
        params = served.checked(prompt, params, req.max_tokens_given)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": engine.name}
        if req.stream:
            choices = [Choice(j, prompt, _seeded(params, j)) for j in range(n)]
            return stream(engine, choices, {**base, "object": "chat.completion.chunk"}, chat=True,
                          include_usage=req.include_usage, prompts=[prompt])
        try:
            gens = await _complete(engine, [(prompt, _seeded(params, j)) for j in range(n)], request)
        except _ClientGone:
            return Response(status_code=499)
        choices = []
        for j, gen in enumerate(gens):
            message, finish = replies.chat_message(visible_text(gen.text, params.stop, True), req.parses_tool_calls)
            logprobs = replies.chat_logprobs(served.tokenizer, gen) if req.logprobs else None
            choices.append({"index": j, "message": message, "logprobs": logprobs,
                            "finish_reason": finish or gen.finish_reason, "atelier": replies.extension(gen, prompt)})
        return {**base, "choices": choices, "usage": replies.usage([prompt], gens)}


def _seeded(params: SamplingParams, j: int) -> SamplingParams:
    """The parameters of a request's choice j: with a seed, seed + j (kept within 64 bits)."""
    if j == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + j) % 2**64)


class _Served:
    """What the routes of `create_app` share: the engine, its tokenizer, the names it answers to,
    and the checks and shapes every endpoint uses."""

    def __init__(self, engine: ServedEngine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.names = {engine.name, str(engine.path), engine.path.name}

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise BadRequest(f"model {model!r} is not served here; this server serves {self.engine.name!r}",
                             hint="pass that name, or leave `model` out",
                             status=404, param="model", code="model_not_found")

    def checked(self, prompt: list[int], params: SamplingParams, max_tokens_given: bool) -> SamplingParams:
        """`params` for `prompt`, refused where the engine could never serve them; a default
        `max_tokens` (none was given) is cut to the room the context leaves after the prompt."""
        if not max_tokens_given:
            params = replace(params, max_tokens=max(1, min(params.max_tokens, self.engine.max_seq_len - len(prompt))))
        try:
            self.engine.check_request(len(prompt), params.max_tokens, strict=True,
                                      scoring=params.prompt_logprobs is not None)
        except AtelierError as exc:
            raise BadRequest(exc.message, exc.hint, param="max_tokens" if "max_tokens" in exc.message else None)
        return params

    def check_choices(self, count: int) -> None:
        """Refuse `count` choices when they alone would overflow the engine's queue (a 503 that no
        retry could cure)."""
        limit = self.engine.max_queue
        if limit is not None and count > max(limit, 1):
            raise BadRequest(f"this request asks for {count} choices (n times the prompts); the server "
                             f"queues at most {limit}", param="n",
                             hint="send fewer prompts or a smaller n per request, or raise --max-queue")

    def completion_prompts(self, prompt: str | list[int] | list[str] | list[list[int]]
                           ) -> tuple[list[list[int]], list[str]]:
        """The token ids of each prompt of a completion request, and each prompt's text."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]  # type: ignore[list-item]
        if not prompt:
            raise BadRequest("prompt is an empty list", hint="send a string, token ids, or a list of either",
                             param="prompt")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        texts = [p if isinstance(p, str) else self._decoded(p) for p in prompt]
        return ids, texts

    def _decoded(self, ids: list[int]) -> str:
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in ids):  # the engine refuses these; no text to echo
            return ""
        return self.tokenizer.decode(ids)

    def completion_reply(self, base: dict[str, Any], req: CompletionRequest, jobs, echoes: list[str],
                         gens: list[Generation], prompts: list[list[int]]) -> dict[str, Any]:
        choices = []
        for (k, prompt, params), echo, gen in zip(jobs, echoes, gens):
            logprobs = (None if req.logprobs is None
                        else replies.completion_logprobs(self.tokenizer, gen, prompt, req.echo))
            choices.append({"index": k, "text": echo + visible_text(gen.text, params.stop, True),
                            "logprobs": logprobs, "finish_reason": gen.finish_reason,
                            "atelier": replies.extension(gen, prompt)})
        return {**base, "choices": choices, "usage": replies.usage(prompts, gens)}

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        if not req.messages:
            raise BadRequest("messages is empty", hint="send at least one message", param="messages")
        for i, m in enumerate(req.messages):
            if not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] has no role", param=f"messages.{i}.role",
                                 hint="each message needs a role: system, user, assistant or tool")
        messages = [{**m, "content": _text_of(m.get("content"), i)} for i, m in enumerate(req.messages)]
        kwargs = {"tools": req.tools} if req.tools else {}
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False, **kwargs)
        except Exception as exc:  # jinja errors: the messages do not fit the model's template
            raise BadRequest(f"the chat template cannot render these messages: {exc}", param="messages",
                             hint="check the roles and their order against the model's chat template") from exc
        return [int(t) for t in ids]


def _text_of(content: Any, i: int) -> str:
    """OpenAI message content: a string, None, or a list of text parts (this server reads text only)."""
    if content is None:
        return ""
    if isinstance(content, list):
        for part in content:
            text = isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str)
            if not text:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"messages[{i}] has a content part of type {kind!r}; this server reads text only",
                                 hint='send content as a string or as {"type": "text", "text": ...} parts',
                                 param=f"messages.{i}.content")
        return "".join(p["text"] for p in content)
    return str(content)


async def _until_disconnect(request: Request) -> None:
    """Return when the client goes away (its body is already read, so the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(engine, jobs: list[tuple[list[int], SamplingParams]], request: Request) -> list[Generation]:
    """Submit every job to the engine and wait, without a thread, for all of them; cancel them if
    the client leaves (or one is refused)."""
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()
    left = [len(jobs)]

    def one_done(_: int) -> None:
        left[0] -= 1
        if not left[0]:
            finished.set()

    handles = submit_all(engine, jobs, None, lambda k: loop.call_soon_threadsafe(one_done, k))
    waiter = asyncio.ensure_future(finished.wait())
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not finished.is_set():
            raise _ClientGone()
        return [handle.result() for handle in handles]
    finally:
        waiter.cancel()
        watcher.cancel()
        for handle in handles:
            if not handle.done:
                handle.cancel()
