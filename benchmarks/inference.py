"""Generation speed of the built-in engine against transformers and vLLM, interleaved, in one run.

Rows (`--rows`): the built-in engine (`builtin_bf16`, `builtin_fp32`; `builtin1thread_bf16`
pinned to one thread, to see what choosing the thread count per step is worth), transformers' `generate`
over one left-padded batch (`transformers_padded_bf16`, `..._fp32`: its best configuration
when every request is known up front) and a vLLM server (`vllm_bf16`, `vllm_fp32`, from the
`make vllm-env` environment; one request per generation, prefix caching on: its best
configuration here). Every row runs in a process of its own, loaded and warmed up once (so
each batch size's compiled kernels exist before anything is timed, and no row's threads or
memory touch another's).

Throughput: the same chat prompts, greedy, stop tokens disabled, `--new-tokens` each, at each
batch size (`--batches`, default 1, 16, 64): the engine gets B concurrent requests,
transformers one `generate` over all B, vLLM B concurrent requests. Tokens/s.

The agent workload (`agent`): A agents (`--agents`, default 4) run T turns (`--turns`, 3) at
once from the harness's real prompt (every tool's schema, ~1,300 tokens), each turn's prompt
the last one plus the reply (`--turn-tokens` greedy tokens) plus a tool output: seconds, on
the built-in engine and on vLLM, both with prefix caching. The built-in engine (fp32 where that
row runs) also runs it once without its prefix cache: the replies must be identical.

Protocol: the whole set is repeated `--repeats` times (at least 2). Within a repetition each
batch size runs every row before the next batch size, then the agent workload runs on every
row that has it (A B A B). Each measurement records the one-minute load average when it
started, after `record.settle()` let the cores go quiet (a peer may spin on after it
answers: the next row would pay for it). A row's figure at a batch size is the median over
repetitions.

Ratios: the recipes' engine (the built-in row in the dtype `dtype="auto"` picks here) over the
best peer row (the fastest transformers or vLLM row at that batch size, whichever it is), at
every batch size, and over vLLM on the agent workload (seconds, inverted). A ratio is refused
(`null`, with the reason) when the loads of the measurements it compares differ by more than 1.

Other sections, each in a fresh process of its own, after the rows: `long` (decode at long
context: `--long-batch` requests of `--long-context` distinct tokens decode `--long-tokens`
greedy tokens at once, ms per step counted after the last prefill), `weights` (full-model
`update_weights` from tensors, the first and then warm, and from a safetensors directory, and
publish-to-first-new-token while 8 requests decode), `serve` (peak resident memory of `atelier serve` while
`--serve-clients` clients send ~`--serve-prompt-tokens`-token chat prompts; target <= 2 GB).

Prints ONE JSON object and writes it to `benchmarks/results/inference-<time>-<commit>.json`
(with the commit, the machine, and the load at start and end). Run it alone on a quiet machine.

    python benchmarks/inference.py [--model smollm2-135m|tiny|DIR] [--rows builtin_bf16,...]
        [--batches 1,16,64] [--repeats 2] [--only throughput,agent,long,weights,serve | --skip ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import record  # noqa: E402

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
SECTIONS = ("throughput", "agent", "long", "weights", "serve")
LOAD_SPREAD = 1.0


# -- what every row process shares ---------------------------------------------------------
def model_dir(spec: str) -> Path:
    if spec == "tiny":
        from atelier.inference.tiny import build_tiny_model

        return build_tiny_model(Path(tempfile.mkdtemp(prefix="atelier-bench-")) / "tiny", initializer_range=0.2)
    from atelier.inference.models import KNOWN_MODELS, ModelNotFound, resolve_model

    try:
        return resolve_model(spec)
    except ModelNotFound:
        if spec.lower() not in KNOWN_MODELS:
            raise
        from atelier.inference.pull import pull_model

        return pull_model(spec)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [[int(t) for t in tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + f" (#{i})"}], add_generation_prompt=True,
        tokenize=True, return_dict=False)] for i in range(n)]


def agent_prompts(tokenizer, n: int) -> list[list[int]]:
    from atelier.harness.prompt import build_messages
    from atelier.harness.tools import default_tools

    tools = default_tools()
    return [[int(t) for t in tokenizer.apply_chat_template(build_messages(tools, AGENT_TASKS[i % len(AGENT_TASKS)]),
                                                            add_generation_prompt=True, tokenize=True,
                                                            return_dict=False)] for i in range(n)]


def concurrently(fn, items: list) -> list:
    """`fn(item)` for every item, each on its own thread, all at once; results in order."""
    results: list = [None] * len(items)

    def one(i: int) -> None:
        try:
            results[i] = fn(items[i])
        except Exception as exc:  # re-raised below, in the caller's thread
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def agents_run(engine, prompts: list[list[int]], turns: int, turn_tokens: int) -> list[list[list[int]]]:
    """Each agent's replies, turn by turn; agents run concurrently, each turn extends the last prompt."""
    from atelier.inference.types import SamplingParams

    params = SamplingParams(max_tokens=turn_tokens, temperature=0.0, stop_token_ids=(-1,))
    tool = [int(t) for t in engine.tokenizer.encode(TOOL_OUTPUT)]

    def agent(prompt: list[int]) -> list[list[int]]:
        replies = []
        for _ in range(turns):
            reply = engine.generate(prompt, params).token_ids
            replies.append(reply)
            prompt = prompt + reply + tool
        return replies

    return concurrently(agent, prompts)


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


# -- rows: each lives in a process of its own -----------------------------------------------
class BuiltinRow:
    threads: int | None = None   # None: the engine chooses per step

    def __init__(self, args, dtype: str) -> None:
        from atelier.inference.engine import LocalEngine
        from atelier.inference.types import SamplingParams

        self.args = args
        self.engine = LocalEngine(model_dir(args.model), device=args.device, dtype=dtype, max_batch=max(args.batches),
                                  threads=self.threads)
        self.prompts = chat_prompts(self.engine.tokenizer, max(args.batches))
        self.params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop_token_ids=(-1,))

    def info(self) -> dict:
        e = self.engine
        return {"dtype": str(e.dtype).removeprefix("torch."), "compiled": e._forward.attention.compiled,
                "packed_weights_mb": round(e._forward.packed_bytes / 2**20)}

    def throughput(self, batch: int) -> dict:
        self.engine.clear_prefix_cache()   # no batch reuses another's prompts
        steps, threads = self.engine.stats["steps"], self.engine._threads
        secs, tokens = timed(lambda: sum(len(h.result().token_ids)
                                         for h in [self.engine.submit(p, self.params) for p in self.prompts[:batch]]))
        return {"seconds": round(secs, 3), "tokens": tokens, "tokens_per_s": round(tokens / secs, 1),
                "steps": self.engine.stats["steps"] - steps, "threads_now": threads.current,
                "thread_switches": threads.switches}

    def agent(self, cache: bool = True) -> dict:
        a, engine = self.args, self.engine
        prompts = agent_prompts(engine.tokenizer, a.agents)
        engine.clear_prefix_cache()
        before = dict(engine.stats)
        if not cache:
            engine.pool.max_blocks, kept = 0, engine.pool.max_blocks
        try:
            secs, replies = timed(lambda: agents_run(engine, prompts, a.turns, a.turn_tokens))
        finally:
            if not cache:
                engine.pool.max_blocks = kept
        return {"seconds": round(secs, 2), "prefix_cache": cache, "prompt_tokens": [len(p) for p in prompts],
                "prefill_tokens": engine.stats["prefill_tokens"] - before["prefill_tokens"],
                "prefix_hit_tokens": engine.stats["prefix_hit_tokens"] - before["prefix_hit_tokens"],
                "replies": replies}

    def close(self) -> None:
        self.engine.close()


class TransformersRow:
    def __init__(self, args, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = model_dir(args.model)
        self.args, self.torch = args, torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]).to(args.device).eval()
        self.prompts = chat_prompts(self.tokenizer, max(args.batches))

    def info(self) -> dict:
        return {"dtype": self.dtype}

    def throughput(self, batch: int) -> dict:
        torch, k = self.torch, self.args.new_tokens
        prompts = self.prompts[:batch]
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1

        def run() -> int:
            with torch.inference_mode():
                out = self.model.generate(ids.to(self.args.device), attention_mask=mask.to(self.args.device),
                                          do_sample=False, max_new_tokens=k, min_new_tokens=k, pad_token_id=pad)
            return int(out.shape[0] * (out.shape[1] - width))

        secs, tokens = timed(run)
        return {"seconds": round(secs, 3), "tokens": tokens, "tokens_per_s": round(tokens / secs, 1)}

    def close(self) -> None:
        pass


class VLLMRow:
    def __init__(self, args, dtype: str) -> None:
        from atelier.inference.types import SamplingParams
        from atelier.inference.vllm_engine import VLLMEngine
        from atelier.inference.vllm_server import VLLMConfig

        self.args = args
        # one request per generation: chunks (what in-flight weight updates need) cost requests
        config = VLLMConfig(dtype=dtype, max_model_len=4096, chunk_tokens=max(args.new_tokens, args.turn_tokens))
        self.start_s, self.engine = timed(lambda: VLLMEngine(model_dir(args.model), config))
        self.dtype = dtype
        self.prompts = chat_prompts(self.engine.tokenizer, max(args.batches))
        self.params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop_token_ids=(-1,))

    def info(self) -> dict:
        return {"dtype": self.dtype, "server_start_s": round(self.start_s, 1),
                "chunk_tokens": self.engine.config.chunk_tokens, "enforce_eager": self.engine.config.enforce_eager}

    def throughput(self, batch: int) -> dict:
        self.engine.clear_prefix_cache()
        secs, counts = timed(lambda: concurrently(lambda p: len(self.engine.generate(p, self.params).token_ids),
                                                  self.prompts[:batch]))
        return {"seconds": round(secs, 3), "tokens": sum(counts), "tokens_per_s": round(sum(counts) / secs, 1)}

    def agent(self) -> dict:
        a, engine = self.args, self.engine
        prompts = agent_prompts(engine.tokenizer, a.agents)
        engine.clear_prefix_cache()
        cached = engine.stats["cached_prompt_tokens"]
        secs, replies = timed(lambda: agents_run(engine, prompts, a.turns, a.turn_tokens))
        return {"seconds": round(secs, 2), "prefix_cache": True, "prompt_tokens": [len(p) for p in prompts],
                "prefix_hit_tokens": engine.stats["cached_prompt_tokens"] - cached, "replies": replies}

    def close(self) -> None:
        self.engine.close()


class BuiltinOneThreadRow(BuiltinRow):
    """The built-in engine pinned to one thread (what it did before it chose per step)."""

    threads = 1


ROW_KINDS = {"builtin": BuiltinRow, "builtin1thread": BuiltinOneThreadRow, "transformers_padded": TransformersRow,
             "vllm": VLLMRow}
ROWS = [f"{kind}_{dtype}" for kind in ROW_KINDS for dtype in ("bf16", "fp32")]


def _serve_row(name: str, args, conn) -> None:
    """A row process: build the row, then run what the parent asks, one call at a time."""
    import torch

    torch.set_num_threads(args.threads)
    kind, dtype = name.rsplit("_", 1)
    try:
        row = ROW_KINDS[kind](args, {"bf16": "bfloat16", "fp32": "float32"}[dtype])
        conn.send(("ok", row.info()))
    except Exception as exc:  # reported as the row's result: a missing vLLM skips its rows
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        method, call_args = conn.recv()
        if method == "close":
            row.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(row, method)(*call_args)))
        except Exception as exc:  # one failed measurement is reported, the others still run
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class RowProcess:
    """A row in a child process (spawned: a fresh interpreter, no threads or memory shared)."""

    def __init__(self, name: str, args) -> None:
        self.name = name
        self.conn, child = multiprocessing.Pipe()
        self.proc = multiprocessing.get_context("spawn").Process(target=_serve_row, args=(name, args, child),
                                                                 daemon=True)
        self.proc.start()
        status, self.info = self.conn.recv()
        self.error = self.info if status == "error" else None

    def call(self, method: str, *call_args):
        self.conn.send((method, call_args))
        status, value = self.conn.recv()
        return {"error": value} if status == "error" else value

    def close(self) -> None:
        if self.error is None and self.proc.is_alive():
            self.call("close")
        self.proc.join(timeout=120)


def in_child(fn, *fn_args):
    """`fn(*fn_args)` in a fresh process; its result (or an error dict)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        try:
            return pool.apply(fn, fn_args)
        except Exception as exc:  # a section's failure is its result; the run goes on
            return {"error": f"{type(exc).__name__}: {exc}"}


def progress(name: str, value):
    print(f"{name} (load {record.load()}): {json.dumps(value)[:400]}", file=sys.stderr, flush=True)
    return value


# -- the interleaved protocol ---------------------------------------------------------------
def measure_rows(args, rows: dict[str, RowProcess], sections: set[str]) -> dict:
    """Warm every row, then the repetitions (see the module docstring). Returns every
    measurement with its load, and each row's median per batch size."""
    live = {n: r for n, r in rows.items() if r.error is None}
    for name, row in live.items():   # warm-up: every batch size twice, so compiled kernels exist
        for b in args.batches:
            for _ in range(2):
                row.call("throughput", b)
        if "agent" in sections and hasattr(ROW_KINDS[name.rsplit("_", 1)[0]], "agent"):
            row.call("agent")
        progress(f"{name} warm", row.info)
    runs: list[dict] = []
    for rep in range(args.repeats):
        if "throughput" in sections:
            for b in args.batches:
                for name, row in live.items():
                    quiet, load = record.settle(), record.load()
                    result = row.call("throughput", b)
                    runs.append(progress(f"{name} batch {b}", {"row": name, "batch": b, "repeat": rep,
                                                               "load": load, **quiet, **result}))
        if "agent" in sections:
            for name, row in live.items():
                if not hasattr(ROW_KINDS[name.rsplit("_", 1)[0]], "agent"):
                    continue
                quiet, load = record.settle(), record.load()
                result = row.call("agent")
                replies = result.pop("replies", None)
                digest = hashlib.sha1(json.dumps(replies).encode()).hexdigest()[:12]
                runs.append(progress(f"{name} agent", {"row": name, "batch": "agent", "repeat": rep, "load": load,
                                                       **quiet, **result, "replies_sha1": digest}))
    return {"runs": runs, "rows": {name: summarize(runs, name) for name in live},
            "skipped": {name: r.error for name, r in rows.items() if r.error is not None}}


def summarize(runs: list[dict], row: str) -> dict:
    out = {}
    for key in sorted({r["batch"] for r in runs if r["row"] == row}, key=str):
        mine = [r for r in runs if r["row"] == row and r["batch"] == key and "error" not in r]
        if not mine:
            continue
        figure = "seconds" if key == "agent" else "tokens_per_s"
        out[str(key)] = {figure: statistics.median(r[figure] for r in mine),
                         "each": [r[figure] for r in mine], "loads": [r["load"] for r in mine]}
    return out


def ratio(ours: dict | None, peers: dict[str, dict], key: str, higher_is_better: bool = True) -> dict:
    """The default row's figure over the best peer's at `key`, refused when the loads differ."""
    figure = "tokens_per_s" if higher_is_better else "seconds"
    if not ours or key not in ours:
        return {"ratio": None, "reason": "the default engine's row did not run"}
    have = {name: s[key] for name, s in peers.items() if key in s}
    if not have:
        return {"ratio": None, "reason": "no peer row ran"}
    pick = max if higher_is_better else min
    best = pick(have, key=lambda name: have[name][figure])
    loads = ours[key]["loads"] + have[best]["loads"]
    value = ours[key][figure] / have[best][figure] if higher_is_better else have[best][figure] / ours[key][figure]
    out = {"best_peer": best, "ours": ours[key][figure], "peer": have[best][figure], "loads": loads}
    if max(loads) - min(loads) > LOAD_SPREAD:
        return {**out, "ratio": None,
                "reason": f"loads differ by {max(loads) - min(loads):.1f} (> {LOAD_SPREAD}): rerun on a quiet machine"}
    return {**out, "ratio": round(value, 2)}


# -- the other sections, each in a fresh process ---------------------------------------------
def long_decode(args) -> dict:
    import torch

    from atelier.inference.engine import LocalEngine
    from atelier.inference.types import SamplingParams

    torch.set_num_threads(args.threads)
    B, C, K = args.long_batch, args.long_context, args.long_tokens
    params = SamplingParams(max_tokens=K, temperature=0.0, stop_token_ids=(-1,))
    with LocalEngine(model_dir(args.model), device=args.device, max_batch=B,
                     kv_cache_tokens=max(32768, B * (C + K + 64))) as engine:
        ids = engine.tokenizer.encode(Path(__file__).read_text())
        while len(ids) < C + 7 * B:
            ids = ids + ids
        prompts = [ids[i * 7: i * 7 + C] for i in range(B)]
        engine.generate(prompts[0][:64], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        times: list[list[float]] = [[] for _ in range(B)]
        submitted = time.perf_counter()
        handles = [engine.submit(p, params, on_token=lambda *_, i=i: times[i].append(time.perf_counter()))
                   for i, p in enumerate(prompts)]
        for h in handles:
            h.result()
        start = max(t[0] for t in times)          # every prompt is in: decode steps only from here
        end = max(t[-1] for t in times)
        tokens = sum(1 for t in times for x in t if x > start)
        steps = max(sum(1 for x in t if x > start) for t in times)
        return {"dtype": str(engine.dtype).removeprefix("torch."), "batch": B, "context_tokens": C, "new_tokens": K,
                "prefill_seconds": round(start - submitted, 2), "decode_tokens": tokens,
                "decode_seconds": round(end - start, 2),
                "decode_tokens_per_s": round(tokens / (end - start), 1) if end > start else None,
                "ms_per_step": round(1000 * (end - start) / steps, 1) if steps else None}


def weight_update(args, dtype: str) -> dict:
    import torch
    from safetensors.torch import save_file

    from atelier.inference.engine import LocalEngine
    from atelier.inference.types import SamplingParams

    torch.set_num_threads(args.threads)
    with LocalEngine(model_dir(args.model), device=args.device, dtype=dtype) as engine, \
            tempfile.TemporaryDirectory() as tmp:
        state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        in_process, _ = timed(lambda: engine.update_weights(state, version=1))
        # the first write to each weight page faults it in (a model loaded from a mapped file);
        # an RL run pays that once, then every later update's time
        warm_s = statistics.median(timed(lambda: engine.update_weights(state, version=1))[0] for _ in range(3))
        save_file({k: v.contiguous() for k, v in state.items() if not k.startswith("lm_head")},
                  f"{tmp}/model.safetensors")
        from_path, _ = timed(lambda: engine.update_weights_from_path(tmp, version=2))
        first_new: list[float] = []

        def on_token(token: int, logprob: float, version: int) -> None:
            if version == 3 and not first_new:
                first_new.append(time.perf_counter())

        params = SamplingParams(max_tokens=512, temperature=0.0, stop_token_ids=(-1,))
        prompts = chat_prompts(engine.tokenizer, 8)
        # warm: the first steps at a batch size build its kernels, which is not the update's time
        warm = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(-1,))
        for h in [engine.submit(p, warm) for p in prompts]:
            h.result()
        steps = engine.stats["steps"]
        handles = [engine.submit(p, params, on_token=on_token) for p in prompts]
        while engine.stats["steps"] < steps + 3:   # mid-decode: the prompts prefilled, tokens flowing
            time.sleep(0.01)
        fresh = {k: v.clone() for k, v in state.items()}   # the caller's copy is not the update's time
        published = time.perf_counter()
        engine.update_weights(fresh, version=3)
        deadline = time.monotonic() + 600
        while not first_new and time.monotonic() < deadline:
            time.sleep(0.005)
        for h in handles:
            h.cancel()
        return {"dtype": dtype, "tensors": len(state), "in_process_s": round(in_process, 3),
                "in_process_warm_s": round(warm_s, 3),
                "from_safetensors_dir_s": round(from_path, 3),
                "publish_to_first_new_token_s": round(first_new[0] - published, 3) if first_new else None}


def _vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def serve_memory(args) -> dict:
    import socket

    import httpx
    from transformers import AutoTokenizer

    path = model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "atelier.cli.main", "serve", "--model", str(path), "--port", str(port)]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
        ids = tokenizer.encode(Path(__file__).read_text())
        while len(ids) < args.serve_prompt_tokens + 7 * args.serve_clients:
            ids = ids + ids

        def client(i: int) -> dict:
            text = tokenizer.decode(ids[i * 7: i * 7 + args.serve_prompt_tokens])
            body = {"messages": [{"role": "user", "content": f"Review this code:\n{text}"}],
                    "max_tokens": 16, "temperature": 0}
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=3600).json()

        secs, results = timed(lambda: concurrently(client, list(range(args.serve_clients))))
        ok = [r for r in results if r and "choices" in r]
        return {"clients": args.serve_clients, "prompt_tokens": [r["usage"]["prompt_tokens"] for r in ok][:3],
                "completed": len(ok), "seconds": round(secs, 1), "rss_idle_gb": round(idle / 2**30, 3),
                "peak_rss_gb": round(_vm(proc.pid, "VmHWM") / 2**30, 3), "target_gb": 2.0}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def sections_to_run(skip: str, only: str) -> set[str]:
    named = [set(filter(None, x.split(","))) for x in (skip, only)]
    unknown = (named[0] | named[1]) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    return (named[1] or set(SECTIONS)) - named[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", default="builtin_bf16,builtin_fp32,transformers_padded_bf16,transformers_padded_fp32,"
                                          "vllm_bf16", help=f"comma list of: {', '.join(ROWS)}")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads per row")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--long-batch", type=int, default=16)
    parser.add_argument("--long-context", type=int, default=3000)
    parser.add_argument("--long-tokens", type=int, default=32)
    parser.add_argument("--serve-clients", type=int, default=16)
    parser.add_argument("--serve-prompt-tokens", type=int, default=3000)
    parser.add_argument("--skip", default="")
    parser.add_argument("--only", default="")
    parser.add_argument("--no-save", action="store_true", help="print only; write nothing under benchmarks/results")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.repeats < 2:
        raise SystemExit("--repeats must be at least 2: a ratio needs every row measured twice, interleaved")
    names = [n for n in filter(None, args.rows.split(","))]
    if unknown := set(names) - set(ROWS):
        raise SystemExit(f"unknown row(s) {', '.join(sorted(unknown))}; choose from {', '.join(ROWS)}")
    sections = sections_to_run(args.skip, args.only)
    args.model = str(model_dir(args.model))   # resolved (or built) once: every row loads the same files

    from atelier.inference.engine import pick_dtype

    default = "bf16" if str(pick_dtype(args.device, None)) == "torch.bfloat16" else "fp32"
    report: dict = {"benchmark": "inference", **record.stamp(), "model": args.model, "device": args.device,
                    "default_engine": f"builtin_{default}", "threads": args.threads, "new_tokens": args.new_tokens,
                    "batches": args.batches, "repeats": args.repeats, "agents": args.agents, "turns": args.turns,
                    "turn_tokens": args.turn_tokens}
    if sections & {"throughput", "agent"}:
        rows = {}
        try:
            for name in names:
                rows[name] = RowProcess(name, args)
                row = rows[name]
                progress(f"{name} loaded", row.info if row.error is None else {"skipped": row.error})
            report.update(measure_rows(args, rows, sections))
            # exact in fp32; in bf16 a prefix-cache hit computes the same logits in another order
            # and can move a greedy choice, as any two kernels can
            usable = [rows[n] for n in ("builtin_fp32", f"builtin_{default}") if n in rows and rows[n].error is None]
            exact = usable[0] if usable else None
            if "agent" in sections and exact is not None:
                report["agent_without_prefix_cache"] = without = exact.call("agent", False)
                with_cache = exact.call("agent", True)
                report["agent_identical_with_and_without_cache"] = {
                    "row": exact.name, "identical": without.pop("replies") == with_cache.pop("replies")}
        finally:
            for row in rows.values():
                row.close()
        ours = report["rows"].get(f"builtin_{default}")
        peers = {n: s for n, s in report["rows"].items() if not n.startswith("builtin")}
        report["ratios"] = {str(b): ratio(ours, peers, str(b)) for b in args.batches if "throughput" in sections}
        if "agent" in sections:
            report["ratios"]["agent"] = ratio(ours, {n: s for n, s in peers.items() if "agent" in s}, "agent",
                                              higher_is_better=False)
        report["target"] = "every ratio >= 1.0: the default engine at or above the best of transformers and vLLM"
    if "long" in sections:
        report["long_decode"] = progress("long_decode", in_child(long_decode, args))
    if "weights" in sections:
        report["weight_update"] = [progress("weight_update", in_child(weight_update, args, d))
                                   for d in ("float32", "bfloat16")]
    if "serve" in sections:
        report["serve_memory"] = progress("serve_memory", in_child(serve_memory, args))
    if args.no_save:
        report["load_at_end"] = record.load()
    else:
        report["saved_to"] = str(record.save("inference", report).relative_to(Path(__file__).parent.parent))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
