"""RL trainer throughput: fp32 vs bf16 and 1 vs N ranks (FSDP2), with MFU; prints one JSON object.

Each configuration runs as its own set of rank processes (`atelier.train.launch`,
torchrun's elastic agent), on the same batch of RL samples: `--batch`
sequences of `--seq-len` tokens, all trained on. Every rank first measures
its square-matmul rate in the precision it trains in (same process, same
threads), then times `--steps` trainer steps (the median is reported) after
`--warmup`. Figures:

- tokens_per_s: the step's tokens over the median step time (all ranks);
- mfu: model FLOPs per second (PaLM: 6 * params + 12 * layers * hidden *
  seq_len per token; the chunked logprob recomputation is overhead, not
  counted) over the sum of the ranks' measured matmul rates;
- peak_rss_gb: each rank's peak resident memory (CPU) or peak allocated
  GPU memory.

The model is SmolLM2-135M's architecture, randomly initialised (speed depends
on shapes, not weights), or `--model DIR`. On a CPU shared with other work the
absolute rates fall with the load; the ratios inside one run are what to read.

    python benchmarks/train.py [--seq-len 2048] [--batch 1] [--ranks 1 2] [--precisions fp32 bf16]
    python benchmarks/train.py --seq-len 4096 --batch 4 --ranks 1 --precisions bf16   # memory target
    python benchmarks/train.py --ranks 1 --precisions bf16 --activation-checkpointing --batch 12 --micro-batch 1 \
        --seq-len 2100 --shared-prefix 1200 --group-size 6 --group-shared 300 --trained 800   # the demo's RL step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import record  # noqa: E402
from pretrain import SMOLLM2_135M, matmul_gflops, sync  # noqa: E402


def build_model(out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M)).save_pretrained(out)
    return out


def worker(spec: dict) -> None:
    """One rank: matmul rate, then timed trainer steps; rank 0 writes the JSON result."""
    import resource

    import torch

    from atelier.rl.config import TrainerConfig
    from atelier.rl.sample import Sample
    from atelier.rl.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    cfg = TrainerConfig(precision=spec["precision"], micro_batch=spec["micro_batch"], device=spec["device"],
                        activation_checkpointing=spec["activation_checkpointing"], lr=1e-6, norm_tokens=4096,
                        logprob_chunk=spec["logprob_chunk"], share_prefix=spec["prefix"] != "whole",
                        recompute_prefix=spec["prefix"] != "kept")
    trainer = Trainer(spec["model"], cfg)
    device = str(trainer.ranks.device)
    dtype = torch.bfloat16 if trainer.precision == "bf16" else torch.float32
    rate, rate_cpu = matmul_gflops(device, dtype)
    g = torch.Generator().manual_seed(0)
    n, vocab = spec["seq_len"], trainer.model.config.vocab_size
    tokens = lambda count: torch.randint(0, vocab, (count,), generator=g).tolist()   # noqa: E731
    shared = tokens(spec["shared_prefix"])
    # each group of --group-size samples also shares --group-shared tokens (its task and the turns its
    # members sampled alike), trained where they fall inside the last --trained tokens
    group_runs = [tokens(spec["group_shared"]) for _ in range(-(-spec["batch"] // spec["group_size"]))]
    trained = min(spec["trained"] or n - 1, n - 1)
    samples = []
    for i in range(spec["batch"]):
        begun = shared + group_runs[i // spec["group_size"]]
        samples.append(Sample(begun + tokens(n - len(begun)), [0] * (n - trained) + [1] * trained,
                              [0.0] * (n - trained) + [-3.0] * trained, [-1] * (n - trained) + [0] * trained,
                              1.0 if i % 2 else -1.0, "g", "t"))
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        sync(device)
        start = time.perf_counter()
        trainer.train_step(samples)
        sync(device)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - start)
    from atelier.train.collectives import all_reduce_max, all_reduce_sum
    from atelier.train.ranks import close_ranks

    rss_gb = (torch.cuda.max_memory_allocated() if device.startswith("cuda")
              else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
    rates = all_reduce_sum([rate], trainer.ranks)[0]
    peaks = all_reduce_max([rss_gb], trainer.ranks)[0]
    step_s = all_reduce_max([statistics.median(times)], trainer.ranks)[0]
    if trainer.ranks.main:
        c = trainer.model.config
        params = sum(p.numel() for p in trainer.model.parameters())   # a DTensor's numel is the whole
        tokens = spec["batch"] * n
        flops_per_token = 6 * params + 12 * c.num_hidden_layers * c.hidden_size * n
        achieved = tokens / step_s * flops_per_token / 1e9
        Path(spec["out"]).write_text(json.dumps({
            "ranks": trainer.ranks.world, "precision": trainer.precision, "device": device,
            "share_prefix": spec["prefix"] != "whole", "prefix": spec["prefix"],
            "activation_checkpointing": spec["activation_checkpointing"],
            "threads_per_rank": spec["threads"], "step_s": round(step_s, 3),
            "tokens_per_s": round(tokens / step_s, 1), "matmul_gflops_all_ranks": round(rates, 1),
            "achieved_gflops": round(achieved, 1), "mfu": round(achieved / rates, 4),
            "peak_rss_gb_max_rank": round(peaks, 2)}))
    close_ranks()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: SmolLM2-135M's shapes)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=None, help="total CPU threads, split across ranks")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--activation-checkpointing", nargs="?", const="on", default="off",
                        choices=["off", "on", "both"],
                        help="rl.trainer.activation_checkpointing; both: each configuration without and with it")
    parser.add_argument("--logprob-chunk", type=int, default=512,
                        help="tokens per logprob-head block (rl.trainer.logprob_chunk)")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every sample begins with (a system prompt); >0 also times rl.trainer.share_prefix "
                             "off, and on with recompute_prefix off (the prefix's activations kept)")
    parser.add_argument("--group-size", type=int, default=1, help="samples per group (with --group-shared)")
    parser.add_argument("--group-shared", type=int, default=0,
                        help="tokens each group's samples share after the --shared-prefix (a task, turns sampled "
                             "alike); >0 also times every sample run whole")
    parser.add_argument("--trained", type=int, default=0,
                        help="trained tokens at the end of each sample (an RL rollout's sampled turns); 0: all")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    record.add_no_save(parser)
    args = parser.parse_args()
    if args.worker:
        from atelier.train.ranks import exit_rank

        worker(json.loads(Path(args.worker).read_text()))
        exit_rank(0)
    threads = args.threads or os.cpu_count() or 1
    checkpointing = {"off": (False,), "on": (True,), "both": (False, True)}[args.activation_checkpointing]
    if args.shared_prefix + args.group_shared >= args.seq_len:
        parser.error("--shared-prefix plus --group-shared must leave each sample a token of its own")
    stamp = record.stamp()
    results = run_configurations(args, threads, checkpointing)
    print(json.dumps(record.finish("train", {
                      "benchmark": "train", **stamp, "model": args.model or "SmolLM2-135M shapes, random weights",
                      "seq_len": args.seq_len, "batch": args.batch, "micro_batch": args.micro_batch,
                      "shared_prefix": args.shared_prefix, "group_size": args.group_size,
                      "group_shared": args.group_shared, "trained": args.trained,
                      "total_threads": threads, "results": results,
                      "ratios": ratios(results, args, checkpointing)}, not args.no_save)))


def run_configurations(args, threads: int, checkpointing: tuple[bool, ...]) -> list[dict]:
    """Every configuration the arguments name, each as its own ranks; their results."""
    from atelier.train.launch import launch

    results = []
    with tempfile.TemporaryDirectory(prefix="atelier-bench-train-") as tmp:
        model = args.model or str(build_model(Path(tmp) / "model"))
        prefixes = ("whole", "shared", "kept") if args.shared_prefix or args.group_shared else ("shared",)
        for world, precision, prefix, ckpt in ((w, p, m, c) for w in args.ranks for p in args.precisions
                                               for m in prefixes for c in checkpointing):
            if ckpt and prefix == "kept":   # the trainer keeps a checkpointed prefix anyway
                continue
            name = f"{world}-{precision}-{prefix}-{'ckpt' if ckpt else 'full'}"
            spec = {"model": model, "seq_len": args.seq_len, "batch": args.batch,
                    "micro_batch": args.micro_batch, "precision": precision, "device": args.device,
                    "threads": max(1, threads // world), "steps": args.steps, "warmup": args.warmup,
                    "activation_checkpointing": ckpt,
                    "logprob_chunk": args.logprob_chunk, "prefix": prefix,
                    "shared_prefix": args.shared_prefix, "group_size": args.group_size,
                    "group_shared": args.group_shared, "trained": args.trained,
                    "out": str(Path(tmp) / f"r{name}.json")}
            path = Path(tmp) / f"spec-{name}.json"
            path.write_text(json.dumps(spec))
            launch([__file__, "--worker", str(path)], world, env={"OMP_NUM_THREADS": str(spec["threads"])},
                   what="benchmark")
            results.append(json.loads(Path(spec["out"]).read_text()))
    return results


def ratios(results: list[dict], args, checkpointing: tuple[bool, ...]) -> dict[str, float]:
    """Each comparison the results allow: prefix sharing, bf16 against fp32, N ranks against 1,
    per-layer checkpointing against none."""
    by = {(r["ranks"], r["precision"], r["activation_checkpointing"]): r for r in results if r["prefix"] == "shared"}
    out = {}
    for other in (r for r in results if r["prefix"] != "shared"):   # the same samples, run whole or prefix kept
        shared = by[(other["ranks"], other["precision"], other["activation_checkpointing"])]
        where = (f"{other['ranks']}_ranks_{other['precision']}"
                 + ("_checkpointed" if other["activation_checkpointing"] else ""))
        if other["prefix"] == "whole":
            out[f"shared_prefix_speedup_{where}"] = round(other["step_s"] / shared["step_s"], 2)
        else:
            out[f"prefix_recompute_step_time_{where}"] = round(shared["step_s"] / other["step_s"], 2)
            out[f"prefix_recompute_peak_rss_{where}"] = round(
                shared["peak_rss_gb_max_rank"] / other["peak_rss_gb_max_rank"], 2)
    ckpt = checkpointing[0]   # the comparisons below, without checkpointing when both were run
    for world in args.ranks:
        if (world, "fp32", ckpt) in by and (world, "bf16", ckpt) in by:
            out[f"bf16_over_fp32_tokens_per_s_{world}_ranks"] = round(
                by[(world, "bf16", ckpt)]["tokens_per_s"] / by[(world, "fp32", ckpt)]["tokens_per_s"], 2)
    for precision in args.precisions:
        if len(args.ranks) > 1 and all((w, precision, ckpt) in by for w in args.ranks):
            lo, hi = min(args.ranks), max(args.ranks)
            out[f"{hi}_over_{lo}_ranks_tokens_per_s_{precision}"] = round(
                by[(hi, precision, ckpt)]["tokens_per_s"] / by[(lo, precision, ckpt)]["tokens_per_s"], 2)
    for (world, precision, on), checkpointed in by.items():   # per-layer checkpointing against none
        if on and (world, precision, False) in by:
            full, where = by[(world, precision, False)], f"{world}_ranks_{precision}"
            out[f"checkpointing_step_time_{where}"] = round(checkpointed["step_s"] / full["step_s"], 2)
            out[f"checkpointing_peak_rss_{where}"] = round(
                checkpointed["peak_rss_gb_max_rank"] / full["peak_rss_gb_max_rank"], 2)
    return out


if __name__ == "__main__":
    main()
