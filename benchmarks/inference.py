"""Generation throughput: atelier's LocalEngine against transformers' `generate`.

Same model, same prompts, same number of new tokens (stop tokens disabled on
both sides, greedy), at 1 and at N (default 16) concurrent sequences, in one
run. Prints ONE JSON object with tokens/s for each side and the ratios.

Peers at N concurrent sequences:
- `hf_concurrent` (the target's peer): N threads that each call `generate`
  on their own request at once — transformers serving N concurrent
  requests, as a server without a batching engine would;
- `hf_batched`: one `generate` call over all N prompts, left-padded — the
  best plain transformers can do when every request is known up front
  (reported for reference; at N=16 on a CPU both sides are bound by the
  same matrix multiplies, so expect a ratio near 1 there).
The engine gets N threads that each call `engine.generate` at once. Its
prefix cache is cleared before each timed run, so no run reuses another's
prompts (the warm-up's included).

Prefix cache (`prefix_cache`): an agent-like workload on the engine alone.
A agents (default 4) run T turns (default 3) at once; each starts from the
harness's real prompt (system message with every tool's schema, ~1,300
tokens, then its own task) and each turn's prompt is the last one plus the
reply (K greedy tokens) plus a tool output, token in, token out. Timed with
`prefix_cache_tokens=0` and with the default cache; the replies must be
identical, and the ratio of wall times is printed.

Usage: python benchmarks/inference.py [--model smollm2-135m|tiny|DIR] [--new-tokens 64]
       [--concurrency 16] [--threads 2] [--device cpu] [--agents 4] [--turns 3] [--turn-tokens 32]
The default model is pulled into the cache if missing.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import threading
import time

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


def _model_dir(spec: str, workdir: str):
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


def _prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append([int(t) for t in ids])
    return out


def _hf_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int, device) -> int:
    import torch

    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad)
    return int(out.shape[0] * (out.shape[1] - width))


def _hf_concurrent(model, tokenizer, prompts: list[list[int]], new_tokens: int, device) -> int:
    counts = [0] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        barrier.wait()
        counts[i] = _hf_generate(model, tokenizer, [prompts[i]], new_tokens, device)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def _engine_run(engine, prompts: list[list[int]], new_tokens: int) -> int:
    from atelier.inference.types import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, stop_token_ids=(-1,))
    counts = [0] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        barrier.wait()
        counts[i] = len(engine.generate(prompts[i], params).token_ids)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


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
    barrier = threading.Barrier(len(prompts))

    def agent(i: int) -> None:
        prompt = prompts[i]
        barrier.wait()
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


def _prefix_cache_figure(path, args, dtype) -> dict:
    from atelier.inference.engine import LocalEngine

    out: dict = {"agents": args.agents, "turns": args.turns, "turn_tokens": args.turn_tokens}
    replies = {}
    for name, budget in (("no_cache", 0), ("cache", None)):
        kwargs = {} if budget is None else {"prefix_cache_tokens": budget}
        with LocalEngine(path, device=args.device, dtype=dtype, max_batch=max(args.agents, 1), **kwargs) as engine:
            prompts = _agent_prompts(engine.tokenizer, args.agents)
            out["prompt_tokens"] = [len(p) for p in prompts]
            _agents_run(engine, [prompts[0][:8]], 1, 2)  # warm-up on a prompt no agent shares a block with
            engine.clear_prefix_cache()
            start = engine.stats.copy()
            secs, replies[name] = _timed_value(lambda: _agents_run(engine, prompts, args.turns, args.turn_tokens))
            out[name] = {"seconds": round(secs, 3),
                         "tokens": sum(len(r) for agent in replies[name] for r in agent),
                         "prefill_tokens": engine.stats["prefill_tokens"] - start["prefill_tokens"],
                         "prefix_hit_tokens": engine.stats["prefix_hit_tokens"] - start["prefix_hit_tokens"],
                         "prefix_cache_tokens": engine.prefix_cache.max_blocks * engine.prefix_cache.block}
    out["identical_outputs"] = replies["cache"] == replies["no_cache"]
    out["speedup"] = round(out["no_cache"]["seconds"] / out["cache"]["seconds"], 2)
    return out


def _timed_value(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def _timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--agents", type=int, default=4, help="prefix-cache workload: concurrent agents (0: skip)")
    parser.add_argument("--turns", type=int, default=3, help="prefix-cache workload: turns per agent")
    parser.add_argument("--turn-tokens", type=int, default=32, help="prefix-cache workload: tokens per reply")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from atelier.inference.engine import LocalEngine

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as workdir:
        path = _model_dir(args.model, workdir)
        engine = LocalEngine(path, device=args.device, dtype=args.dtype, max_batch=max(args.concurrency, 1))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=engine.dtype).to(engine.device).eval()
        tokenizer = engine.tokenizer
        n = args.concurrency
        prompts = _prompts(tokenizer, n)
        k = args.new_tokens
        # Warm-up both paths (allocator, kernels, lazy imports) before timing.
        _engine_run(engine, prompts[:2], 4)
        _hf_generate(hf, tokenizer, prompts[:1], 4, engine.device)

        results: dict[str, dict[str, float]] = {}
        secs, toks = _timed(lambda: sum(_hf_generate(hf, tokenizer, [p], k, engine.device) for p in prompts[:1]))
        results["hf_1"] = {"seconds": secs, "tokens": toks}
        engine.clear_prefix_cache()
        secs, toks = _timed(lambda: _engine_run(engine, prompts[:1], k))
        results["engine_1"] = {"seconds": secs, "tokens": toks}
        secs, toks = _timed(lambda: _hf_generate(hf, tokenizer, prompts, k, engine.device))
        results[f"hf_batched_{n}"] = {"seconds": secs, "tokens": toks}
        secs, toks = _timed(lambda: _hf_concurrent(hf, tokenizer, prompts, k, engine.device))
        results[f"hf_concurrent_{n}"] = {"seconds": secs, "tokens": toks}
        engine.clear_prefix_cache()
        secs, toks = _timed(lambda: _engine_run(engine, prompts, k))
        results[f"engine_{n}"] = {"seconds": secs, "tokens": toks}
        engine.close()
        prefix = _prefix_cache_figure(path, args, engine.dtype) if args.agents > 0 else None

    for r in results.values():
        r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 2)
        r["seconds"] = round(r["seconds"], 3)
    tps = {name: r["tokens_per_s"] for name, r in results.items()}
    print(json.dumps({
        "benchmark": "inference_throughput",
        "model": args.model, "device": args.device, "dtype": str(engine.dtype).replace("torch.", ""),
        "torch_threads": args.threads, "new_tokens": k, "concurrency": n,
        "prompt_tokens": [len(p) for p in prompts],
        "machine": platform.machine(),
        "results": results,
        "ratio_at_1": round(tps["engine_1"] / tps["hf_1"], 2),
        f"ratio_at_{n}": round(tps[f"engine_{n}"] / tps[f"hf_concurrent_{n}"], 2),
        f"ratio_at_{n}_vs_hf_batched": round(tps[f"engine_{n}"] / tps[f"hf_batched_{n}"], 2),
        "target": f"engine >= 2x transformers generate at {n} concurrent sequences",
        "prefix_cache": prefix,
    }))


if __name__ == "__main__":
    main()
