"""The local engine: many `generate` callers, one scheduler thread, one batch, a fixed KV budget.

`LocalEngine` loads a Hugging Face model directory and implements the
`TokenModel` protocol. Rollout threads call `generate(prompt_ids, params)`
concurrently (or `submit(...)`, which returns a `RequestHandle` that can be
cancelled); each request waits in a queue until the scheduler admits it.

Memory: keys and values live in one pool of `kv_cache_tokens` positions, cut
into blocks of 32 (`atelier.inference.prefix_cache.BlockPool`), allocated
once. A sequence takes blocks as it grows and gives them back when it ends, so
the engine's KV memory is the budget, whatever the batch size and context
length (a token costs `2 * layers * kv_heads * head_dim` numbers: 23 KB for
SmolLM2-135M in bf16, so the default 32,768 tokens are 0.75 GB there).

The scheduler thread (continuous batching) repeats one *step*:

1. apply every queued weight update (in the order they were queued);
2. drop cancelled requests, giving back their blocks;
3. admit waiting requests, first come first served, while there is a batch
   slot (`max_batch`), prefill budget (`max_prefill_tokens` new prompt tokens
   per step; one request is always allowed) and enough free blocks for the
   whole prompt; each starts from its longest prefix in the prefix cache and
   samples its first token from the prefill's logits. A request that does not
   fit waits, and so does every request behind it (no starvation of long
   prompts);
4. give every running request the block its next position needs; when the
   pool is empty, *preempt* the most recently admitted request: its blocks go
   back (registered in the prefix cache first, so its return is mostly a cache
   hit), it goes to the front of the queue with the tokens it has, and later
   resumes by prefilling prompt + tokens so far (vLLM's recompute preemption);
5. decode one token for every running request in one batched forward;
6. retire requests that hit a stop token, a stop string, `max_tokens` or the
   context limit, and wake their callers.

Guarantees, which the tests check:

- Requests join between decode steps, never mid-step.
- A weight update lands between steps. Tokens already generated keep the
  version that produced them, in-flight requests continue on the new weights
  (their KV, computed by the old weights, is kept: the PipelineRL choice), and
  every token records `engine.version` *at the step that sampled it*. So one
  `Generation` can hold two versions: e.g. tokens 0..4 at version 0, an update
  to 1 arrives, tokens 5.. carry version 1.
- `update_weights` returns once the new weights are live: a `generate`
  submitted after it returns samples only from the new version.
- A request's tokens depend only on its prompt, params and seed (and the
  weights), not on what else shares the batch or on preemption, up to float
  rounding across batch shapes. With `batch_invariant=True` there is no such
  rounding either: each request's prefill and decode run as forwards of
  their own (a batch of one; requests still interleave step by step) and the
  prefix cache is off, so its tokens *and logprobs* are bit for bit those it
  gets alone, whatever ran beside it and whenever it arrived. Without it, a
  shared-prompt prefix-cache hit (the second member of a group computing only
  its prompt's tail) moves logprobs by bf16 rounding, and which member of a
  group hits the cache depends on which thread reaches the queue first. That
  is what reproducible RL runs need (`rollout.batch_invariant`); it costs the
  throughput of batching. Preemption (the KV budget full)
  recomputes a request's keys in one prefill and still changes its rounding.
- A cancelled request (`RequestHandle.cancel()`, e.g. its HTTP client went
  away) leaves within one step with `finish_reason="abort"` and gives back its
  blocks.
- With `max_queue` set, `submit` refuses a request when that many already
  wait (`EngineBusy`, which the server answers with 503 and Retry-After).

Prefix caching (`prefix_cache_tokens`; 0 turns it off) shares the pool: see
`prefix_cache.py`. Full blocks of a prompt are registered after its prefill,
and those of prompt plus completion when it finishes, so an agent's next turn
finds its previous one. Within one admission, a request whose next uncached
block another admitted request is about to compute waits one step and then
reuses it: concurrent rollouts of a task prefill their shared system prompt
once. The cache is emptied when an update lands, and a request that was
running across an update is not registered when it finishes (its keys mix two
versions), so a cached prefix was always computed by the weights that use it.

Precision: `dtype=None` (or "auto") is bf16 on a GPU that supports it and on a
CPU with AMX or AVX512-BF16 units, else fp32. The forward pass runs in that
dtype; logits leave the LM head in it and are cast to fp32 for sampling.
Logprob semantics are those of `atelier.inference.sampling`.

Speed: the forward is `atelier.inference.forward` (a decode step is one pass
over the batch per layer, compiled, on weights packed for the CPU's matrix
library), and the scheduler thread loads the model and runs every step, on a
thread count chosen per step (`atelier.inference.threads`).
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from atelier.errors import AtelierError, InfraError
from atelier.inference.forward import BatchedForward
from atelier.inference.prefix_cache import BlockPool
from atelier.inference.sampling import (
    MIN_TEMPERATURE,
    make_generator,
    most_likely,
    sample_rows,
    speculative_accept,
    tempered,
)
from atelier.inference.speculative import (
    LOOKUP_DRAFTS,
    DraftHeads,
    DraftRun,
    HeadProgress,
    PromptLookup,
    SpeculationPolicy,
)
from atelier.inference.threads import StepThreads
from atelier.inference.threads import threads as running_on
from atelier.inference.types import DEFAULT_KV_CACHE_TOKENS, DEFAULT_PREFIX_CACHE_TOKENS, Generation, SamplingParams
from atelier.moe.replay import pack_routes
from atelier.mtp.store import load_mtp_heads
from atelier.train.devices import cpu_has_bf16, trim_freed_memory

TokenCallback = Callable[[int, float, int], None]
KV_BLOCK = 32  # positions per KV block (and per prefix-cache entry)


class EngineError(AtelierError):
    """A request the engine cannot serve (bad prompt, bad weights, closed engine)."""


class EngineClosed(EngineError, InfraError):
    """The engine was closed (or died) before or while serving a request: infrastructure."""


class EngineBusy(EngineError, InfraError):
    """The queue of waiting requests is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message, hint=f"retry in {retry_after} s, or raise the server's --max-queue")
        self.retry_after = retry_after


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    on_token: TokenCallback | None = None
    on_done: Callable[[], None] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # block table: position p lives in blocks[p // KV_BLOCK]
    length: int = 0              # positions whose keys and values are in `blocks`
    epoch: int = -1              # the engine's weight epoch when this request was (last) prefilled
    admitted: int = -1           # admission order, for choosing whom to preempt
    cancelled: bool = False
    routes: Any = None           # MoE: packed experts of prompt + token_ids, taken when it finishes
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None           # scored at its first prefill
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    finish_reason: str | None = None
    error: BaseException | None = None
    # speculative decoding (speculative.py): the guesses of the next tokens (the MTP heads' or a
    # prompt lookup's), the distributions they were drawn from (sampled requests; None entries:
    # looked up), the depth they were drafted for (0: none drafted since the last plain step),
    # whether they were looked up, how far each head has run, and the request's lookup index
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor | None] | None = None
    draft_depth: int = 0
    looked_up: bool = False
    heads: HeadProgress | None = None
    lookup: PromptLookup | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.token_ids

    def set_drafts(self, tokens: list[int] | None = None, probs: list[torch.Tensor | None] | None = None,
                   depth: int = 0, looked_up: bool = False) -> None:
        """The request's next drafts, drafted for `depth` (no arguments: none, nothing drafted)."""
        self.drafts, self.draft_probs, self.draft_depth, self.looked_up = tokens or [], probs, depth, looked_up


class RequestHandle:
    """One submitted request: `result()` blocks for its `Generation`, `cancel()` abandons it."""

    def __init__(self, engine: "LocalEngine", request: _Request) -> None:
        self._engine = engine
        self._request = request

    @property
    def done(self) -> bool:
        return self._request.done.is_set()

    def cancel(self) -> None:
        """Stop generating; the request finishes with `finish_reason="abort"` within one step."""
        self._engine._cancel(self._request)

    def result(self, timeout: float | None = None) -> Generation:
        """The finished generation (raises the request's error, if it failed)."""
        if not self._request.done.wait(timeout):
            raise TimeoutError("the request has not finished")
        r = self._request
        if r.error is not None:
            raise r.error
        return Generation(token_ids=r.token_ids, logprobs=r.logprobs, versions=r.versions,
                          finish_reason=r.finish_reason,  # type: ignore[arg-type]
                          text=self._engine.tokenizer.decode(r.token_ids, skip_special_tokens=True),
                          routes=r.routes, top_logprobs=r.top_logprobs if r.params.top_logprobs else None,
                          prompt_logprobs=r.prompt_logprobs, prompt_top_logprobs=r.prompt_top_logprobs)


@dataclass
class _WeightUpdate:
    tensors: dict[str, torch.Tensor]
    version: int
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def pick_dtype(device: torch.device | str, dtype: str | torch.dtype | None) -> torch.dtype:
    """`dtype` as a torch dtype; None or "auto": bf16 where the hardware has it, else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    device = torch.device(device)
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if device.type == "cpu" and cpu_has_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise EngineError(f"unknown dtype {dtype!r}", hint=f"use one of {', '.join(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


class LocalEngine:
    """A `TokenModel` over a local Hugging Face model directory, with continuous batching.

    `LocalEngine(path, device="cpu", dtype=None, max_batch=32, max_seq_len=None,
    kv_cache_tokens=32768, prefix_cache_tokens=16384, max_prefill_tokens=2048,
    max_queue=None, batch_invariant=False, threads=None, compile=None, speculate=None,
    speculate_max_batch=16, lookup=True)`.
    `dtype=None` means bf16 where the hardware has it (see the module docstring).
    `kv_cache_tokens` is the whole KV memory, in token positions; `prefix_cache_tokens`
    bounds how much of it is kept registered for reuse (0: no prefix caching).
    The context limit is the model's, capped by `max_seq_len` and by the KV budget.
    `max_queue` bounds the requests waiting for admission (None: unbounded).
    `batch_invariant=True`: every request's forwards run alone and nothing is prefix-cached,
    so its results do not depend on what shares the engine (see the module docstring).
    `threads` (None, the default: adaptive) is how many CPU threads a step uses: torch's thread
    count while the machine has cores to spare, one while something else wants them
    (`atelier.inference.threads`); an int pins it.
    `compile` (None, the default: where a compiler is found) builds the decode attention kernel
    with `torch.compile` at the first step; False runs the same arithmetic eagerly.
    `speculate` (None, the default: where the model directory has MTP heads) decodes
    speculatively (`atelier.inference.speculative`): at batch sizes up to `speculate_max_batch`,
    and only while measured faster than plain steps. Drafts come from the heads and, with `lookup`,
    from the request's own context where its last tokens occurred before (a looked-up draft is
    preferred: it costs nothing). True speculates with whatever the model has (lookup alone on a
    model without heads), False never loads the heads. Never with `batch_invariant`.
    Use as a context manager or call `close()`.
    """

    def __init__(self, model_path: str | Path, *, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 max_batch: int = 32, max_seq_len: int | None = None, name: str | None = None,
                 version: int = 0, prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
                 kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS, max_prefill_tokens: int = 2048,
                 max_queue: int | None = None, batch_invariant: bool = False,
                 threads: int | None = None, compile: bool | None = None, speculate: bool | None = None,
                 speculate_max_batch: int = 16, lookup: bool = True) -> None:
        if prefix_cache_tokens < 0:
            raise EngineError("prefix_cache_tokens must be >= 0", hint="0 turns the prefix cache off")
        if kv_cache_tokens < KV_BLOCK * 2:
            raise EngineError(f"kv_cache_tokens must be at least {KV_BLOCK * 2}",
                              hint="it is the engine's whole KV memory in token positions")
        if max_batch < 1 or max_prefill_tokens < 1 or (max_queue is not None and max_queue < 0):
            raise EngineError("max_batch and max_prefill_tokens must be >= 1, max_queue >= 0")
        if threads is not None and threads < 1:
            raise EngineError("threads must be >= 1", hint="or None: adapt to what else runs")
        if speculate and batch_invariant:
            raise EngineError("speculative decoding and batch_invariant exclude each other",
                              hint="a verification pass over drafts is a batch shape of its own: drop one")
        path = Path(model_path)
        self.path = path
        self.device = torch.device(device)
        self.dtype = pick_dtype(self.device, dtype)
        self.name = name or path.name
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queue = max_queue
        self.batch_invariant = batch_invariant
        self._epoch = 0  # bumped by every weight update: KV from an older epoch is never cached
        self._admissions = 0
        self._clear_prefix = False
        self._version = version
        self._cond = threading.Condition()
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []
        self._updates: list[_WeightUpdate] = []
        self._closed = False
        # Counters for tests and benchmarks: decode steps run, the largest batch decoded, prompt
        # tokens computed by prefills and restored from the prefix cache, preemptions, cancels,
        # the thread count of the last step.
        self.stats = {"steps": 0, "max_batch_seen": 0, "prefills": 0, "prefill_tokens": 0,
                      "prefix_hit_tokens": 0, "preemptions": 0, "cancelled": 0, "max_waiting": 0,
                      "threads": 0, "speculative_steps": 0, "drafted": 0, "accepted": 0,
                      "lookup_drafted": 0, "lookup_accepted": 0}
        # The model is loaded on the scheduler thread, which then runs every step: all of the
        # engine's multi-threaded torch work happens on one thread (see `atelier.inference.threads`).
        loaded: list[BaseException | None] = []
        ready = threading.Event()
        load = (path, kv_cache_tokens, prefix_cache_tokens, max_seq_len, compile, threads,
                (speculate, speculate_max_batch, lookup), loaded, ready)
        self._thread = threading.Thread(target=self._run, args=load, name=f"engine-{self.name}", daemon=True)
        self._thread.start()
        ready.wait()
        if loaded[0] is not None:
            self._thread.join()
            raise loaded[0]

    def _load(self, path: Path, kv_cache_tokens: int, prefix_cache_tokens: int, max_seq_len: int | None,
              compile: bool | None, threads: int | None, speculation: tuple[bool | None, int, bool]) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        speculate, speculate_max_batch, lookup = speculation
        mtp = None if speculate is False or self.batch_invariant else load_mtp_heads(path, self.model)
        if speculate and mtp is None and not lookup:
            raise EngineError(f"speculate=True with lookup off, but {path} has no MTP heads (mtp.json, "
                              "mtp.safetensors)", hint="train heads for it (atelier mtp attach), or turn lookup on")
        # lookup drafts wherever the engine speculates: with the heads, or alone where asked to
        self._lookup = lookup and not self.batch_invariant and (mtp is not None or bool(speculate))
        blocks = kv_cache_tokens // KV_BLOCK
        self.kv_cache_tokens = blocks * KV_BLOCK
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.max_seq_len = min(limit, max_seq_len or limit, self.kv_cache_tokens)
        self._forward = BatchedForward(self.model, blocks, KV_BLOCK, compile=compile,
                                       extra_kv_layers=len(mtp.heads) if mtp is not None else 0)
        self._heads = DraftHeads(mtp, self._forward) if mtp is not None else None
        self._speculation = SpeculationPolicy(len(self._heads) if self._heads is not None else 0, speculate_max_batch,
                                              lookup=self._lookup)
        self.pool = BlockPool(blocks, KV_BLOCK, 0 if self.batch_invariant else prefix_cache_tokens // KV_BLOCK)
        self._targets = self.model.state_dict()
        eos = self.tokenizer.eos_token_id
        self._default_stop = frozenset([eos] if eos is not None else [])
        # on a GPU the CPU threads only feed it: nothing to choose
        self._threads = StepThreads(threads if self.device.type == "cpu" else threads or torch.get_num_threads())
        # loading converted the checkpoint's tensors and fused the projections: hand what that freed
        # back to the OS, or it stays resident beside the weights for the engine's life
        gc.collect()
        trim_freed_memory()

    def _run(self, *load) -> None:
        *args, loaded, ready = load
        try:
            self._load(*args)
        except BaseException as exc:  # re-raised by __init__, in the caller's thread
            loaded.append(exc)
            ready.set()
            return
        loaded.append(None)
        ready.set()
        self._loop()

    # -- public API ---------------------------------------------------------------
    @property
    def version(self) -> int:
        """The policy version of the weights the next decode step will use."""
        return self._version

    @property
    def prefix_cache(self) -> BlockPool:
        """The block pool, whose registered blocks are the prefix cache (`.tokens`, `.enabled`)."""
        return self.pool

    @property
    def speculates(self) -> bool:
        """Whether the engine can speculate (speculative.py): it has MTP heads, or drafts by lookup."""
        return self._heads is not None or self._lookup

    @property
    def drafters(self) -> tuple[str, ...]:
        """Where speculative drafts come from: "heads" (the model's MTP heads), "lookup" (the
        request's own context); empty where the engine does not speculate."""
        return tuple(name for name, on in (("heads", self._heads is not None), ("lookup", self._lookup)) if on)

    @property
    def speculation(self) -> SpeculationPolicy:
        """The policy that decides per step whether to speculate, and with how many heads; its
        `mode` ("auto", "always", "never") may be set between requests."""
        return self._speculation

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV memory the engine holds: the budget, allocated once."""
        return self._forward.kv.nbytes

    @property
    def waiting(self) -> int:
        """Requests waiting for admission now."""
        return len(self._waiting)

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 on_token: TokenCallback | None = None) -> Generation:
        """Sample one continuation of `prompt_ids`; blocks until it finishes. Thread-safe.

        `on_token(token_id, logprob, version)` is called from the scheduler
        thread as each token is sampled (for streaming); keep it cheap.
        """
        return self.submit(prompt_ids, params, on_token).result()

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None,
               on_token: TokenCallback | None = None, on_done: Callable[[], None] | None = None) -> RequestHandle:
        """Queue a request and return at once. `on_done()` is called from the scheduler thread when
        it finishes, fails or is cancelled (the server uses it to wake its event loop)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self.check_request(len(prompt), params.max_tokens, scoring=params.prompt_logprobs is not None)
        if params.top_logprobs < 0 or (params.prompt_logprobs or 0) < 0:
            raise EngineError("top_logprobs and prompt_logprobs must be >= 0")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise EngineError(f"prompt has token ids outside the vocabulary [0, {vocab})",
                              hint="tokenize with this model's tokenizer")
        stop_ids = frozenset(params.stop_token_ids) if params.stop_token_ids else self._default_stop
        request = _Request(prompt, params, stop_ids, make_generator(params.seed), on_token, on_done)
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            if self.max_queue is not None and len(self._waiting) >= self.max_queue:
                raise EngineBusy(f"{len(self._waiting)} requests are already waiting (the queue limit)")
            self._waiting.append(request)
            self.stats["max_waiting"] = max(self.stats["max_waiting"], len(self._waiting))
            self._cond.notify_all()
        return RequestHandle(self, request)

    def check_request(self, prompt_tokens: int, max_tokens: int, *, strict: bool = False,
                      scoring: bool = False) -> None:
        """Raise `EngineError` for a prompt length or `max_tokens` this engine can never serve.

        `strict` (the HTTP API) also refuses a `max_tokens` larger than the whole context; without
        it such a request runs and ends with "length" at the context limit. `scoring` (the prompt's
        logprobs are asked for) allows `max_tokens` 0.
        """
        if prompt_tokens < 1:
            raise EngineError("empty prompt", hint="pass at least one token id")
        if prompt_tokens >= self.max_seq_len:
            raise EngineError(f"prompt of {prompt_tokens} tokens does not fit the context of "
                              f"{self.max_seq_len}", hint="shorten the prompt")
        if max_tokens < (0 if scoring else 1):
            raise EngineError(f"max_tokens must be at least {0 if scoring else 1}, got {max_tokens}",
                              hint="0 is allowed when the prompt's logprobs are asked for")
        if strict and max_tokens > self.max_seq_len:
            raise EngineError(f"max_tokens {max_tokens} exceeds the context of {self.max_seq_len} tokens",
                              hint="ask for fewer tokens; generation also stops at the context limit")

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Swap in new weights between decode steps; returns once they are live.

        Keys are the model's own `state_dict` names; a subset is allowed (the
        rest keep their values). Shapes must match. Checked here, in the
        caller's thread, so a bad update changes nothing.
        """
        tensors = {}
        for key, value in state_dict.items():
            if key not in self._targets:
                raise EngineError(f"weight {key!r} is not a parameter of this model",
                                  hint="pass keys from the model's state_dict()")
            value = torch.as_tensor(value)
            if tuple(value.shape) != tuple(self._targets[key].shape):
                raise EngineError(f"weight {key!r} has shape {tuple(value.shape)}, expected "
                                  f"{tuple(self._targets[key].shape)}")
            tensors[key] = value
        if threading.current_thread() is self._thread:
            raise EngineError("update_weights was called from the engine's own thread (an on_token callback)",
                              hint="call it from another thread; it waits for the scheduler")
        update = _WeightUpdate(tensors, int(version))
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._updates.append(update)
            self._cond.notify_all()
        update.done.wait()
        if update.error is not None:
            raise update.error

    def update_weights_from_path(self, path: str | Path, version: int) -> int:
        """Load a safetensors file, or every `*.safetensors` in a directory, then `update_weights`.

        Returns the number of tensors loaded.
        """
        source = Path(path)
        files = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
        if not files or not all(f.is_file() for f in files):
            raise EngineError(f"no safetensors weights at {source}",
                              hint="pass a .safetensors file or a directory that holds some")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        self.update_weights(tensors, version)
        return len(tensors)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix before the next step (benchmarks use it between runs)."""
        with self._cond:
            self._clear_prefix = True
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the scheduler; waiting and running requests fail with `EngineError`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> "LocalEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _cancel(self, request: _Request) -> None:
        with self._cond:
            request.cancelled = True
            self._cond.notify_all()

    # -- scheduler ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._active or self._updates or self._closed):
                    self._cond.wait()
                if self._closed:
                    break
                updates, self._updates = self._updates, []
                if self._clear_prefix:
                    self.pool.clear()
                    self._clear_prefix = False
            admitted: list[_Request] = []
            try:
                for update in updates:
                    self._apply(update)
                for request in [r for r in self._active if r.cancelled]:
                    self._active.remove(request)
                    self._end(request, "abort")
                with self._cond:
                    admitted = self._admit()
                decode_only = len(self._active) if self._active and not admitted else None
                n = self._threads.choose(decode_only)
                self.stats["threads"] = n
                started = time.perf_counter()
                plain = True
                with running_on(n):
                    if admitted:
                        self._prefill(admitted)
                    if self._active:
                        plain = self._decode()
                if decode_only and plain:
                    self._threads.record(n, decode_only, time.perf_counter() - started)
            except Exception as exc:  # the batch edge: fail these requests, keep serving
                for request in {id(r): r for r in self._active + admitted}.values():
                    if not request.done.is_set():
                        self._end(request, None, error=exc)
                self._active = []
        closed = EngineClosed("the engine was closed before this request finished")
        with self._cond:
            for request in self._waiting + self._active:
                self._end(request, None, error=closed)
            for update in self._updates:
                update.error = closed
                update.done.set()
            self._waiting, self._active, self._updates = [], [], []

    def _apply(self, update: _WeightUpdate) -> None:
        self.pool.clear()  # even a failed update may have changed some weights
        self._epoch += 1
        try:
            with torch.no_grad():
                for key, value in update.tensors.items():
                    self._targets[key].copy_(value.to(self._targets[key].device))
            self._forward.refresh_weights()
            if self._heads is not None:   # they draft through the model's (changed) vocabulary rows
                self._heads.refresh_weights()
            self._version = update.version
        except Exception as exc:
            update.error = exc
        update.done.set()

    def _admit(self) -> list[_Request]:
        """Take waiting requests that fit (called with the lock held); see the module docstring.

        A request whose first uncached block an earlier request of this admission will compute
        stays queued for a step, then finds that block cached.
        """
        S = KV_BLOCK
        budget, claimed, admitted, rest, blocked = self.max_prefill_tokens, set(), [], [], False
        for request in self._waiting:
            if request.cancelled:
                self._end(request, "abort")
                continue
            if blocked or len(self._active) + len(admitted) >= self.max_batch:
                rest.append(request)
                continue
            context = request.context
            keys = self.pool.keys_for(context)
            n = 0 if self._scores(request) else self.pool.cached_prefix(keys)
            if n < len(keys) and keys[n] in claimed:
                rest.append(request)
                continue
            todo = len(context) - n * S
            if admitted and todo > budget:
                rest.append(request)
                blocked = True
                continue
            hits = self.pool.match(keys[:n])
            new = self.pool.allocate(-(-len(context) // S) - n, after=hits[-1] if hits else None)
            if new is None:  # the KV budget is full: wait for blocks to come back
                self.pool.release(hits)
                rest.append(request)
                blocked = True
                continue
            claimed.update(keys[n:])
            request.blocks, request.length = hits + new, n * S
            request.admitted, self._admissions = self._admissions, self._admissions + 1
            budget -= todo
            admitted.append(request)
        self._waiting = rest
        return admitted

    def _prefill(self, admitted: list[_Request]) -> None:
        contexts = [r.context for r in admitted]
        seqs = [(c, r.length, r.blocks) for c, r in zip(contexts, admitted)]
        scored = [i for i, r in enumerate(admitted) if self._scores(r)]
        # The heads follow only where steps may speculate (at the batch this admission makes), and
        # run over the prompt only where the next step speculates; else its positions wait for them
        # (speculative.HeadProgress), the last few hundred: a prompt's heads cost a tenth of its
        # prefill, which a batch size that does not speculate would pay for nothing.
        batch = len(self._active) + len(admitted)
        follow = self._heads is not None and self._speculation.may_speculate(batch)
        drafting = follow and self._speculation.speculating(batch)
        kept = list(range(len(admitted))) if follow else scored
        if self.batch_invariant:
            runs = [self._forward.prefill_keeping([seq], [0] if i in scored else []) for i, seq in enumerate(seqs)]
            logits_BV = torch.cat([logits for logits, _ in runs])
            hidden = [h for _, kept in runs for h in kept]
        else:
            logits_BV, hidden = self._forward.prefill_keeping(seqs, kept)
        for i in scored:
            self._score_prompt(admitted[i], hidden[kept.index(i)])
        self.stats["prefills"] += 1
        self.stats["prefix_hit_tokens"] += sum(r.length for r in admitted)
        self.stats["prefill_tokens"] += sum(len(c) - r.length for c, r in zip(contexts, admitted))
        starts = [r.length for r in admitted]
        for context, request in zip(contexts, admitted):
            request.length = len(context)
            request.epoch = self._epoch
            self.pool.register(context, request.blocks, request.length)
        sampling = [b for b, r in enumerate(admitted) if r.params.max_tokens > 0]
        for request in admitted:
            if request.params.max_tokens == 0:   # scored, nothing to generate
                self._end(request, "length")
        self._active.extend(admitted[b] for b in sampling)
        if sampling:
            self._take([admitted[b] for b in sampling], logits_BV[sampling] if len(sampling) < len(admitted)
                       else logits_BV)
        if self._heads is None:
            return
        running = {id(r) for r in self._active}
        todo = [(b, r) for b, r in enumerate(admitted) if id(r) in running]
        for b, request in todo:
            request.heads = HeadProgress(len(self._heads))
            if follow:
                request.heads.extend(starts[b], hidden[b], seen_before=drafting, cap=not drafting)
        if drafting:   # every head over the prompt: its keys are there for whichever depth comes next
            self._draft([r for _, r in todo], self._speculation.depth, look_up=False)

    @staticmethod
    def _scores(request: _Request) -> bool:
        """Whether the request's next prefill scores its prompt (asked for, and not yet done)."""
        return request.params.prompt_logprobs is not None and request.prompt_logprobs is None

    def _score_prompt(self, request: _Request, hidden_NM: torch.Tensor) -> None:
        """Each prompt token's logprob given those before it, from the prefill's hidden states."""
        prompt, top = request.prompt, request.params.prompt_logprobs
        logprobs, best = self._forward.score(hidden_NM[:len(prompt) - 1], prompt[1:], request.params.temperature, top)
        request.prompt_logprobs = [None, *logprobs]
        request.prompt_top_logprobs = [None, *best] if top else None

    def _grow(self) -> None:
        """Give every running request the blocks its next positions need (its drafts' too),
        preempting the youngest requests while the pool has too few."""
        while True:
            wanted = {id(r): (r.length + len(r.drafts)) // KV_BLOCK + 1 - len(r.blocks) for r in self._active}
            short = [r for r in self._active if wanted[id(r)] > 0]
            if not short:
                return
            if self.pool.available >= sum(wanted[id(r)] for r in short):
                for request in short:  # each right after its last block when that one is free
                    for _ in range(wanted[id(request)]):
                        request.blocks += self.pool.allocate(1, after=request.blocks[-1])
                return
            if len(self._active) == 1:
                raise EngineError("the KV budget cannot hold one sequence",
                                  hint="raise kv_cache_tokens")  # unreachable: max_seq_len <= the budget
            self._preempt(max(self._active, key=lambda r: r.admitted))

    def _preempt(self, request: _Request) -> None:
        self._active.remove(request)
        self._release(request)
        request.length = 0
        request.set_drafts()
        request.heads = None
        self.stats["preemptions"] += 1
        with self._cond:
            self._waiting.insert(0, request)

    def _decode(self) -> bool:
        """One decode step over every running request, speculative where the policy says so;
        True when it was a plain one."""
        batch = len(self._active)
        depth = self._speculation.choose(batch)
        if depth:
            started = time.perf_counter()
            if self._speculate(depth):
                self._speculation.record(depth, batch, time.perf_counter() - started)
            return False
        started = time.perf_counter()
        self._plain_decode()
        self._speculation.record(0, batch, time.perf_counter() - started)
        return True

    def _plain_decode(self) -> None:
        self._grow()
        active = self._active
        for request in active:   # the heads do not run on plain steps: their drafts go stale
            request.set_drafts()
        args = ([r.token_ids[-1] for r in active], [r.length for r in active], [r.blocks for r in active])
        if self.batch_invariant:
            logits_BV = torch.cat([self._forward.decode([r.token_ids[-1]], [r.length], [r.blocks]) for r in active])
        elif self._heads is None or not self._speculation.may_speculate(len(active)):
            logits_BV = self._forward.decode(*args)
        else:   # ... and the positions wait for them (speculative.HeadProgress)
            logits_BV, hidden_BM = self._forward.decode_keeping(*args)
            for request, hidden_1M in zip(active, hidden_BM[:, None]):
                request.heads.extend(request.length, hidden_1M)
        self.stats["steps"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(active))
        for request in active:
            request.length += 1
        self._take(list(active), logits_BV)
        if self._lookup and self._speculation.may_speculate(len(active)):
            self._speculation.observe_repeats(len(active), self._repeats(active))

    def _repeats(self, requests: list[_Request]) -> int:
        """How many of `requests` have a context that a lookup would draft from now."""
        return sum(bool(self._propose(request, 1)) for request in requests)

    @staticmethod
    def _propose(request: _Request, depth: int) -> list[int]:
        """A lookup's drafts for `request` (`PromptLookup`, its table made on first use)."""
        if request.lookup is None:
            request.lookup = PromptLookup()
        return request.lookup.propose(request.context, depth)

    def _take(self, requests: list[_Request], logits_BV: torch.Tensor) -> None:
        """Sample one token for each of `requests` (row k of logits), then retire finished ones."""
        version = self._version
        tops = [r.params.top_logprobs for r in requests]
        sampled = sample_rows(logits_BV, [(r.params.temperature, r.params.top_p, r.generator) for r in requests],
                              top=tops if any(tops) else None)
        for request, (token, logprob, top) in zip(requests, sampled):
            self._append(request, token, logprob, version, top)

    def _append(self, request: _Request, token: int, logprob: float, version: int,
                top: list[tuple[int, float]] | None) -> bool:
        """Give `request` its next token; retire it (True) when that token finishes it."""
        request.token_ids.append(token)
        request.logprobs.append(logprob)
        request.versions.append(version)
        if top is not None:
            request.top_logprobs.append(top)
        if request.on_token is not None:
            try:
                request.on_token(token, logprob, version)
            except Exception:  # a broken listener (gone client) must not fail the batch
                request.on_token = None
        reason = self._finish_reason(request, token)
        if reason:
            self._active.remove(request)
            self._end(request, reason)
        return bool(reason)

    def _speculate(self, depth: int) -> bool:
        """One speculative step (speculative.py): verify every running request's last token and
        first `depth` drafts in one pass, emit what `speculative_accept` keeps, draft `depth` again.
        A request with no drafts for `depth` yet tries a lookup first (it costs nothing). Returns
        whether every request had been drafted for `depth`: a step without drafts is a plain step
        plus the heads, not what speculation at `depth` costs."""
        active = list(self._active)
        stale = [r for r in active if r.draft_depth < depth]
        if stale and self._lookup:
            for request in self._look_up(stale, depth):
                if self._heads is None:   # no repeat and nothing else to draft with: drafted all the same
                    request.set_drafts(depth=depth)
        full = True
        for request in active:   # never draft past what the request may still emit
            room = min(request.params.max_tokens - len(request.token_ids),
                       self.max_seq_len - len(request.context)) - 1
            full = full and request.draft_depth >= min(depth, max(0, room))
            request.drafts = request.drafts[:max(0, min(LOOKUP_DRAFTS if request.looked_up else depth, room))]
            if request.draft_probs is not None:
                request.draft_probs = request.draft_probs[:len(request.drafts)]
        self._grow()
        active = list(self._active)
        logits_NV, hidden_NM = self._forward.verify([(r.context + r.drafts, r.length, r.blocks) for r in active])
        logits_NV = logits_NV.cpu()
        self.stats["steps"] += 1
        self.stats["speculative_steps"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(active))
        version, at, todo = self._version, 0, []
        for request in active:
            k, p = len(request.drafts) + 1, request.params
            rows_KV = logits_NV[at:at + k]
            out = speculative_accept(rows_KV, request.drafts, request.draft_probs, p.temperature, p.top_p,
                                     request.generator)
            tops = most_likely(*tempered(rows_KV[:len(out)], [p.temperature] * len(out)), p.top_logprobs) \
                if p.top_logprobs else [None] * len(out)
            self._count_drafts(request, len(active), len(out) - 1)
            if request.heads is not None:
                request.heads.extend(request.length, hidden_NM[at:at + len(out)])
            at += k
            for (token, logprob), top in zip(out, tops):
                # the cache holds the position before each emitted token; one that finishes the
                # request leaves the accepted drafts after it out of the context and the cache's count
                request.length += 1
                if self._append(request, token, logprob, version, top):
                    break   # it finished: nothing to draft
            else:
                todo.append(request)
        self._draft(todo, depth)
        return full

    def _count_drafts(self, request: _Request, batch: int, accepted: int) -> None:
        """A verified request's drafts into the stats and the policy's acceptance."""
        drafted = len(request.drafts)
        self.stats["drafted"] += drafted
        self.stats["accepted"] += accepted
        if request.looked_up:
            self.stats["lookup_drafted"] += drafted
            self.stats["lookup_accepted"] += accepted
        self._speculation.observe(batch, drafted, accepted, looked_up=request.looked_up)

    def _draft(self, todo: list[_Request], depth: int, look_up: bool = True) -> None:
        """Draft for each of `todo`: by lookup where its context repeats itself, else `depth`
        tokens by the first `depth` heads, run over the positions its heads have yet to run over
        (`HeadProgress`). A request that looked up leaves its heads behind; they catch up on the
        next pass that runs them. `look_up` False: the heads draft for every request (a prompt's
        prefill: they must run over it, or lose all but its last `MAX_BACKLOG` positions)."""
        rest = self._look_up(todo, depth) if self._lookup and look_up else todo
        for request in rest:
            request.set_drafts(depth=depth)
        if not rest or self._heads is None:
            return
        depth = min(depth, len(self._heads))
        runs = [DraftRun(hidden, r.context, start, r.blocks, r.params.temperature, r.generator, r.heads.unseen)
                for r in rest for start, hidden in [r.heads.pending(depth)]]
        for request, run, drafted in zip(rest, runs, self._heads.draft(runs, depth)):
            request.drafts, request.draft_probs = drafted.tokens, drafted.probs
            request.heads.ran(depth, run.start + len(run.hidden_nM) - 1)

    def _look_up(self, requests: list[_Request], depth: int) -> list[_Request]:
        """Draft `LOOKUP_DRAFTS` tokens by lookup (`PromptLookup`) for each of `requests` whose
        context repeats itself, whatever `depth` the heads would draft (lookup drafts cost no
        heads); returns the others."""
        rest = []
        for request in requests:
            proposal = self._propose(request, LOOKUP_DRAFTS)
            if not proposal:
                request.looked_up = False
                rest.append(request)
                continue
            greedy = request.params.temperature < MIN_TEMPERATURE
            request.set_drafts(proposal, None if greedy else [None] * len(proposal), depth, looked_up=True)
        return rest

    def _finish_reason(self, request: _Request, token: int) -> str | None:
        if token in request.stop_ids:
            return "stop"
        if request.params.stop:
            # Stop strings may span tokens: look at the tail that could hold one.
            tail = request.token_ids[-64:]
            text = self.tokenizer.decode(tail, skip_special_tokens=False)
            last = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
            for s in request.params.stop:
                at = text.rfind(s)
                if at >= 0 and at + len(s) > len(last):
                    return "stop"
        if len(request.token_ids) >= request.params.max_tokens:
            return "length"
        if len(request.prompt) + len(request.token_ids) >= self.max_seq_len:
            return "length"
        return None

    def _release(self, request: _Request) -> None:
        """Give back a request's blocks, registering its full ones first when the current weights
        computed all of them (a finished turn is the next turn's prefix)."""
        if request.blocks and request.epoch == self._epoch:
            self.pool.register(request.context, request.blocks, request.length)
        self.pool.release(request.blocks)
        request.blocks = []

    def _routes(self, request: _Request) -> Any:
        """The experts of every position of the request's context that its KV blocks hold (MoE
        models; see forward.py), packed, one row per context token (the last one: no record)."""
        ids_nLk = self._forward.routes(request.blocks, request.length) if request.blocks else None
        if ids_nLk is None:
            return None
        pad = len(request.context) - ids_nLk.shape[0]
        ids_NLk = torch.cat([ids_nLk, ids_nLk.new_full((pad, *ids_nLk.shape[1:]), -1)])
        return pack_routes(ids_NLk, self._forward.router.num_experts)

    def _end(self, request: _Request, reason: str | None, error: BaseException | None = None) -> None:
        """Finish a request that is in no queue any more: take its routes (MoE), free its blocks,
        wake its caller."""
        if reason in ("stop", "length"):
            request.routes = self._routes(request)
        self._release(request)
        request.set_drafts()   # a held handle keeps none of it
        request.heads, request.lookup = None, None
        request.finish_reason, request.error = reason, error
        if reason == "abort":
            self.stats["cancelled"] += 1
        request.done.set()
        if request.on_done is not None:
            try:
                request.on_done()
            except Exception:  # a gone listener must not fail the batch
                pass
