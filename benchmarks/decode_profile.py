"""Where a decode step of the built-in engine goes, by kind of work, at each batch size; one JSON object.

The engine decodes B chat prompts (SmolLM2-135M by default), greedy, and torch's profiler
records `--steps` decode steps from the middle of the run. Each operator's own time falls in
one kind:

- matmul: the linear layers (q/k/v, o, gate/up, down, LM head);
- compiled: kernels `torch.compile` built (the decode layer's fused work: attention, norms,
  rotary embedding, activation), where the engine compiles;
- attention: eager attention operators (products, softmax, gathers of keys);
- sampling: log-softmax, log-sum-exp, argmax, cumulative sums, draws;
- kv_store: writing the new keys and values into the cache;
- elementwise: everything else torch ran;
- python: the step's wall time not spent in any operator (the scheduler, bookkeeping, Python
  between operators).

The engine runs on `--threads` threads (default: torch's count), pinned: the profiler's own
work would otherwise make the engine's per-step choice (`atelier.inference.threads`) drop to one
thread, and the profile would be of a step users do not run. Run it alone on a quiet machine.

    python benchmarks/decode_profile.py [--model smollm2-135m] [--batches 1,16,64] [--steps 10] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import record  # noqa: E402

KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "atelier::packed_linear", "aten::linear"),
    "attention": ("aten::bmm", "aten::_softmax", "aten::softmax", "aten::index_select", "aten::amax",
                  "aten::_scaled_dot_product", "aten::index"),
    "sampling": ("aten::_log_softmax", "aten::logsumexp", "aten::argmax", "aten::cumsum", "aten::multinomial",
                 "aten::searchsorted", "aten::exp", "aten::exp_", "aten::gather"),
    "kv_store": ("aten::index_copy_", "aten::index_put_"),
}


def kind_of(name: str) -> str:
    if "CompiledFxGraph" in name or name.startswith("cpp_fused") or "Torch-Compiled Region" in name:
        return "compiled"
    for kind, prefixes in KINDS.items():
        if any(name.startswith(p) for p in prefixes):
            return kind
    return "elementwise"


def profile(engine, prompts, steps: int, new_tokens: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from atelier.inference.types import SamplingParams

    decode = engine._decode
    state = {"n": 0, "prof": None, "walls": [], "threads": set()}
    first = max(2, (new_tokens - steps) // 2)

    def step():
        state["n"] += 1
        if state["n"] == first:
            state["prof"] = torch_profile(activities=[ProfilerActivity.CPU])
            state["prof"].__enter__()
        start = time.perf_counter()
        decode()
        if first <= state["n"] < first + steps:
            state["walls"].append(time.perf_counter() - start)
            state["threads"].add(torch.get_num_threads())
        if state["n"] == first + steps - 1:
            state["prof"].__exit__(None, None, None)

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, stop_token_ids=(-1,))
    engine.clear_prefix_cache()
    engine._decode = step
    try:
        for h in [engine.submit(p, params) for p in prompts]:
            h.result()
    finally:
        engine._decode = decode
    by_kind: dict[str, float] = {}
    for event in state["prof"].key_averages():
        if event.key.startswith(("ProfilerStep", "## ", "Torch-Compiled Region", "TorchDynamo")) and \
                "CompiledFxGraph" not in event.key:
            continue
        by_kind[kind_of(event.key)] = by_kind.get(kind_of(event.key), 0.0) + event.self_cpu_time_total / 1e3
    wall_ms = 1000 * sum(state["walls"])
    ops_ms = sum(by_kind.values())
    out = {k: round(v / steps, 2) for k, v in sorted(by_kind.items())}
    out["python"] = round(max(0.0, wall_ms - ops_ms) / steps, 2)
    return {"ms_per_step": round(1000 * statistics.median(state["walls"]), 2), "ms_by_kind": out,
            "threads": sorted(state["threads"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    from inference import chat_prompts, model_dir

    from atelier.inference.engine import LocalEngine
    from atelier.inference.types import SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    report = {"benchmark": "decode_profile", **record.stamp(), "model": args.model, "batches": {}}
    import torch

    threads = args.threads or torch.get_num_threads()
    with LocalEngine(model_dir(args.model), dtype=args.dtype, max_batch=max(batches), threads=threads) as engine:
        report["dtype"] = str(engine.dtype).removeprefix("torch.")
        prompts = chat_prompts(engine.tokenizer, max(batches))
        for b in batches:   # warm-up: compiled kernels for every batch size
            for h in [engine.submit(p, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(-1,)))
                      for p in prompts[:b]]:
                h.result()
        for b in batches:
            report["batches"][str(b)] = {"load": record.load(),
                                         **profile(engine, prompts[:b], args.steps, args.new_tokens)}
            print(f"batch {b}: {json.dumps(report['batches'][str(b)])}", file=sys.stderr, flush=True)
    if not args.no_save:
        report["saved_to"] = str(record.save("decode_profile", report).relative_to(Path(__file__).parent.parent))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
