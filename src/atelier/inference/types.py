"""What every generation backend speaks: token ids in; token ids, logprobs
and policy versions out.

This module imports nothing heavy, so the harness (which must not import
torch) can type against it. Backends: the local engine
(`atelier.inference.engine`), the `/v1/generate` HTTP client
(`atelier.inference.client`) and the scripted model used by tests and demos.

Versions are stamped per token, at the decode step that produced the token:
a weight update that lands mid-generation shows up as a change of version
inside one `Generation` (stamping at completion would mislabel tokens).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Protocol, TypeVar, runtime_checkable

DEFAULT_PREFIX_CACHE_TOKENS = 16384
"""The local engine's prefix-cache budget in tokens (see `atelier.inference.prefix_cache`); kept here,
in a module that imports nothing, so CLI options and configs can default to it."""
DEFAULT_KV_CACHE_TOKENS = 32768
"""The local engine's whole KV memory in token positions (see `atelier.inference.engine`): 0.75 GB for
SmolLM2-135M in bf16, 1.5 GB in fp32."""

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one continuation."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    # Generation ends after any of these token ids (the id is kept in the output).
    stop_token_ids: tuple[int, ...] = ()
    # Generation ends once the decoded text contains any of these strings; the
    # tokens up to and including the one that completed the string are kept.
    stop: tuple[str, ...] = ()
    # Also return the this many most likely tokens, with their logprobs, at every sampled position.
    top_logprobs: int = 0
    # Score the prompt: every prompt token's logprob given the tokens before it (None for the
    # first), with this many most likely tokens at each position; None: no scoring. A scored
    # prompt is computed whole (its prefix is not taken from a cache). With scoring, max_tokens
    # may be 0: the prompt is scored and nothing is generated.
    prompt_logprobs: int | None = None


@dataclass
class Generation:
    """One sampled continuation, token-exact."""

    token_ids: list[int]
    logprobs: list[float]          # log mu(token) under the sampling policy, one per token
    versions: list[int]            # policy version that produced each token
    finish_reason: FinishReason
    text: str = ""                 # decoded token_ids, for convenience only
    extra: dict[str, Any] = field(default_factory=dict)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With `SamplingParams.top_logprobs`: per sampled token, the most likely (id, logprob) pairs."""
    prompt_logprobs: list[float | None] | None = None
    """With `SamplingParams.prompt_logprobs`: per prompt token, its logprob (None for the first)."""
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """With `SamplingParams.prompt_logprobs` > 0: per prompt token, the most likely (id, logprob)
    pairs at its position (None for the first)."""
    routes: Any = None
    """MoE router replay: the experts the sampler's routers chose for every position of prompt +
    token_ids, a numpy uint8/uint16 array [len(prompt) + len(token_ids), MoE layers, k]
    (atelier.moe.replay.pack_routes), the type's largest value for a position the engine never fed
    (the last sampled token). None when the backend does not record them (dense models, vLLM)."""

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"Generation lengths differ: {len(self.token_ids)} ids, "
                f"{len(self.logprobs)} logprobs, {len(self.versions)} versions"
            )


@runtime_checkable
class TokenModel(Protocol):
    """A policy the harness can drive token-exactly.

    `generate` is blocking and thread-safe: many rollouts call it at once and
    the backend batches them. `tokenizer` is a Hugging Face tokenizer (it has
    `encode`, `decode`, `apply_chat_template`, `eos_token_id`).
    """

    name: str
    tokenizer: Any

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...


@dataclass
class ChatReply:
    """One assistant message from a chat-only backend (any OpenAI-compatible endpoint)."""

    text: str
    # Native OpenAI tool calls, normalised to {"name": str, "arguments": dict | str}.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0


@runtime_checkable
class ChatModel(Protocol):
    """A policy reached only through chat messages: no token ids, no logprobs.

    Good for evaluation and deployment against hosted models; RL needs a
    `TokenModel`.
    """

    name: str

    def chat(
        self, messages: list[dict[str, Any]], params: SamplingParams, tools: list[dict[str, Any]] | None = None
    ) -> ChatReply: ...


@runtime_checkable
class KnowsContextLength(Protocol):
    """A model that knows how many tokens its context holds (the local engine, the
    `/v1/generate` client); None when the server did not say."""

    max_seq_len: int | None


@runtime_checkable
class Closeable(Protocol):
    """A model that holds resources (an engine's scheduler thread and weights,
    an HTTP session). Scripted models hold none and do not implement it."""

    def close(self) -> None: ...


M = TypeVar("M")


@contextmanager
def owning(model: M) -> Iterator[M]:
    """Use `model` for a block and close it after, if it is `Closeable`: the one
    place a caller that opened a model releases it."""
    try:
        yield model
    finally:
        if isinstance(model, Closeable):
            model.close()
