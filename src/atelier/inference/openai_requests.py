"""The request bodies `atelier serve` takes, and the checks that refuse what it cannot honour.

Every field a body may hold is declared here, so the server's OpenAPI schema
lists them and a field it does not know is a 400 that names it (pydantic's
`extra="forbid"`), never dropped. A field is one of:

- implemented (`max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n`,
  `logprobs`, `echo`, `tools`, ...);
- accepted and without effect on the reply whatever its value (`user`,
  `metadata`, `prompt_cache_key`, `safety_identifier`: labels for the
  caller's own records);
- not implemented, but sent by clients at a value that asks for nothing
  (`presence_penalty: 0`, `logit_bias: {}`, `response_format: {"type":
  "text"}`, `parallel_tool_calls: true`, vLLM's `top_k: -1`, ...): declared
  with `NoOpAt(values)`, accepted at those values (or null) and refused with
  a 400 that names the field at any other.

Limits, as vLLM's server sets them: `logprobs` (completions) and
`top_logprobs` (chat) at most `MAX_LOGPROBS`; `n` at most `MAX_N` (OpenAI's
limit). A value the sampler cannot use (a NaN temperature, a 65-bit seed) is
refused here, before it could fail the requests batched with it; a
temperature below `atelier.inference.sampling.MIN_TEMPERATURE` is greedy, as
in vLLM, and a `top_p` below `MIN_TOP_P` is that (it keeps the most likely
token alone either way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from atelier.errors import AtelierError
from atelier.inference.types import SamplingParams

MAX_LOGPROBS = 20
MAX_N = 128
# The sampler compares top_p with fp32 probabilities, in which a top_p below ~1e-45 is 0 and keeps no
# token at all. Any top_p below the smallest probability a vocabulary's top token can have keeps that
# token alone, as this one does: clamping to it changes no distribution.
MIN_TOP_P = 1e-30
MESSAGE_SCHEMA = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["system", "user", "assistant", "tool"]}, "content": {"type": "string"}}}
STREAMED_LOGPROBS = "send stream: false, or read each token's logprob from the chunks' `atelier` extension"


class BadRequest(AtelierError):
    """A request the API refuses before it reaches the engine (HTTP `status`, 400 by default)."""

    def __init__(self, message: str, hint: str | None = None, *, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status, self.param, self.code = status, param, code


@dataclass(frozen=True)
class NoOpAt:
    """Field metadata: the values (besides null) at which a field this server does not implement
    asks for nothing, so it is accepted; any other value is refused, naming the field. The OpenAPI
    schema lists them as the field's only values."""

    values: tuple[Any, ...]

    def __get_pydantic_json_schema__(self, core_schema, handler) -> dict[str, Any]:
        return {"anyOf": [{"enum": list(self.values)}, {"type": "null"}] if self.values else [{"type": "null"}],
                "description": "not implemented: accepted at these values"}


def _bounded(default: Any, **bounds: Any) -> Any:
    """A field whose bounds the OpenAPI schema states (for clients and fuzzers) and the code checks,
    with messages of its own."""
    return Field(default, json_schema_extra=bounds)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def refuse_unimplemented(self, prefix: str = "") -> None:
        """A 400 naming the first `NoOpAt` field set to a value this server would have to act on
        (`prefix`: where this object sits in the body)."""
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            for meta in field.metadata:
                if isinstance(meta, NoOpAt) and value is not None and not any(
                        type(value) is type(ok) and value == ok or _same_number(value, ok) for ok in meta.values):
                    allowed = " or ".join(repr(v) for v in meta.values)
                    raise BadRequest(f"{prefix}{name}={value!r} is not supported by this server",
                                     param=prefix + name,
                                     hint=f"leave {name} out" + (f" or send {allowed}" if allowed else ""))


def _same_number(value: Any, ok: Any) -> bool:
    numbers = (int, float)
    return (isinstance(value, numbers) and isinstance(ok, numbers) and not isinstance(value, bool)
            and not isinstance(ok, bool) and value == ok)


class _Sampling(_Body):
    """What every generating endpoint samples with (`/v1/generate` too)."""

    max_tokens: Optional[int] = _bounded(None, minimum=0)
    temperature: float = _bounded(1.0, minimum=0)
    top_p: float = _bounded(1.0, exclusiveMinimum=0, maximum=1)
    seed: Optional[int] = _bounded(None, minimum=-2**63, maximum=2**64 - 1)
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None

    @property
    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None

    def params(self, default_max: int, max_tokens: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        # Checked here, not in the engine: a value the sampler cannot use (NaN) would fail every
        # request batched with this one, and a seed torch cannot take would fail as a 500.
        if not 0 <= self.temperature < math.inf:
            raise BadRequest(f"temperature must be a finite number >= 0, got {self.temperature}",
                             hint="0 is greedy; 1 samples from the model's distribution", param="temperature")
        if not 0 < self.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}", hint="1 keeps every token",
                             param="top_p")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise BadRequest(f"seed must fit in 64 bits, got {self.seed}", hint="use a seed in [-2**63, 2**64)",
                             param="seed")
        if any(not s for s in stop):
            raise BadRequest("stop strings must not be empty", hint="leave the empty string out of stop",
                             param="stop")
        chosen = self.max_tokens if max_tokens is None else max_tokens
        return SamplingParams(
            max_tokens=default_max if chosen is None else chosen,
            temperature=self.temperature, top_p=max(self.top_p, MIN_TOP_P), seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()), stop=tuple(stop),
        )


class GenerateRequest(_Sampling):
    """`/v1/generate`: token ids in (see the server's docstring)."""

    prompt_ids: list[int] = _bounded(..., minItems=1, items={"type": "integer", "minimum": 0})


class StreamOptions(_Body):
    include_usage: Optional[bool] = None
    """A last chunk with `usage` and no choices (every other chunk has `usage: null`)."""
    include_obfuscation: Optional[bool] = None
    """OpenAI pads chunks against length side channels; no effect here (nothing is padded)."""
    continuous_usage_stats: Annotated[Optional[bool], NoOpAt((False,))] = None


class _OpenAI(_Sampling):
    """The fields the two OpenAI endpoints share (implemented, labels, and no-ops at a default)."""

    model: Optional[str] = None
    n: Optional[int] = _bounded(None, minimum=1, maximum=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # Labels for the caller's records: no effect on the reply.
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    # Not implemented; accepted where they ask for nothing.
    frequency_penalty: Annotated[Optional[float], NoOpAt((0,))] = None
    presence_penalty: Annotated[Optional[float], NoOpAt((0,))] = None
    logit_bias: Annotated[Optional[dict[str, Any]], NoOpAt(({},))] = None
    # vLLM's sampling extras, at the values that turn them off.
    top_k: Annotated[Optional[int], NoOpAt((0, -1))] = None
    min_p: Annotated[Optional[float], NoOpAt((0,))] = None
    repetition_penalty: Annotated[Optional[float], NoOpAt((1,))] = None
    min_tokens: Annotated[Optional[int], NoOpAt((0,))] = None
    ignore_eos: Annotated[Optional[bool], NoOpAt((False,))] = None
    skip_special_tokens: Annotated[Optional[bool], NoOpAt((True,))] = None
    include_stop_str_in_output: Annotated[Optional[bool], NoOpAt((False,))] = None

    def check(self) -> int:
        """Refuse what this server cannot honour of the shared fields; return `n`."""
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_N:
            raise BadRequest(f"n must be between 1 and {MAX_N}, got {n}", param="n",
                             hint=f"ask for at most {MAX_N} choices per request")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream: true", param="stream_options",
                             hint="send stream: true, or leave stream_options out")
        self.refuse_unimplemented()
        if self.stream_options is not None:
            self.stream_options.refuse_unimplemented("stream_options.")
        return n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _logprob_count(value: int, name: str) -> int:
    if not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", param=name,
                         hint=f"ask for at most {MAX_LOGPROBS} most likely tokens per position")
    return value


class ChatRequest(_OpenAI):
    messages: list[dict[str, Any]] = _bounded(..., minItems=1, items=MESSAGE_SCHEMA)
    max_completion_tokens: Optional[int] = _bounded(None, minimum=0)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = _bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    # Labels for the caller's records: no effect on the reply.
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    # Not implemented; accepted where they ask for nothing.
    parallel_tool_calls: Annotated[Optional[bool], NoOpAt((True,))] = None
    response_format: Annotated[Optional[dict[str, Any]], NoOpAt(({"type": "text"},))] = None
    store: Annotated[Optional[bool], NoOpAt((False,))] = None
    service_tier: Annotated[Optional[str], NoOpAt(("auto", "default"))] = None
    modalities: Annotated[Optional[list[str]], NoOpAt((["text"],))] = None
    functions: Annotated[Optional[list[Any]], NoOpAt(([],))] = None
    function_call: Annotated[Optional[Any], NoOpAt(("none", "auto"))] = None
    reasoning_effort: Annotated[Optional[str], NoOpAt(())] = None
    verbosity: Annotated[Optional[str], NoOpAt(())] = None
    audio: Annotated[Optional[Any], NoOpAt(())] = None
    prediction: Annotated[Optional[Any], NoOpAt(())] = None
    web_search_options: Annotated[Optional[Any], NoOpAt(())] = None
    moderation: Annotated[Optional[Any], NoOpAt(())] = None
    prompt_cache_options: Annotated[Optional[Any], NoOpAt(())] = None
    prompt_cache_retention: Annotated[Optional[str], NoOpAt(())] = None
    add_generation_prompt: Annotated[Optional[bool], NoOpAt((True,))] = None
    continue_final_message: Annotated[Optional[bool], NoOpAt((False,))] = None

    def sampling(self) -> SamplingParams:
        """The engine's parameters for each choice (`choices` has checked the rest)."""
        if self.tool_choice not in (None, "auto", "none"):
            raise BadRequest(f"tool_choice={self.tool_choice!r} is not supported: this server cannot force "
                             "a tool call", hint="send tool_choice 'auto' (or leave it out) or 'none'",
                             param="tool_choice")
        top = _logprob_count(self.top_logprobs or 0, "top_logprobs")
        if top and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs",
                             hint="send logprobs: true with top_logprobs")
        if self.stream and self.logprobs:
            raise BadRequest("logprobs are not returned in streamed chat completions", param="logprobs",
                             hint=STREAMED_LOGPROBS)
        wanted = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self.params(256, wanted)
        return replace(params, top_logprobs=top if self.logprobs else 0)

    @property
    def max_tokens_given(self) -> bool:
        return self.max_tokens is not None or self.max_completion_tokens is not None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(_OpenAI):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = _bounded(None, minimum=0, maximum=MAX_LOGPROBS)
    best_of: Optional[int] = None
    suffix: Annotated[Optional[str], NoOpAt(("",))] = None

    def sampling(self) -> SamplingParams:
        """The engine's parameters for each choice: with `echo` and `logprobs`, the prompt is
        scored too; `max_tokens` 0 is allowed with `echo` (the prompt alone)."""
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise BadRequest(f"best_of={self.best_of} is not supported: this server returns every choice "
                             "it samples", hint="leave best_of out or set it equal to n", param="best_of")
        top = None if self.logprobs is None else _logprob_count(self.logprobs, "logprobs")
        if self.stream and top is not None:
            raise BadRequest("logprobs are not returned in streamed completions", param="logprobs",
                             hint=STREAMED_LOGPROBS)
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens must be at least 1, got 0", param="max_tokens",
                             hint="0 is allowed with echo: true (the prompt, scored with logprobs)")
        params = replace(self.params(16), top_logprobs=top or 0)
        if self.echo and (top is not None or params.max_tokens == 0):
            params = replace(params, prompt_logprobs=top or 0)
        return params


class WeightsRequest(_Body):
    path: str
    version: int


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None, str]:
    """One readable sentence for pydantic's errors, the parameter it is about, and a hint."""
    first = errors[0] if errors else {}
    hint = "send a JSON object as the OpenAI API describes (the fields are in GET /openapi.json)"
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"malformed JSON body: {ctx.get('error', first.get('msg', 'cannot parse'))}", None, hint
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing", "model_type"):
        return "the request body must be a JSON object", None, hint
    if first.get("type") == "extra_forbidden":
        return f"unsupported field {'.'.join(loc)!r}: this server does not implement it", ".".join(loc), \
            "leave it out; GET /openapi.json lists the fields this server takes"
    # A union none of whose members matched: every error's location is the field, then a member's name.
    locs = [[p for p in e.get("loc", ()) if p != "body"] for e in errors]
    shapes = sorted({str(at[len(loc) - 1]) for at in locs
                     if len(at) >= len(loc) and [str(p) for p in at[:len(loc) - 1]] == loc[:-1]
                     and isinstance(at[len(loc) - 1], str)})
    if len(loc) > 1 and len(shapes) > 1:
        param = ".".join(loc[:-1])
        return f"invalid {param}: it has none of the accepted shapes ({', '.join(shapes)})", param, hint
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"invalid {param or 'body'}: {first.get('msg', 'invalid value')}{more}", param, hint


def with_limits(schema: dict[str, Any], max_seq_len: int, vocab: int) -> dict[str, Any]:
    """An OpenAPI `schema` of these bodies with a served engine's limits: `max_tokens` at most the
    context, token ids within the vocabulary (what a client, or a fuzzer, may send)."""
    token = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    for model in schema.get("components", {}).get("schemas", {}).values():
        props = model.get("properties", {})
        for name in ("max_tokens", "max_completion_tokens"):
            if name in props:
                props[name]["maximum"] = max_seq_len
        for name in ("prompt", "prompt_ids", "stop_token_ids"):
            if name in props:
                props[name] = _with_token_ids(props[name], token)
    return schema


def _with_token_ids(schema: Any, token: dict[str, Any]) -> Any:
    """`schema` with every integer in it (token ids, at any depth of lists) replaced by `token`."""
    if isinstance(schema, dict):
        return token if schema.get("type") == "integer" else {k: _with_token_ids(v, token) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_with_token_ids(v, token) for v in schema]
    return schema
