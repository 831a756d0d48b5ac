"""The reply bodies of `atelier serve`'s OpenAI endpoints, built from the engine's `Generation`s.

Logprobs have the shapes OpenAI's API and vLLM's server give:

- `/v1/completions` (the legacy object): `tokens` (each token's text),
  `token_logprobs`, `top_logprobs` (per position a `{token text: logprob}`
  dict of the N most likely tokens plus the token itself, so it holds N or
  N + 1 entries) and `text_offset` (where each token's text starts, counted
  from the start of the returned text). With `echo` the prompt's tokens come
  first, and the first of them has no logprob: `null` in `token_logprobs`
  and in `top_logprobs`. Two tokens that decode to the same text share a key;
  the more likely one's logprob is kept.
- `/v1/chat/completions`: `logprobs.content`, one `{token, logprob, bytes,
  top_logprobs}` per sampled token, `top_logprobs` the N most likely
  (`{token, logprob, bytes}` each, most likely first).

A logprob of minus infinity is given as -9999.0, as vLLM gives it: JSON has no
infinity.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from atelier.inference.types import Generation

NEG_INF_LOGPROB = -9999.0
Alternatives = list[tuple[int, float]]


def _finite(logprob: float) -> float:
    return NEG_INF_LOGPROB if logprob == float("-inf") else logprob


class Pieces:
    """Each token id's text alone (as OpenAI's `tokens` list shows it), decoded once per id."""

    def __init__(self, tokenizer, ids) -> None:
        unique = sorted(set(ids))
        self.text = dict(zip(unique, tokenizer.batch_decode([[t] for t in unique]))) if unique else {}

    def __call__(self, token: int) -> str:
        return self.text[token]


def _scored_ids(gen: Generation, prompt: list[int], echo: bool) -> tuple[list[int], list[float | None],
                                                                         list[Alternatives | None]]:
    """The token ids a legacy `logprobs` object covers, their logprobs and alternatives."""
    ids, logprobs = list(gen.token_ids), list[float | None](gen.logprobs)
    tops: list[Alternatives | None] = list(gen.top_logprobs or [[] for _ in ids])
    if echo:
        scored = gen.prompt_logprobs or [None] * len(prompt)
        ptops = gen.prompt_top_logprobs or [None if lp is None else [] for lp in scored]
        ids, logprobs, tops = prompt + ids, [*scored, *logprobs], [*ptops, *tops]
    return ids, logprobs, tops


def completion_logprobs(tokenizer, gen: Generation, prompt: list[int], echo: bool) -> dict[str, Any]:
    """The legacy `logprobs` object of one choice (see the module docstring)."""
    ids, logprobs, tops = _scored_ids(gen, prompt, echo)
    pieces = Pieces(tokenizer, [*ids, *(t for top in tops if top for t, _ in top)])
    tokens = [pieces(t) for t in ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top_logprobs: list[dict[str, float] | None] = []
    for token, logprob, top in zip(ids, logprobs, tops):
        if logprob is None:
            top_logprobs.append(None)
            continue
        entry: dict[str, float] = {}
        for alt, alt_logprob in [*(top or []), (token, logprob)]:
            entry.setdefault(pieces(alt), _finite(alt_logprob))
        top_logprobs.append(entry)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp) for lp in logprobs],
            "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(tokenizer, gen: Generation) -> dict[str, Any]:
    """The chat `logprobs` object of one choice: `{"content": [...]}` (see the module docstring)."""
    tops = gen.top_logprobs or [[] for _ in gen.token_ids]
    pieces = Pieces(tokenizer, [*gen.token_ids, *(t for top in tops for t, _ in top)])

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = pieces(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {"content": [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                        for token, logprob, top in zip(gen.token_ids, gen.logprobs, tops)]}


def usage(prompts: list[list[int]], gens: list[Generation]) -> dict[str, int]:
    """Token counts of a reply: every prompt once, every choice's tokens."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(g.token_ids) for g in gens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def extension(gen: Generation, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """The `atelier` object of a choice: the token ids, logprobs and versions it covers."""
    ext = {"token_ids": gen.token_ids, "logprobs": gen.logprobs, "versions": gen.versions}
    if prompt_ids is not None:
        ext["prompt_token_ids"] = prompt_ids
    return ext


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


def chat_message(text: str, tools: bool) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a chat choice, and "tool_calls" when it holds some."""
    if tools:
        content, calls = split_tool_calls(text)
        if calls:
            return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, None
