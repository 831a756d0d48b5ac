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
  "versions", "finish_reason", "text"}`.
- `POST /v1/weights`: `{"path": "<file.safetensors or directory>", "version":
  N}` loads the tensors (model `state_dict` names; a subset is fine) between
  decode steps and answers `{"version": N, "tensors": count}` once they are
  live. In-flight requests continue on the new weights; the versions in
  their replies show where the change happened.

Errors a client causes (bad prompt, bad weights) answer 400 with
`{"error": {"message", "hint", "type"}}`. Request handlers run in worker
threads and block in `engine.generate`, so concurrent requests are batched
by the engine's scheduler.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from atelier.errors import AtelierError
from atelier.inference.types import Generation, SamplingParams


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

    def params(self, default_max: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max,
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
    # Long on purpose: FastAPI routes are closures over the engine and the settings, each a few lines;
    # this function is the list of them.
    app = FastAPI(title="atelier inference")
    tokenizer = engine.tokenizer

    @app.exception_handler(AtelierError)
    async def _user_error(request: Request, exc: AtelierError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": {
            "message": exc.message, "hint": exc.hint, "type": type(exc).__name__}})

    def usage(prompt: list[int], gen: Generation) -> dict[str, int]:
        return {"prompt_tokens": len(prompt), "completion_tokens": len(gen.token_ids),
                "total_tokens": len(prompt) + len(gen.token_ids)}

    def chat_prompt(req: ChatRequest) -> list[int]:
        messages = [{**m, "content": _text_of(m.get("content"))} for m in req.messages]
        kwargs = {"tools": req.tools} if req.tools else {}
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False, **kwargs)
        return [int(t) for t in ids]

    def token_logprobs(gen: Generation) -> list[dict[str, Any]]:
        out = []
        for tok, lp in zip(gen.token_ids, gen.logprobs):
            piece = tokenizer.decode([tok])
            out.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []})
        return out

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "model": engine.name, "version": engine.version}

    @app.get("/v1/models")
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": engine.name, "object": "model", "created": 0, "owned_by": "atelier",
            "atelier": {"version": engine.version, "tokenizer_path": str(engine.path),
                        "max_seq_len": engine.max_seq_len},
        }]}

    @app.post("/v1/generate")
    def generate(req: GenerateRequest) -> dict[str, Any]:
        gen = engine.generate(req.prompt_ids, req.params(256))
        return {"token_ids": gen.token_ids, "logprobs": gen.logprobs, "versions": gen.versions,
                "finish_reason": gen.finish_reason, "text": gen.text}

    @app.post("/v1/weights")
    def weights(req: WeightsRequest) -> dict[str, Any]:
        count = engine.update_weights_from_path(req.path, req.version)
        return {"version": engine.version, "tensors": count}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        prompt = tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        params = req.params(16)
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": engine.name}
        if req.stream:
            return _stream(engine, prompt, params, base, chat=False)
        gen = await run_in_threadpool(engine.generate, prompt, params)
        logprobs = None
        if req.logprobs is not None:
            pieces = [tokenizer.decode([t]) for t in gen.token_ids]
            offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
            logprobs = {"tokens": pieces, "token_logprobs": gen.logprobs,
                        "top_logprobs": [{} for _ in pieces], "text_offset": offsets}
        choice = {"index": 0, "text": visible_text(gen.text, params.stop, True), "logprobs": logprobs,
                  "finish_reason": gen.finish_reason,
                  "atelier": _extension(gen, prompt)}
        return {**base, "choices": [choice], "usage": usage(prompt, gen)}

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        prompt = chat_prompt(req)
        params = req.params(256)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": engine.name}
        if req.stream:
            return _stream(engine, prompt, params, {**base, "object": "chat.completion.chunk"}, chat=True)
        gen = await run_in_threadpool(engine.generate, prompt, params)
        content = visible_text(gen.text, params.stop, True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = gen.finish_reason
        if req.tools:
            content, calls = split_tool_calls(content)
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                finish = "tool_calls"
        choice = {"index": 0, "message": message,
                  "logprobs": {"content": token_logprobs(gen)} if req.logprobs else None,
                  "finish_reason": finish, "atelier": _extension(gen, prompt)}
        return {**base, "choices": [choice], "usage": usage(prompt, gen)}

    return app


def _stream(engine, prompt: list[int], params: SamplingParams, base: dict[str, Any], *, chat: bool):
    """Server-sent events: one chunk per sampled token, then the finish chunk and `[DONE]`.

    Ordering: the engine's scheduler thread pushes `(token, logprob, version)`
    into an asyncio queue in sampling order; this coroutine turns them into
    chunks in that order. Text is the difference between decodings of all
    tokens so far (a token that ends inside a multi-byte character holds its
    text back until the character completes); token ids are never held back.
    """
    # Long on purpose: one SSE generator over the queue from the engine's thread and the text decoded so
    # far; `on_token`, `run` and `chunk` are closures over that state, each a few lines.
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    tokenizer = engine.tokenizer

    def on_token(token: int, logprob: float, version: int) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, ("token", token, logprob, version))

    def run() -> None:
        try:
            gen = engine.generate(prompt, params, on_token=on_token)
            loop.call_soon_threadsafe(queue.put_nowait, ("done", gen))
        except Exception as exc:  # reported in-band: the HTTP status is already sent
            loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))

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

    async def events():
        task = loop.run_in_executor(None, run)
        ids: list[int] = []
        sent = ""
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
            elif item[0] == "done":
                gen = item[1]
                rest = visible_text(gen.text, params.stop, True)[len(sent):]
                yield chunk(rest, {"token_ids": [], "logprobs": [], "versions": [],
                                   "prompt_token_ids": prompt}, gen.finish_reason)
                break
            else:
                exc = item[1]
                message = exc.message if isinstance(exc, AtelierError) else str(exc)
                yield f"data: {json.dumps({'error': {'message': message, 'type': type(exc).__name__}})}\n\n"
                break
        await task
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
