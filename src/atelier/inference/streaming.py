"""Server-sent events for `stream: true`: one chunk per sampled token of every choice.

Ordering: the engine's scheduler thread pushes `(choice, token, logprob,
version)` into an asyncio queue in sampling order, then `(choice,)` when that
choice ends; `events` turns them into chunks in that order, so the chunks of
several choices (`n` > 1, a list of prompts) interleave as the engine samples
them, each naming its `index`. Text is the difference between decodings of a
choice's tokens so far (a token that ends inside a multi-byte character holds
its text back until the character completes); token ids are never held back.
After every choice's finish chunk comes, with `stream_options.include_usage`,
one chunk with `usage` and no choices (every earlier chunk then has `usage:
null`, as OpenAI sends them), and `[DONE]`.

Every choice is submitted before the response starts, so a full queue answers
503 before any byte of the stream is sent; if the stream stops early (the
client went away), the choices still running are cancelled.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from atelier.errors import AtelierError
from atelier.inference.openai_replies import usage, visible_text
from atelier.inference.types import SamplingParams


@dataclass
class Choice:
    """One streamed choice: what to sample, and what its chunks have shown so far."""

    index: int
    prompt: list[int]
    params: SamplingParams
    echo: str = ""
    ids: list[int] = field(default_factory=list)
    sent: str = ""


def submit_all(engine, jobs: list[tuple[list[int], SamplingParams]], on_token, on_done) -> list:
    """Submit every job (`on_token(k, ...)`, `on_done(k)` for job k); if one is refused (a full
    queue), cancel those already submitted and raise."""
    handles = []
    try:
        for k, (prompt, params) in enumerate(jobs):
            handles.append(engine.submit(prompt, params, on_token=None if on_token is None else (
                lambda *a, k=k: on_token(k, *a)), on_done=lambda k=k: on_done(k)))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


def stream(engine, choices: list[Choice], base: dict[str, Any], *, chat: bool, include_usage: bool,
           prompts: list[list[int]]) -> StreamingResponse:
    """The `text/event-stream` response for `choices` (see the module docstring)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    handles = submit_all(
        engine, [(c.prompt, c.params) for c in choices],
        on_token=lambda k, token, logprob, version: loop.call_soon_threadsafe(
            queue.put_nowait, (k, token, logprob, version)),
        on_done=lambda k: loop.call_soon_threadsafe(queue.put_nowait, (k,)))
    extra = {"usage": None} if include_usage else {}

    def chunk(choice: Choice, text: str | None, ext: dict[str, Any], finish: str | None,
              first: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            body = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            body = {"index": choice.index, "text": text or "", "logprobs": None, "finish_reason": finish}
        return f"data: {json.dumps({**base, 'choices': [{**body, 'atelier': ext}], **extra})}\n\n"

    def token_chunk(choice: Choice, token: int, logprob: float, version: int) -> str:
        choice.ids.append(token)
        text = choice.echo + engine.tokenizer.decode(choice.ids, skip_special_tokens=True)
        new = ""
        if not text.endswith("\ufffd"):
            shown = choice.echo + visible_text(text[len(choice.echo):], choice.params.stop, False)
            if len(shown) > len(choice.sent):
                new, choice.sent = shown[len(choice.sent):], shown
        return chunk(choice, new, {"token_ids": [token], "logprobs": [logprob], "versions": [version]}, None)

    async def events():
        running, gens = len(choices), []
        try:
            for choice in choices:
                choice.sent = choice.echo
                yield chunk(choice, choice.echo, {"token_ids": [], "logprobs": [], "versions": []}, None,
                            first=True)
            while running:
                item = await queue.get()
                choice = choices[item[0]]
                if len(item) > 1:
                    yield token_chunk(choice, *item[1:])
                    continue
                running -= 1
                try:
                    gen = handles[item[0]].result()
                except Exception as exc:  # reported in-band: the HTTP status is already sent
                    message = exc.message if isinstance(exc, AtelierError) else str(exc)
                    yield f"data: {json.dumps({'error': {'message': message, 'type': type(exc).__name__}})}\n\n"
                    return
                gens.append(gen)
                rest = (choice.echo + visible_text(gen.text, choice.params.stop, True))[len(choice.sent):]
                yield chunk(choice, rest, {"token_ids": [], "logprobs": [], "versions": [],
                                           "prompt_token_ids": choice.prompt}, gen.finish_reason)
            if include_usage:
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage(prompts, gens)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for handle in handles:
                if not handle.done:
                    handle.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")
