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
The engine gets N threads that each call `engine.generate` at once.

Usage: python benchmarks/inference.py [--model smollm2-135m|tiny|DIR] [--new-tokens 64]
       [--concurrency 16] [--threads 2] [--device cpu]
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
        secs, toks = _timed(lambda: _engine_run(engine, prompts[:1], k))
        results["engine_1"] = {"seconds": secs, "tokens": toks}
        secs, toks = _timed(lambda: _hf_generate(hf, tokenizer, prompts, k, engine.device))
        results[f"hf_batched_{n}"] = {"seconds": secs, "tokens": toks}
        secs, toks = _timed(lambda: _hf_concurrent(hf, tokenizer, prompts, k, engine.device))
        results[f"hf_concurrent_{n}"] = {"seconds": secs, "tokens": toks}
        secs, toks = _timed(lambda: _engine_run(engine, prompts, k))
        results[f"engine_{n}"] = {"seconds": secs, "tokens": toks}
        engine.close()

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
    }))


if __name__ == "__main__":
    main()
