"""Speculative decoding against plain decoding, on the same engine; one JSON object.

One built-in engine over a model directory, drafting with its MTP heads (`atelier mtp attach`
writes them) and by lookup in each request's context (`--no-lookup`: heads alone; a model
without heads: lookup alone), decodes the same requests with speculation off (`never`), forced
on (`always`) and as the engine chooses (`auto`), interleaved: each batch size runs every mode
before the next batch size, and the whole set is repeated (`--repeats`, at least 2). Workloads:
chat prompts, greedy, `--new-tokens` each, at batch 1, 4, 16 and 32 (`--batches`; below batch 8,
8 prompts a batch at a time, so a small batch is not one prompt's luck); and the agent workload
of inference.py (the harness's real prompt, turns extended by replies and a tool output). Per
mode: tokens/s (seconds for the agent), the load when it started, drafted and accepted tokens
(and of them, the looked-up ones), mean accepted length (tokens a
verifying step emits, its correction or bonus token included). Per workload the summary also
gives what a speculative step costs in plain steps (forced speculation's accepted length over its
speed-up) and the accepted length a 1.5x speed-up would need at that cost.

Checks, on an fp32 engine (exact arithmetic, so equality is meaningful): `greedy_identical` (every
chat prompt's greedy tokens with and without speculation), and a two-sample test of sampled
tokens at T=0.7 (the first two tokens of `--samples` seeded completions of one prompt, each way; a
chi-square test of homogeneity that should not reject: p > 0.01).

    python benchmarks/speculative.py --model ~/.cache/atelier/models/smollm2-135m-mtp \
        [--batches 1,4,16,32] [--new-tokens 64] [--repeats 2] [--samples 300] [--threads 2] [--no-lookup] [--no-save]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import record  # noqa: E402
from inference import agent_prompts, agents_run, chat_prompts  # noqa: E402

MODES = ("never", "always", "auto")


def stats_delta(engine, before: dict, tokens: int) -> dict:
    """The engine's speculation counters over one measurement. A sequence's verifying step emits
    1 + its accepted drafts, so the tokens emitted less the drafts accepted count the sequences'
    steps, and tokens over those is the mean accepted length per sequence and step."""
    steps = engine.stats["speculative_steps"] - before["speculative_steps"]
    drafted = engine.stats["drafted"] - before["drafted"]
    accepted = engine.stats["accepted"] - before["accepted"]
    looked_up = {k: engine.stats[k] - before[k] for k in ("lookup_drafted", "lookup_accepted")}
    return {"speculative_steps": steps, "drafted": drafted, "accepted": accepted, **looked_up,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "mean_accepted_length": round(tokens / (tokens - accepted), 3) if steps and tokens > accepted else None}


def measure(engine, mode: str, work) -> dict:
    engine.speculation.mode = mode
    engine.clear_prefix_cache()
    before, load = dict(engine.stats), record.load()
    depths = Counter(engine.speculation.chosen)
    start = time.perf_counter()
    tokens = work()
    seconds = time.perf_counter() - start
    depths = {d: n for d, n in sorted((engine.speculation.chosen - depths).items())}
    return {"mode": mode, "load": load, "seconds": round(seconds, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1), "steps_by_depth": depths,
            **stats_delta(engine, before, tokens)}


GROUP_PROMPTS = 8   # a batch size below this decodes this many prompts, a batch at a time


def throughput_work(engine, chat, batch: int, params):
    """Decode the first max(batch, GROUP_PROMPTS) of `chat`, `batch` at a time (groups one after
    another); returns the tokens."""
    prompts = chat[:max(batch, GROUP_PROMPTS)]
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]

    def work():
        return sum(len(h.result().token_ids) for group in groups for h in [engine.submit(p, params) for p in group])
    return work


def agent_work(engine, prompts, turns: int, turn_tokens: int):
    def work():
        return sum(len(r) for replies in agents_run(engine, prompts, turns, turn_tokens) for r in replies)
    return work


def summarize(runs: list[dict]) -> dict:
    """Per workload and mode: the median figure over repetitions; speed-ups of always and auto."""
    out: dict = {}
    for key in dict.fromkeys(r["workload"] for r in runs):
        rows = {m: [r for r in runs if r["workload"] == key and r["mode"] == m] for m in MODES}
        med = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in rows.items() if rs}
        loads = [r["load"] for rs in rows.values() for r in rs]
        acc = [r["mean_accepted_length"] for r in rows["always"] if r["mean_accepted_length"]]
        out[key] = {"tokens_per_s": med, "loads": loads,
                    "mean_accepted_length": statistics.median(acc) if acc else None,
                    "speedup_always": round(med["always"] / med["never"], 2),
                    "speedup_auto": round(med["auto"] / med["never"], 2)}
        if acc:
            # forced speculation's speed-up is (accepted length) / (step cost, in plain steps): so the
            # cost of a speculative step, and the accepted length 1.5x would need at that cost
            cost = statistics.median(acc) / out[key]["speedup_always"]
            out[key].update(speculative_step_cost=round(cost, 2), length_for_1_5x=round(1.5 * cost, 2))
        if max(loads) - min(loads) > 1:
            out[key]["speedup_refused"] = "loads differ by more than 1"
    return out


def checks(model: Path, new_tokens: int, samples: int, lookup: bool) -> dict:
    """greedy_identical and the two-sample test, on an fp32 engine (see the module docstring)."""
    from scipy.stats import chi2_contingency

    from atelier.inference.engine import LocalEngine
    from atelier.inference.types import SamplingParams

    with LocalEngine(model, dtype="float32", speculate=True, prefix_cache_tokens=0, lookup=lookup) as engine:
        prompts = chat_prompts(engine.tokenizer, 8)
        greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, stop_token_ids=(-1,))
        outs = {}
        for mode in ("never", "always"):
            engine.speculation.mode = mode
            outs[mode] = [h.result().token_ids for h in [engine.submit(p, greedy) for p in prompts]]
        counts = {}
        for mode in ("never", "always"):
            engine.speculation.mode = mode
            seen: dict = {}
            for seed in range(samples):
                params = SamplingParams(max_tokens=2, temperature=0.7, seed=seed, stop_token_ids=(-1,))
                ids = tuple(engine.generate(prompts[0], params).token_ids)
                seen[ids] = seen.get(ids, 0) + 1
            counts[mode] = seen
    common = [k for k in set(counts["never"]) | set(counts["always"])
              if counts["never"].get(k, 0) + counts["always"].get(k, 0) >= 10]
    table = [[counts[m].get(k, 0) for k in common] + [samples - sum(counts[m].get(k, 0) for k in common)]
             for m in ("never", "always")]
    p_value = float(chi2_contingency(table).pvalue) if common else None
    return {"greedy_identical": outs["never"] == outs["always"],
            "sampled_two_sample_p": None if p_value is None else round(p_value, 4),
            "sampled_equal_not_rejected": p_value is None or p_value > 0.01,
            "sampled_outcomes_compared": len(common)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a model directory (with MTP heads, or without: "
                        "lookup drafts alone)")
    parser.add_argument("--no-lookup", action="store_true", help="draft with the heads alone")
    parser.add_argument("--batches", default="1,4,16,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None, help="pin the engine's CPU threads (default: it "
                        "chooses per batch size as it runs; a pinned count keeps that choice out of the comparison)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error("--repeats must be at least 2 (rows are interleaved A B A B)")
    from atelier.inference.engine import LocalEngine
    from atelier.inference.types import SamplingParams
    from atelier.mtp.store import read_mtp_meta

    model = Path(args.model).expanduser()
    batches = [int(b) for b in args.batches.split(",")]
    report = {"benchmark": "speculative", **record.stamp(), "model": str(model), "batches": batches,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": args.threads}
    with LocalEngine(model, speculate=True, max_batch=max(batches), threads=args.threads,
                     lookup=not args.no_lookup) as engine:
        report["dtype"] = str(engine.dtype).removeprefix("torch.")
        report["heads"] = (read_mtp_meta(model) or {"heads": 0})["heads"]
        report["drafters"] = list(engine.drafters)
        chat = chat_prompts(engine.tokenizer, max(max(batches), GROUP_PROMPTS))
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, stop_token_ids=(-1,))
        agents = agent_prompts(engine.tokenizer, args.agents)
        work = {f"batch_{b}": throughput_work(engine, chat, b, params) for b in batches}
        work["agent"] = agent_work(engine, agents, args.turns, args.turn_tokens)
        for mode in MODES:   # warm-up: compiled kernels and the policy's first measurements
            for w in work.values():
                measure(engine, mode, w)
        runs = []
        for rep in range(args.repeats):
            for key, w in work.items():
                for mode in MODES:
                    row = {"workload": key, "repeat": rep, **measure(engine, mode, w)}
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    runs.append(row)
    report["runs"] = runs
    report["summary"] = summarize(runs)
    report["checks"] = checks(model, args.new_tokens, args.samples, not args.no_lookup)
    print(json.dumps(record.finish("speculative", report, not args.no_save), indent=1))


if __name__ == "__main__":
    main()
