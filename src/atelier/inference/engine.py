"""The local engine: many blocking `generate` callers, one scheduler thread, one batch.

`LocalEngine` loads a Hugging Face model directory and implements the
`TokenModel` protocol. Rollout threads call `generate(prompt_ids, params)`
concurrently; each call enqueues a request and blocks on its own event.

The scheduler thread (continuous batching) repeats one *step*:

1. apply every queued weight update (in the order they were queued);
2. admit waiting requests into free cache slots and prefill them together,
   each from the end of its longest prefix in the prefix cache (see below);
   each admitted request samples its first token from the prefill logits;
3. decode one token for every active request in one batched forward;
4. retire requests that hit a stop token, a stop string, `max_tokens` or the
   context limit, and wake their callers.

Guarantees, which the tests check:

- Requests join between decode steps, never mid-step: a request that arrives
  while a step runs is prefilled at the start of the next one (or of the one
  after, when it waits for a shared prefix: see prefix caching below).
- A weight update lands between steps. Tokens already generated keep the
  version that produced them, in-flight requests continue on the new weights
  (their KV cache, computed by the old weights, is kept: the PipelineRL
  choice), and every token records `engine.version` *at the step that
  sampled it*. So one `Generation` can hold two versions: e.g. tokens 0..4 at
  version 0, an update to 1 arrives, tokens 5.. carry version 1.
- `update_weights` returns once the new weights are live: a `generate`
  submitted after it returns samples only from the new version.
- A request's tokens depend only on its prompt, params and seed (and the
  weights), not on what else shares the batch, up to float rounding across
  batch shapes.

Prefix caching (`atelier.inference.prefix_cache`; `prefix_cache_tokens=0`
turns it off): after a prefill the prompt's keys and values are copied into
the cache in blocks, and again when a request finishes (prompt plus
completion, so the agent's next turn, which extends them, finds them). A new
request restores its longest cached prefix into its slot and computes only
the rest. Within one admission, a request whose next uncached block another
admitted request is about to compute waits one step and then reuses it:
concurrent rollouts of a task prefill their shared system prompt once.

Prefix caching and weight updates: the cache is dropped when an update lands,
and a request that was running across an update is not cached when it
finishes (its keys mix two versions). So a cached prefix was always computed
by the weights that will use it, and outputs with and without the cache are
the same up to float rounding across batch shapes (tested greedy-exact).

Logprob semantics are those of `atelier.inference.sampling`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from atelier.errors import AtelierError
from atelier.inference.forward import BatchedForward
from atelier.inference.models import DEFAULT_PREFIX_CACHE_TOKENS
from atelier.inference.prefix_cache import PrefixCache
from atelier.inference.sampling import make_generator, sample_rows
from atelier.inference.types import Generation, SamplingParams

TokenCallback = Callable[[int, float, int], None]


class EngineError(AtelierError):
    """A request the engine cannot serve (bad prompt, bad weights, closed engine)."""


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    on_token: TokenCallback | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    length: int = 0              # positions already in the KV cache
    epoch: int = -1              # the engine's weight epoch when this request was prefilled
    finish_reason: str | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _WeightUpdate:
    tensors: dict[str, torch.Tensor]
    version: int
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _pick_dtype(device: torch.device, dtype: str | torch.dtype | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise EngineError(f"unknown dtype {dtype!r}", hint=f"use one of {', '.join(table)} or 'auto'")
    return table[dtype]


class LocalEngine:
    """A `TokenModel` over a local Hugging Face model directory, with continuous batching.

    `LocalEngine(path, device="cpu", dtype=None, max_batch=32, max_seq_len=None,
    prefix_cache_tokens=16384)`.
    `dtype=None` means fp32 on the CPU and bf16 on a GPU that supports it.
    `prefix_cache_tokens` bounds the prefix cache (0: off); a token costs
    `2 * layers * kv_heads * head_dim` numbers of `dtype` (45 KB for SmolLM2-135M
    in fp32, so the default holds ~0.75 GB there).
    Use as a context manager or call `close()`.
    """

    def __init__(self, model_path: str | Path, *, device: str = "cpu", dtype: str | torch.dtype | None = None,
                 max_batch: int = 32, max_seq_len: int | None = None, name: str | None = None,
                 version: int = 0, prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model_path)
        self.path = path
        self.device = torch.device(device)
        self.dtype = _pick_dtype(self.device, dtype)
        self.name = name or path.name
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.max_batch = max_batch
        limit = getattr(self.model.config, "max_position_embeddings", None) or 2048
        self.max_seq_len = min(limit, max_seq_len) if max_seq_len else limit
        self._forward = BatchedForward(self.model, max_batch)
        if prefix_cache_tokens < 0:
            raise EngineError("prefix_cache_tokens must be >= 0", hint="0 turns the prefix cache off")
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self._epoch = 0  # bumped by every weight update: KV from an older epoch is never cached
        self._clear_prefix = False
        self._targets = self.model.state_dict()
        eos = self.tokenizer.eos_token_id
        self._default_stop = frozenset([eos] if eos is not None else [])
        self._version = version
        self._cond = threading.Condition()
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []     # request i occupies cache slot i
        self._updates: list[_WeightUpdate] = []
        self._closed = False
        # Counters for tests and benchmarks: decode steps run, the largest batch decoded,
        # prompt tokens computed by prefills and prompt tokens restored from the prefix cache.
        self.stats = {"steps": 0, "max_batch_seen": 0, "prefills": 0, "prefill_tokens": 0,
                      "prefix_hit_tokens": 0}
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------
    @property
    def version(self) -> int:
        """The policy version of the weights the next decode step will use."""
        return self._version

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 on_token: TokenCallback | None = None) -> Generation:
        """Sample one continuation of `prompt_ids`; blocks until it finishes. Thread-safe.

        `on_token(token_id, logprob, version)` is called from the scheduler
        thread as each token is sampled (for streaming); keep it cheap.
        """
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise EngineError("empty prompt", hint="pass at least one token id")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise EngineError(f"prompt has token ids outside the vocabulary [0, {vocab})",
                              hint="tokenize with this model's tokenizer")
        if len(prompt) >= self.max_seq_len:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit the context of "
                              f"{self.max_seq_len}", hint="shorten the prompt")
        if params.max_tokens < 1:
            raise EngineError("max_tokens must be at least 1")
        stop_ids = frozenset(params.stop_token_ids) if params.stop_token_ids else self._default_stop
        request = _Request(prompt, params, stop_ids, make_generator(params.seed), on_token)
        with self._cond:
            if self._closed:
                raise EngineError("the engine is closed")
            self._waiting.append(request)
            self._cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return Generation(
            token_ids=request.token_ids, logprobs=request.logprobs, versions=request.versions,
            finish_reason=request.finish_reason,  # type: ignore[arg-type]
            text=self.tokenizer.decode(request.token_ids, skip_special_tokens=True),
        )

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
                raise EngineError("the engine is closed")
            self._updates.append(update)
            self._cond.notify_all()
        update.done.wait()
        if update.error is not None:
            raise update.error

    def update_weights_from_path(self, path: str | Path, version: int) -> int:
        """Load a safetensors file, or every `*.safetensors` in a directory, then `update_weights`.

        Returns the number of tensors loaded.
        """
        from safetensors.torch import load_file

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
                    self.prefix_cache.clear()
                    self._clear_prefix = False
                free = self.max_batch - len(self._active)
                admitted, self._waiting = self._waiting[:free], self._waiting[free:]
            for update in updates:
                self._apply(update)
            try:
                if admitted:
                    self._prefill(admitted)
                if self._active:
                    self._decode()
            except Exception as exc:  # the batch edge: fail these requests, keep serving
                for request in {id(r): r for r in self._active + admitted}.values():
                    if not request.done.is_set():
                        request.error = exc
                        request.done.set()
                self._active = []
                with self._cond:  # requests put back for the next step failed too
                    self._waiting = [r for r in self._waiting if not r.done.is_set()]
        closed = EngineError("the engine was closed before this request finished")
        with self._cond:
            for request in self._waiting + self._active:
                request.error = closed
                request.done.set()
            for update in self._updates:
                update.error = closed
                update.done.set()
            self._waiting, self._active, self._updates = [], [], []

    def _apply(self, update: _WeightUpdate) -> None:
        self.prefix_cache.clear()  # even a failed update may have changed some weights
        self._epoch += 1
        try:
            with torch.no_grad():
                for key, value in update.tensors.items():
                    self._targets[key].copy_(value.to(self._targets[key].device))
            self._version = update.version
        except Exception as exc:
            update.error = exc
        update.done.set()

    def _prefill(self, admitted: list[_Request]) -> None:
        admitted, hits = self._plan(admitted)
        if not admitted:
            return
        first = len(self._active)
        self._active.extend(admitted)
        cache = self._forward.cache
        for slot, blocks in enumerate(hits, start=first):
            for j, b in enumerate(blocks):
                cache.write(slot, j * self.prefix_cache.block, b.k_LHnD, b.v_LHnD)
        starts = [len(blocks) * self.prefix_cache.block for blocks in hits]
        logits_BV = self._forward.prefill([r.prompt for r in admitted], first, starts)
        self.stats["prefills"] += 1
        self.stats["prefix_hit_tokens"] += sum(starts)
        self.stats["prefill_tokens"] += sum(len(r.prompt) for r in admitted) - sum(starts)
        for slot, request in enumerate(admitted, start=first):
            request.length = len(request.prompt)
            request.epoch = self._epoch
            self._remember(request.prompt, request.length, slot)
        self._take(list(range(first, first + len(admitted))), logits_BV)

    def _plan(self, admitted: list[_Request]) -> tuple[list[_Request], list[list]]:
        """Look up each request's cached prefix; put back (for the next step) any request whose
        first uncached block an earlier request in this admission will compute."""
        if not self.prefix_cache.enabled:
            return admitted, [[] for _ in admitted]
        run, hits, deferred, claimed = [], [], [], set()
        for request in admitted:
            keys = self.prefix_cache.keys_for(request.prompt)
            n = 0
            while n < len(keys) and keys[n] in self.prefix_cache:
                n += 1
            if n < len(keys) and keys[n] in claimed:
                deferred.append(request)
                continue
            claimed.update(keys[n:])
            run.append(request)
            hits.append(self.prefix_cache.match(keys[:n]))
        if deferred:
            with self._cond:
                self._waiting[:0] = deferred
        return run, hits

    def _remember(self, tokens: list[int], length: int, slot: int) -> None:
        """Copy the full blocks of `tokens[:length]`, whose KV is in `slot`, into the prefix cache."""
        if self.prefix_cache.enabled:
            cache = self._forward.cache
            self.prefix_cache.insert(tokens, length, lambda a, b: cache.read(slot, a, b))

    def _decode(self) -> None:
        tokens = [r.token_ids[-1] for r in self._active]
        positions = [r.length for r in self._active]
        logits_BV = self._forward.decode(tokens, positions)
        self.stats["steps"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(tokens))
        for request in self._active:
            request.length += 1
        self._take(list(range(len(self._active))), logits_BV)

    def _take(self, indices: list[int], logits_BV: torch.Tensor) -> None:
        """Sample one token for each of `self._active[indices]` (row k of logits), then retire."""
        version = self._version
        requests = [self._active[i] for i in indices]
        sampled = sample_rows(logits_BV, [(r.params.temperature, r.params.top_p, r.generator) for r in requests])
        finished = []
        for index, request, (token, logprob) in zip(indices, requests, sampled):
            request.token_ids.append(token)
            request.logprobs.append(logprob)
            request.versions.append(version)
            if request.on_token is not None:
                try:
                    request.on_token(token, logprob, version)
                except Exception:  # a broken listener (gone client) must not fail the batch
                    request.on_token = None
            reason = self._finish_reason(request, token)
            if reason:
                request.finish_reason = reason
                finished.append(index)
        for index in sorted(finished, reverse=True):
            self._retire(index)

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

    def _retire(self, index: int) -> None:
        """Wake the request's caller and keep active slots contiguous (move the last into the gap)."""
        request = self._active[index]
        if request.epoch == self._epoch:  # its whole KV came from the current weights
            self._remember(request.prompt + request.token_ids, request.length, index)
        last = len(self._active) - 1
        if index != last:
            moved = self._active[last]
            self._forward.cache.move_slot(last, index, moved.length)
            self._active[index] = moved
        self._active.pop()
        request.done.set()
