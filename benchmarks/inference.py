"""Generation throughput, prefix caching, weight-update latency and `atelier serve` memory, in one run.

Rows (one function each, `row_<name>(ctx) -> dict`; add an engine by adding a
function to `ROWS`): the built-in engine in fp32 and in bf16, a vLLM server
(the `VLLMEngine` backend rollouts use, chunks of its default size; started
from the `make vllm-env` environment, skipped with a reason when absent) in
fp32 and in bf16, and transformers' `generate` over one left-padded batch (its
best configuration when every request is known up front) in fp32 and in bf16. Every row runs the same chat
prompts, greedy, stop tokens disabled, the same number of new tokens, at each
batch size (default 1, 16, 64): tokens/s. The engine gets B concurrent
`submit`s; transformers one `generate` over all B.

Also measured, on the built-in engine:
- `agent`: A agents (default 4) run T turns (default 3) at once from the
  harness's real prompt (every tool's schema, ~1,300 tokens), each turn's
  prompt the last one plus the reply (K greedy tokens) plus a tool output,
  token in, token out; with the prefix cache in each dtype and without it in
  the default dtype, and in the default dtype with the cache but without
  shared-prompt attention (each agent's decode reading the shared prompt's
  keys on its own: `shared_attention_speedup`). The replies must be
  identical with and without the cache.
- `weight_update`: a full-model `update_weights` from in-process tensors and
  from a safetensors directory, and publish-to-first-new-token: the time from
  calling `update_weights` while 8 requests stream to the first token stamped
  with the new version.
- each vLLM row also runs the agent workload with vLLM's prefix caching
  (`agent` in the row: seconds, prompt tokens served from the cache);
- each vLLM row also measures its weight updates (`weight_update` in the row):
  full-model `update_weights` from in-process tensors and from a safetensors
  directory; publish-to-first-new-token while 8 requests stream (from calling
  `update_weights` to the first token stamped with the new version, here a
  one-token request's); and the same from a delta-chain publish on disk
  (publish, rebuild, push, first token).
- `long_decode`: decode at long context, in the default dtype: B requests
  (default 16) with distinct ~C-token prompts (default 3,000) each decode K
  greedy tokens (default 32) at once: decode tokens/s and ms per step,
  counted from the step after the last prompt's prefill (what an agent's
  later turns cost; attention over the cache dominates there, not weights),
  and `prefill_seconds`, from the first submit to the last prompt's first
  token. With `--long-shared N` the prompts begin with the same N tokens (an
  agent's system prompt) and the section runs twice, with and without
  attending to the shared prompt once for all requests
  (`shared_attention_speedup`, in ms per step); every prompt after the
  first is then a prefill over cached positions, as an agent's later turn
  is.
- `serve_memory`: peak resident memory (VmHWM) of an `atelier serve` process
  while C clients (default 16) each send one chat request with a ~3k-token
  prompt; target <= 2 GB for SmolLM2-135M.

Prints ONE JSON object. `default_dtype` is what `dtype="auto"` picks on this
machine (the recipes' engine); `ratio_default_vs_hf_best_at_16` is that
engine's tokens/s over the better of transformers' two rows at batch 16.

Usage: python benchmarks/inference.py [--model smollm2-135m|tiny|DIR] [--new-tokens 64]
       [--batches 1,16,64] [--threads 2] [--agents 4] [--turns 3] [--turn-tokens 32]
       [--serve-clients 16] [--serve-prompt-tokens 3000] [--long-batch 16] [--long-context 3000]
       [--long-tokens 32] [--long-shared 0] [--skip agent,serve,...] [--only SECTIONS] [--vllm-eager]
Sections: throughput (the rows above), agent, long (decode at long context), weights (every
engine's weight updates; a vLLM row with only this section starts its server, measures updates
and skips the throughput), serve.
`--only serve` measures `atelier serve`'s memory alone; `--only weights --rows vllm_fp32` one
vLLM row's updates. In-process rows and sections run first, the vLLM rows last (each progress
line goes to stderr).
The default model is pulled into the cache if missing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROMPTS = [
    "Write a Python function that reverses a linked list.",
    "Explain what a race condition is, with an example.",
    "How do I read a CSV file with pandas and drop empty rows?",
    "Fix this bug: for i in range(len(xs)): xs.remove(xs[i])",
    "Write a unit test for a function that parses ISO dates.",
    "What does git rebase --onto do?",
    "Refactor this into a list comprehension: out = []; for x in xs: out.append(x*2)",
    "Write a bash one-liner that counts lines in all .py files.",
    "Why is my Flask app returning 405 Method Not Allowed?",
    "Implement binary search in Python and state its complexity.",
    "What is the difference between a process and a thread?",
    "Write a SQL query that finds duplicate emails in a users table.",
    "How do I make a Python dataclass immutable?",
    "Explain the difference between == and is in Python.",
    "Write a function that merges two sorted lists.",
    "How do I profile a slow Python script?",
]


@dataclass
class Context:
    path: Path
    args: argparse.Namespace
    prompts: list[list[int]]      # enough for the largest batch
    tokenizer: object


def _model_dir(spec: str, workdir: str) -> Path:
    if spec == "tiny":
        from atelier.inference.tiny import build_tiny_model

        return build_tiny_model(f"{workdir}/tiny", initializer_range=0.2)
    from atelier.inference.models import KNOWN_MODELS, ModelNotFound, resolve_model

    try:
        return resolve_model(spec)
    except ModelNotFound:
        if spec.lower() not in KNOWN_MODELS:
            raise
        from atelier.inference.pull import pull_model

        return pull_model(spec)


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return [int(t) for t in ids]


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _throughput(run, prompts: list[list[int]], batches: list[int]) -> dict[str, dict]:
    """`run(prompts) -> tokens generated` timed at each batch size."""
    out = {}
    for b in batches:
        secs, tokens = _timed(lambda: run(prompts[:b]))
        out[str(b)] = {"seconds": round(secs, 2), "tokens": tokens, "tokens_per_s": round(tokens / secs, 1)}
    return out


# -- rows -------------------------------------------------------------------------------
def _builtin(ctx: Context, dtype: str) -> dict:
    from atelier.inference.engine import LocalEngine
    from atelier.inference.types import SamplingParams

    params = SamplingParams(max_tokens=ctx.args.new_tokens, temperature=0.0, stop_token_ids=(-1,))
    with LocalEngine(ctx.path, device=ctx.args.device, dtype=dtype, max_batch=max(ctx.args.batches)) as engine:
        def run(prompts: list[list[int]]) -> int:
            engine.clear_prefix_cache()  # no batch reuses another's prompts
            handles = [engine.submit(p, params) for p in prompts]
            return sum(len(h.result().token_ids) for h in handles)

        run(ctx.prompts[:2])  # warm-up
        return {"dtype": str(engine.dtype).removeprefix("torch."), **_throughput(run, ctx.prompts, ctx.args.batches)}


def _transformers(ctx: Context, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(ctx.path, dtype=torch_dtype).to(ctx.args.device).eval()
    tokenizer = ctx.tokenizer
    k = ctx.args.new_tokens

    def run(prompts: list[list[int]]) -> int:
        width = max(len(p) for p in prompts)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(ids.to(ctx.args.device), attention_mask=mask.to(ctx.args.device), do_sample=False,
                                 max_new_tokens=k, min_new_tokens=k, pad_token_id=pad)
        return int(out.shape[0] * (out.shape[1] - width))

    run(ctx.prompts[:1])  # warm-up
    result = {"dtype": dtype, **_throughput(run, ctx.prompts, ctx.args.batches)}
    del model
    return result


def _vllm(ctx: Context, dtype: str) -> dict:
    from atelier.inference.types import SamplingParams
    from atelier.inference.vllm_engine import VLLMEngine
    from atelier.inference.vllm_server import VLLMConfig, VLLMUnavailable, find_vllm_python

    try:
        find_vllm_python(VLLMConfig())
    except VLLMUnavailable as exc:
        return {"dtype": dtype, "skipped": exc.message}
    params = SamplingParams(max_tokens=ctx.args.new_tokens, temperature=0.0, stop_token_ids=(-1,))
    config = VLLMConfig(dtype=dtype, max_model_len=4096, enforce_eager=ctx.args.vllm_eager)
    start_s, engine = _timed(lambda: VLLMEngine(ctx.path, config))
    with engine:
        def run(prompts: list[list[int]]) -> int:
            engine.clear_prefix_cache()  # no batch reuses another's prompts
            counts: list = [0] * len(prompts)

            def one(i: int) -> None:
                try:
                    counts[i] = len(engine.generate(prompts[i], params).token_ids)
                except Exception as exc:  # re-raised below, in the benchmark's thread
                    counts[i] = exc

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for c in counts:
                if isinstance(c, Exception):
                    raise c
            return sum(counts)

        run(ctx.prompts[:2])  # warm-up
        result = {"dtype": dtype, "server_start_s": round(start_s, 1), "chunk_tokens": engine.config.chunk_tokens,
                  "enforce_eager": config.enforce_eager}
        if "throughput" not in ctx.args.skip:
            result.update(_throughput(run, ctx.prompts, ctx.args.batches))
        if ctx.args.agents > 0 and "agent" not in ctx.args.skip:
            try:
                result["agent"] = _vllm_agent(ctx, engine)
            except Exception as exc:  # reported, and the row's weight updates still run
                result["agent"] = {"error": f"{type(exc).__name__}: {exc}"}
        if "weights" not in ctx.args.skip:
            result["weight_update"] = _vllm_weight_update(ctx, engine)
        return result


def _vllm_agent(ctx: Context, engine) -> dict:
    """The agent workload (see `agent_workload`) on vLLM with its prefix caching on, as the backend runs."""
    a = ctx.args
    prompts = _agent_prompts(engine.tokenizer, a.agents)
    engine.clear_prefix_cache()
    cached, generated = engine.stats["cached_prompt_tokens"], engine.stats["generated_tokens"]
    secs, replies = _timed(lambda: _agents_run(engine, prompts, a.turns, a.turn_tokens))
    return {"seconds": round(secs, 2), "prompt_tokens": [len(p) for p in prompts],
            "generated_tokens": engine.stats["generated_tokens"] - generated,
            "prefix_hit_tokens": engine.stats["cached_prompt_tokens"] - cached,
            "replies_per_agent": [len(r) for r in replies]}


def _vllm_weight_update(ctx: Context, engine) -> dict:
    from safetensors.torch import load_file, save_file

    from atelier.inference.types import SamplingParams
    from atelier.rl.weight_sync import DeltaChainWeightSync

    state = {}
    for f in sorted(Path(ctx.path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    in_process, _ = _timed(lambda: engine.update_weights(state, version=1))
    with tempfile.TemporaryDirectory() as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, f"{tmp}/model.safetensors")
        from_path, _ = _timed(lambda: engine.update_weights_from_path(tmp, version=2))
    streaming = SamplingParams(max_tokens=256, temperature=0.0, stop_token_ids=(-1,))
    rollouts = [threading.Thread(target=engine.generate, args=(p, streaming)) for p in ctx.prompts[:8]]
    chunks = engine.stats["chunks"]
    for t in rollouts:
        t.start()
    deadline = time.monotonic() + 600
    while engine.stats["chunks"] < chunks + 8:  # every rollout is streaming
        if not any(t.is_alive() for t in rollouts) or time.monotonic() > deadline:
            raise RuntimeError("the streaming rollouts ended or stalled before the update")
        time.sleep(0.01)
    published = time.perf_counter()
    engine.update_weights(state, version=3)
    first = engine.generate(ctx.prompts[0], one)
    first_new_s = time.perf_counter() - published
    assert first.versions == [3]
    for t in rollouts:
        t.join()
    with tempfile.TemporaryDirectory() as root:
        chain = DeltaChainWeightSync(root)

        def publish_to_first_token() -> None:
            chain.publish(state, 4)
            weights, step = DeltaChainWeightSync(root).latest()
            engine.update_weights(weights, step)
            assert engine.generate(ctx.prompts[0], one).versions == [4]

        chain_s, _ = _timed(publish_to_first_token)
    return {"tensors": len(state), "in_process_s": round(in_process, 3),
            "from_safetensors_dir_s": round(from_path, 3),
            "publish_to_first_new_token_s": round(first_new_s, 3),
            "delta_chain_publish_to_first_new_token_s": round(chain_s, 3),
            "last_update": {k: round(v, 3) if isinstance(v, float) else v
                            for k, v in engine.stats["updates"][-1].items()}}


def row_builtin_fp32(ctx: Context) -> dict:
    return _builtin(ctx, "float32")


def row_builtin_bf16(ctx: Context) -> dict:
    return _builtin(ctx, "bfloat16")


def row_vllm_fp32(ctx: Context) -> dict:
    return _vllm(ctx, "float32")


def row_vllm_bf16(ctx: Context) -> dict:
    return _vllm(ctx, "bfloat16")


def row_transformers_padded_fp32(ctx: Context) -> dict:
    return _transformers(ctx, "float32")


def row_transformers_padded_bf16(ctx: Context) -> dict:
    return _transformers(ctx, "bfloat16")


ROWS = {
    "builtin_fp32": row_builtin_fp32,
    "builtin_bf16": row_builtin_bf16,
    "vllm_fp32": row_vllm_fp32,
    "vllm_bf16": row_vllm_bf16,
    "transformers_padded_fp32": row_transformers_padded_fp32,
    "transformers_padded_bf16": row_transformers_padded_bf16,
}


# -- the agent workload ------------------------------------------------------------------
AGENT_TASKS = [
    "The test test_parse_dates fails on ISO dates with a timezone offset. Fix the parser in src/dates.py.",
    "Rename the function load_cfg to load_config everywhere and keep a deprecated alias.",
    "json_dump writes a trailing comma after the last item of a list; make the output valid JSON.",
    "The CLI crashes with KeyError when --output is not given. Default it to stdout.",
    "sort_records is not stable for equal keys; make it stable and add a test.",
    "Add type hints to utils/strings.py and make mypy pass on it.",
    "The cache never expires entries; honour the ttl argument in Cache.get.",
    "Speed up count_words: it is quadratic in the number of lines.",
]
TOOL_OUTPUT = ('<|im_end|>\n<|im_start|>user\n<tool_response name="run_terminal" status="ok">\n'
               "============ 1 failed, 41 passed in 0.52s ============\nFAILED tests/test_dates.py::"
               "test_parse_dates[2024-01-01T00:00:00+02:00] - ValueError: unconverted data remains: +02:00\n"
               "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def _agent_prompts(tokenizer, n: int) -> list[list[int]]:
    from atelier.harness.prompt import build_messages
    from atelier.harness.tools import default_tools

    tools = default_tools()
    return [[int(t) for t in tokenizer.apply_chat_template(build_messages(tools, AGENT_TASKS[i % len(AGENT_TASKS)]),
                                                            add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)] for i in range(n)]


def _agents_run(engine, prompts: list[list[int]], turns: int, turn_tokens: int) -> list[list[list[int]]]:
    """Each agent's replies, turn by turn; agents run concurrently, each turn extends the last prompt."""
    from atelier.inference.types import SamplingParams

    params = SamplingParams(max_tokens=turn_tokens, temperature=0.0, stop_token_ids=(-1,))
    tool = [int(t) for t in engine.tokenizer.encode(TOOL_OUTPUT)]
    replies: list[list[list[int]]] = [[] for _ in prompts]

    def agent(i: int) -> None:
        prompt = prompts[i]
        for _ in range(turns):
            reply = engine.generate(prompt, params).token_ids
            replies[i].append(reply)
            prompt = prompt + reply + tool

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies


def agent_workload(ctx: Context, dtype: str, cache: bool, shared_attention: bool = True) -> tuple[dict, list]:
    """The agents' turns on the built-in engine; `shared_attention=False` attends over a prompt the
    agents share once per agent, as before forward.py's `shared_prefixes`."""
    from atelier.inference.engine import LocalEngine

    a = ctx.args
    kwargs = {} if cache else {"prefix_cache_tokens": 0}
    with LocalEngine(ctx.path, device=a.device, dtype=dtype, max_batch=max(a.agents, 1), **kwargs) as engine:
        engine._forward.cascade = shared_attention
        prompts = _agent_prompts(engine.tokenizer, a.agents)
        _agents_run(engine, [prompts[0][:8]], 1, 2)  # warm-up on a prompt no agent shares a block with
        engine.clear_prefix_cache()
        start = dict(engine.stats)
        secs, replies = _timed(lambda: _agents_run(engine, prompts, a.turns, a.turn_tokens))
        return {"dtype": dtype, "prefix_cache": cache, "shared_attention": shared_attention and cache,
                "seconds": round(secs, 2),
                "prompt_tokens": [len(p) for p in prompts],
                "prefill_tokens": engine.stats["prefill_tokens"] - start["prefill_tokens"],
                "prefix_hit_tokens": engine.stats["prefix_hit_tokens"] - start["prefix_hit_tokens"]}, replies


# -- weight updates ------------------------------------------------------------------------
def weight_update(ctx: Context, dtype: str) -> dict:
    from safetensors.torch import save_file

    from atelier.inference.engine import LocalEngine
    from atelier.inference.types import SamplingParams

    with LocalEngine(ctx.path, device=ctx.args.device, dtype=dtype) as engine, \
            tempfile.TemporaryDirectory() as tmp:
        state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        in_process, _ = _timed(lambda: engine.update_weights(state, version=1))
        save_file({k: v.contiguous() for k, v in state.items() if not k.startswith("lm_head")},
                  f"{tmp}/model.safetensors")
        from_path, _ = _timed(lambda: engine.update_weights_from_path(tmp, version=2))
        first_new: list[float] = []
        published = [0.0]

        def on_token(token: int, logprob: float, version: int) -> None:
            if version == 3 and not first_new:
                first_new.append(time.perf_counter())

        params = SamplingParams(max_tokens=512, temperature=0.0, stop_token_ids=(-1,))
        handles = [engine.submit(p, params, on_token=on_token) for p in ctx.prompts[:8]]
        fresh = {k: v.clone() for k, v in state.items()}
        while engine.stats["steps"] < 3:
            time.sleep(0.01)
        published[0] = time.perf_counter()
        engine.update_weights(fresh, version=3)
        deadline = time.monotonic() + 600
        while not first_new and time.monotonic() < deadline:
            time.sleep(0.005)
        for h in handles:
            h.cancel()
        return {"dtype": dtype, "tensors": len(state),
                "in_process_s": round(in_process, 3), "from_safetensors_dir_s": round(from_path, 3),
                "publish_to_first_new_token_s": round(first_new[0] - published[0], 3) if first_new else None}


# -- decode at long context ---------------------------------------------------------------
def _long_prompts(tokenizer, n: int, length: int, shared: int = 0) -> list[list[int]]:
    """n prompts of `length` tokens (this file's text from n offsets): the first `shared` tokens
    the same in all, no block shared after them."""
    ids = tokenizer.encode(Path(__file__).read_text())
    while len(ids) < length + 7 * n:
        ids = ids + ids
    return [ids[:shared] + ids[shared + i * 7: i * 7 + length] for i in range(n)]


def long_decode(ctx: Context, dtype: str, shared_attention: bool = True) -> dict:
    from atelier.inference.engine import LocalEngine
    from atelier.inference.types import SamplingParams

    a = ctx.args
    B, C, K = a.long_batch, a.long_context, a.long_tokens
    params = SamplingParams(max_tokens=K, temperature=0.0, stop_token_ids=(-1,))
    with LocalEngine(ctx.path, device=a.device, dtype=dtype, max_batch=B,
                     kv_cache_tokens=max(32768, B * (C + K + 64))) as engine:
        engine._forward.cascade = shared_attention
        engine.generate(ctx.prompts[0], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        times: list[list[float]] = [[] for _ in range(B)]
        submitted = time.perf_counter()
        handles = [engine.submit(p, params, on_token=lambda *_, i=i: times[i].append(time.perf_counter()))
                   for i, p in enumerate(_long_prompts(ctx.tokenizer, B, C, a.long_shared))]
        for h in handles:
            h.result()
        start = max(t[0] for t in times)          # every prompt is in: decode steps only from here
        end = max(t[-1] for t in times)
        tokens = sum(1 for t in times for x in t if x > start)
        steps = max(sum(1 for x in t if x > start) for t in times)
        return {"dtype": str(engine.dtype).removeprefix("torch."), "batch": B, "context_tokens": C,
                "shared_tokens": a.long_shared, "shared_attention": shared_attention,
                "shared_rows": engine._forward.stats["shared_rows"],
                "new_tokens": K, "prefill_seconds": round(start - submitted, 2),
                "decode_tokens": tokens, "decode_seconds": round(end - start, 2),
                "decode_tokens_per_s": round(tokens / (end - start), 1) if end > start else None,
                "ms_per_step": round(1000 * (end - start) / steps, 1) if steps else None,
                "copied_rows": getattr(engine._forward, "stats", {}).get("copied_rows")}


# -- atelier serve's memory ---------------------------------------------------------------
def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def serve_memory(ctx: Context, dtype: str | None) -> dict:
    import socket

    import httpx

    a = ctx.args
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "atelier.cli.main", "serve", "--model", str(ctx.path), "--port", str(port)]
    if dtype:
        cmd += ["--dtype", dtype]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read().decode()[-2000:])
            try:
                httpx.get(url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError("atelier serve did not come up")
                time.sleep(0.3)
        idle = _vm(proc.pid, "VmRSS")
        code = Path(__file__).read_text()
        ids = ctx.tokenizer.encode(code)
        results: list = [None] * a.serve_clients

        def client(i: int) -> None:
            text = ctx.tokenizer.decode(ids[i * 7: i * 7 + a.serve_prompt_tokens])
            body = {"messages": [{"role": "user", "content": f"Review this code:\n{text}"}],
                    "max_tokens": 16, "temperature": 0}
            results[i] = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600).json()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.serve_clients)]
        secs, _ = _timed(lambda: ([t.start() for t in threads], [t.join() for t in threads]))
        health = httpx.get(url + "/health", timeout=10).json()
        ok = [r for r in results if r and "choices" in r]
        return {"dtype": dtype or "auto", "clients": a.serve_clients,
                "prompt_tokens": [r["usage"]["prompt_tokens"] for r in ok][:3],
                "completed": len(ok), "seconds": round(secs, 1),
                "rss_idle_gb": round(idle / 2**30, 3), "peak_rss_gb": round(_vm(proc.pid, "VmHWM") / 2**30, 3),
                "kv_blocks_used_after": health.get("kv_blocks_used"), "target_gb": 2.0}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


SECTIONS = ("throughput", "agent", "long", "weights", "serve")


def sections_to_skip(skip: str, only: str) -> set[str]:
    """The sections not to run: those `--skip` names, or all but those `--only` names."""
    named = [set(filter(None, x.split(","))) for x in (skip, only)]
    unknown = (named[0] | named[1]) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    return named[0] | (set(SECTIONS) - named[1] if named[1] else set())


def _progress(name: str, value):
    """Print one section's result as it completes (with the load), for runs cut short; return it."""
    print(f"{name} (load {os.getloadavg()[0]:.1f}): {json.dumps(value)}", file=sys.stderr, flush=True)
    return value


# -- main ------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default=",".join(ROWS), help="throughput rows to run")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--serve-clients", type=int, default=16)
    parser.add_argument("--serve-prompt-tokens", type=int, default=3000)
    parser.add_argument("--vllm-eager", action="store_true",
                        help="start vLLM without torch.compile (a first compile takes many minutes on a loaded CPU)")
    parser.add_argument("--long-batch", type=int, default=16)
    parser.add_argument("--long-context", type=int, default=3000)
    parser.add_argument("--long-tokens", type=int, default=32)
    parser.add_argument("--long-shared", type=int, default=0,
                        help="tokens the long prompts begin with in common (then measured with and without "
                             "shared-prompt attention)")
    parser.add_argument("--skip", default="", help=f"comma list of: {', '.join(SECTIONS)}")
    parser.add_argument("--only", default="", help=f"comma list of: {', '.join(SECTIONS)}; skip the others")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    skip = args.skip = sections_to_skip(args.skip, args.only)

    import torch
    from transformers import AutoTokenizer

    from atelier.inference.engine import pick_dtype

    torch.set_num_threads(args.threads)
    default = str(pick_dtype(args.device, None)).removeprefix("torch.")
    load = os.getloadavg()
    report: dict = {"benchmark": "inference", "model": args.model, "device": args.device,
                    "default_dtype": default, "torch_threads": args.threads, "new_tokens": args.new_tokens,
                    "batches": args.batches, "machine": platform.machine(), "cpus": os.cpu_count(),
                    "load_avg_at_start": [round(x, 1) for x in load]}
    with tempfile.TemporaryDirectory() as workdir:
        path = _model_dir(args.model, workdir)
        tokenizer = AutoTokenizer.from_pretrained(path)
        n = max(args.batches)
        ctx = Context(path, args, [_chat_ids(tokenizer, PROMPTS[i % len(PROMPTS)] + f" (#{i})") for i in range(n)],
                      tokenizer)
        report["prompt_tokens"] = [len(p) for p in ctx.prompts[:16]]
        rows = report["rows"] = {}
        names = list(filter(None, args.rows.split(",")))
        # The in-process rows and sections first, the vLLM servers (minutes to start, longer to
        # compile) last: a run cut short still has the target's rows.
        for name in [n for n in names if not n.startswith("vllm") and "throughput" not in skip]:
            rows[name] = _progress(name, ROWS[name](ctx))
        ours, hf = rows.get(f"builtin_{'bf16' if default == 'bfloat16' else 'fp32'}"), \
            [r for k, r in rows.items() if k.startswith("transformers")]
        if ours and hf and "16" in ours:
            best = max(r["16"]["tokens_per_s"] for r in hf)
            report["ratio_default_vs_hf_best_at_16"] = _progress("ratio_default_vs_hf_best_at_16",
                                                                 round(ours["16"]["tokens_per_s"] / best, 2))
            report["target"] = "the recipes' default engine >= 1.8x transformers' padded batch at 16"
        if "agent" not in skip and args.agents > 0:
            runs, replies = [], {}
            other = "float32" if default == "bfloat16" else "bfloat16"
            for dtype, cache, shared in ((default, False, True), (default, True, True), (default, True, False),
                                         (other, True, True)):
                result, replies[(dtype, cache, shared)] = agent_workload(ctx, dtype, cache, shared)
                runs.append(_progress("agent", result))
            report["agent"] = {"agents": args.agents, "turns": args.turns, "turn_tokens": args.turn_tokens,
                               "runs": runs,
                               "identical_with_and_without_cache":
                                   replies[(default, True, True)] == replies[(default, False, True)],
                               "cache_speedup": round(runs[0]["seconds"] / runs[1]["seconds"], 2),
                               "shared_attention_speedup": round(runs[2]["seconds"] / runs[1]["seconds"], 2)}
        if "long" not in skip:
            report["long_decode"] = _progress("long_decode", long_decode(ctx, default))
            if args.long_shared:
                alone = report["long_decode_unshared"] = _progress("long_decode", long_decode(ctx, default, False))
                report["shared_attention_speedup"] = round(alone["ms_per_step"] / report["long_decode"]["ms_per_step"], 2)
        if "weights" not in skip:
            report["weight_update"] = [_progress("weight_update", weight_update(ctx, d))
                                       for d in ("float32", "bfloat16")]
        for name in [n for n in names if n.startswith("vllm") and not {"throughput", "agent", "weights"} <= skip]:
            rows[name] = _progress(name, ROWS[name](ctx))
        if "serve" not in skip:
            report["serve_memory"] = serve_memory(ctx, None)
    report["load_avg_at_end"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
