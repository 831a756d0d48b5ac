"""An OpenAI-compatible HTTP server over a `LocalEngine`, plus token-level endpoints.

`create_app(engine) -> FastAPI`; `atelier serve --model M --port P` runs it.

Endpoints:

- `GET /health` -> `{"status": "ok", "model", "version"}`.
- `GET /v1/models` -> the OpenAI list; the one entry carries an `atelier`
  object: `version`, `tokenizer_path` (the model directory, from which a
  client on the same filesystem loads the tokenizer) and `max_seq_len`.
- `POST /v1/chat/completions` (OpenAI; `stream: true` gives server-sent
  events). Every choice, and every streamed chunk, carries an `atelier`
  extension: `token_ids`, `logprobs`, `versions` of the tokens it covers (the
  final choice also has `prompt_token_ids`), so a client that streams still
  gets every token id exactly once. `logprobs: true` also fills the standard
  `logprobs.content` list. When the request declares `tools`, well-formed
  `<tool_call>` blocks in a non-streamed reply come back as native
  `tool_calls` (finish_reason "tool_calls"); streamed replies carry the text
  as generated.
- `POST /v1/completions` (OpenAI): `prompt` is a string or a list of token
  ids; `logprobs: N` fills the standard legacy `logprobs` object.
- `POST /v1/generate`: `{"prompt_ids": [...], "max_tokens", "temperature",
  "top_p", "seed", "stop_token_ids", "stop"}` -> `{"token_ids", "logprobs",
  "versions", "finish_reason", "text"}`, plus `"routes"` on an MoE model: the
  experts chosen for every position of prompt + tokens, `{"dtype", "shape",
  "b64"}` (atelier.inference.routes; router replay).
- `POST /v1/weights`: `{"path": "<file.safetensors or directory>", "version":
  N}` loads the tensors (model `state_dict` names; a subset is fine) between
  decode steps and answers `{"version": N, "tensors": count}` once they are
  live. In-flight requests continue on the new weights; the versions in
  their replies show where the change happened.

Errors a client causes answer a 4xx with OpenAI's error shape plus a hint,
`{"error": {"message", "type", "param", "code", "hint"}}`:

- 400: a body that is not JSON or not an object, a field of the wrong type, an
  empty `messages` list, `max_tokens` below 1 or above the model's context, a
  prompt that does not fit the context, a `temperature` below 0 or not finite,
  `top_p` outside (0, 1], a `seed` wider than 64 bits, an empty stop string,
  `n != 1`, a chat template that cannot render the messages, bad weights;
- 404: a `model` that is not the one served (its name, its directory, or the
  directory's base name; leaving `model` out is fine);
- 503 with `Retry-After`: more than `max_queue` requests already wait for the
  engine (the `openai` client retries these by itself).

Concurrency and cancellation: handlers are coroutines. A request goes to the
engine with `engine.submit` and the handler awaits its completion, so any
number of clients wait without a thread each, and the engine batches them.
While it waits, the handler also listens for the client going away: a
non-streaming client that disconnects, or a streaming one whose connection
drops (Starlette cancels the stream), cancels its request, which leaves the
engine within one step and gives back its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from atelier.errors import AtelierError
from atelier.inference.engine import EngineBusy
from atelier.inference.routes import encode_routes
from atelier.inference.types import Generation, SamplingParams


class BadRequest(AtelierError):
    """A request the API refuses before it reaches the engine (HTTP `status`, 400 by default)."""

    def __init__(self, message: str, hint: str | None = None, *, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status, self.param, self.code = status, param, code


def _error(status: int, message: str, hint: str | None = None, *, type_: str = "invalid_request_error",
           param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={"error": {
        "message": message, "type": type_, "param": param, "code": code, "hint": hint}})


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence for pydantic's errors, and the parameter it is about."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"malformed JSON body: {ctx.get('error', first.get('msg', 'cannot parse'))}", None
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return "the request body must be a JSON object", None
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"invalid {param or 'body'}: {first.get('msg', 'invalid value')}{more}", param


class _ClientGone(Exception):
    """The HTTP client disconnected before its request finished."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we ignore (n=1, user, ...)

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    stream: bool = False
    n: Optional[int] = None

    def params(self, default_max: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        # Checked here, not in the engine: a value the sampler cannot use (NaN) would fail every
        # request batched with this one, and a seed torch cannot take would fail as a 500.
        if not 0 <= self.temperature < math.inf:
            raise BadRequest(f"temperature must be a finite number >= 0, got {self.temperature}",
                             param="temperature")
        if not 0 < self.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise BadRequest(f"seed must fit in 64 bits, got {self.seed}", param="seed")
        if any(not s for s in stop):
            raise BadRequest("stop strings must not be empty", param="stop")
        if self.n not in (None, 1):
            raise BadRequest(f"n={self.n} is not supported: this server returns one choice per request",
                             hint="send n separate requests (they are batched together)", param="n")
        chosen = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return SamplingParams(
            max_tokens=default_max if chosen is None else chosen,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()), stop=tuple(stop),
        )


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]] = None
    logprobs: bool = False


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int]]
    logprobs: Optional[int] = None


class GenerateRequest(_Sampling):
    prompt_ids: list[int]


class WeightsRequest(BaseModel):
    path: str
    version: int


def _text_of(content: Any) -> str:
    """OpenAI message content: a string, None, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def visible_text(text: str, stop: tuple[str, ...], final: bool) -> str:
    """What an OpenAI client sees: `text` cut before the first stop string.

    Mid-stream (`final=False`) a tail that could still grow into a stop string
    is held back too, so streamed text never shows part of a stop string. The
    token ids (in the `atelier` extension) always include the stop tokens.
    """
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut]
    if not final:
        for s in stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    text = text[:-n]
                    break
    return text


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Hermes-style `<tool_call>{"name", "arguments"}</tool_call>` blocks -> OpenAI `tool_calls`.

    Used when a chat request declares `tools` (as vLLM's hermes parser does).
    Well-formed blocks leave the text and become calls (arguments as a JSON
    string); a malformed block stays in the text, so the caller's own parser
    sees it and can count it as a broken call.
    """
    calls: list[dict[str, Any]] = []

    def take(match: re.Match) -> str:
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return match.group(0)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return match.group(0)
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
        return ""

    rest = _TOOL_CALL.sub(take, text)
    return (rest.strip() if calls else rest), calls


def _extension(gen: Generation, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    ext = {"token_ids": gen.token_ids, "logprobs": gen.logprobs, "versions": gen.versions}
    if prompt_ids is not None:
        ext["prompt_token_ids"] = prompt_ids
    return ext


def create_app(engine) -> FastAPI:
    """The FastAPI app serving `engine` (a `LocalEngine`); see the module docstring."""
    app = FastAPI(title="atelier inference")
    served = _Served(engine)
    _add_error_handlers(app)
    _add_atelier_routes(app, served)
    _add_openai_routes(app, served)
    return app


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
        return _error(400, exc.message, exc.hint, type_=type(exc).__name__)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return _error(400, message, "send a JSON object as the OpenAI API describes", param=param)


def _add_atelier_routes(app: FastAPI, served: _Served) -> None:
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
        params = req.params(256)
        served.checked(req.prompt_ids, params)
        try:
            gen = await _complete(engine, req.prompt_ids, params, request)
        except _ClientGone:
            return Response(status_code=499)
        out = {"token_ids": gen.token_ids, "logprobs": gen.logprobs, "versions": gen.versions,
               "finish_reason": gen.finish_reason, "text": gen.text}
        if gen.routes is not None:
            out["routes"] = encode_routes(gen.routes)
        return out

    @app.post("/v1/weights")
    def weights(req: WeightsRequest) -> dict[str, Any]:
        count = engine.update_weights_from_path(req.path, req.version)
        return {"version": engine.version, "tensors": count}


def _add_openai_routes(app: FastAPI, served: _Served) -> None:
    """/v1/completions and /v1/chat/completions (streaming or not)."""
    engine = served.engine

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        served.check_model(req.model)
        params = req.params(16)
        if isinstance(req.prompt, str):
            prompt = await run_in_threadpool(served.tokenizer.encode, req.prompt)
        else:
            prompt = list(req.prompt)
        served.checked(prompt, params)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": engine.name}
        if req.stream:
            return _stream(engine, prompt, params, base, chat=False)
        try:
            gen = await _complete(engine, prompt, params, request)
        except _ClientGone:
            return Response(status_code=499)
        logprobs = None
        if req.logprobs is not None:
            pieces = [served.tokenizer.decode([t]) for t in gen.token_ids]
            offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
            logprobs = {"tokens": pieces, "token_logprobs": gen.logprobs,
                        "top_logprobs": [{} for _ in pieces], "text_offset": offsets}
        choice = {"index": 0, "text": visible_text(gen.text, params.stop, True), "logprobs": logprobs,
                  "finish_reason": gen.finish_reason,
                  "atelier": _extension(gen, prompt)}
        return {**base, "choices": [choice], "usage": served.usage(prompt, gen)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        served.check_model(req.model)
        params = req.params(256)
        prompt = await run_in_threadpool(served.chat_prompt, req)
        served.checked(prompt, params)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": engine.name}
        if req.stream:
            return _stream(engine, prompt, params, {**base, "object": "chat.completion.chunk"}, chat=True)
        try:
            gen = await _complete(engine, prompt, params, request)
        except _ClientGone:
            return Response(status_code=499)
        content = visible_text(gen.text, params.stop, True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = gen.finish_reason
        if req.tools:
            content, calls = split_tool_calls(content)
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                finish = "tool_calls"
        choice = {"index": 0, "message": message,
                  "logprobs": {"content": served.token_logprobs(gen)} if req.logprobs else None,
                  "finish_reason": finish, "atelier": _extension(gen, prompt)}
        return {**base, "choices": [choice], "usage": served.usage(prompt, gen)}


class _Served:
    """What the routes of `create_app` share: the engine, its tokenizer, the names it answers to,
    and the checks and shapes every endpoint uses."""

    def __init__(self, engine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.names = {engine.name, str(engine.path), engine.path.name}

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise BadRequest(f"model {model!r} is not served here; this server serves {self.engine.name!r}",
                             hint="pass that name, or leave `model` out",
                             status=404, param="model", code="model_not_found")

    def checked(self, prompt: list[int], params: SamplingParams) -> None:
        try:
            self.engine.check_request(len(prompt), params.max_tokens, strict=True)
        except AtelierError as exc:
            raise BadRequest(exc.message, exc.hint, param="max_tokens" if "max_tokens" in exc.message else None)

    @staticmethod
    def usage(prompt: list[int], gen: Generation) -> dict[str, int]:
        return {"prompt_tokens": len(prompt), "completion_tokens": len(gen.token_ids),
                "total_tokens": len(prompt) + len(gen.token_ids)}

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        if not req.messages:
            raise BadRequest("messages is empty", hint="send at least one message", param="messages")
        for i, m in enumerate(req.messages):
            if not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] has no role", param=f"messages.{i}.role",
                                 hint="each message needs a role: system, user, assistant or tool")
        messages = [{**m, "content": _text_of(m.get("content"))} for m in req.messages]
        kwargs = {"tools": req.tools} if req.tools else {}
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False, **kwargs)
        except Exception as exc:  # jinja errors: the messages do not fit the model's template
            raise BadRequest(f"the chat template cannot render these messages: {exc}", param="messages") from exc
        return [int(t) for t in ids]

    def token_logprobs(self, gen: Generation) -> list[dict[str, Any]]:
        out = []
        for tok, lp in zip(gen.token_ids, gen.logprobs):
            piece = self.tokenizer.decode([tok])
            out.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []})
        return out


async def _until_disconnect(request: Request) -> None:
    """Return when the client goes away (its body is already read, so the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(engine, prompt: list[int], params: SamplingParams, request: Request) -> Generation:
    """Submit to the engine and wait without a thread; cancel the request if the client leaves."""
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()
    handle = engine.submit(prompt, params, on_done=lambda: loop.call_soon_threadsafe(finished.set))
    waiter = asyncio.ensure_future(finished.wait())
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not finished.is_set():
            raise _ClientGone()
        return handle.result()
    finally:
        waiter.cancel()
        watcher.cancel()
        if not handle.done:
            handle.cancel()


def _stream(engine, prompt: list[int], params: SamplingParams, base: dict[str, Any], *, chat: bool):
    """Server-sent events: one chunk per sampled token, then the finish chunk and `[DONE]`.

    Ordering: the engine's scheduler thread pushes `(token, logprob, version)`
    into an asyncio queue in sampling order, then the end; this coroutine turns
    them into chunks in that order. Text is the difference between decodings of
    all tokens so far (a token that ends inside a multi-byte character holds its
    text back until the character completes); token ids are never held back.
    The request is submitted when the response starts; if the stream stops
    early (the client went away), it is cancelled.
    """
    # Long on purpose: one SSE generator over the queue from the engine's thread and the text decoded so
    # far; `on_token` and `chunk` are closures over that state, each a few lines.
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    tokenizer = engine.tokenizer

    def on_token(token: int, logprob: float, version: int) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("token", token, logprob, version))

    def chunk(text: str | None, ext: dict[str, Any], finish: str | None, first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        choice["atelier"] = ext
        return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

    # Submitted here, so a full queue answers 503 before any byte of the stream is sent.
    handle = engine.submit(prompt, params, on_token=on_token,
                           on_done=lambda: loop.call_soon_threadsafe(queue.put_nowait, ("done",)))

    async def events():
        ids: list[int] = []
        sent = ""
        try:
            yield chunk(None, {"token_ids": [], "logprobs": [], "versions": []}, None, first=True)
            while True:
                item = await queue.get()
                if item[0] == "token":
                    _, token, logprob, version = item
                    ids.append(token)
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    new = ""
                    if not text.endswith("\ufffd"):
                        shown = visible_text(text, params.stop, False)
                        if len(shown) > len(sent):
                            new, sent = shown[len(sent):], shown
                    yield chunk(new, {"token_ids": [token], "logprobs": [logprob], "versions": [version]}, None)
                    continue
                try:
                    gen = handle.result()
                except Exception as exc:  # reported in-band: the HTTP status is already sent
                    message = exc.message if isinstance(exc, AtelierError) else str(exc)
                    yield f"data: {json.dumps({'error': {'message': message, 'type': type(exc).__name__}})}\n\n"
                    break
                rest = visible_text(gen.text, params.stop, True)[len(sent):]
                yield chunk(rest, {"token_ids": [], "logprobs": [], "versions": [],
                                   "prompt_token_ids": prompt}, gen.finish_reason)
                break
            yield "data: [DONE]\n\n"
        finally:
            if not handle.done:
                handle.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")
