"""Training throughput of SmolLM2-135M and its model FLOPs utilisation (MFU).

Prints one JSON object: training tokens/s (forward, backward and AdamW step
of the atelier.pretrain loss) at sequence lengths 512 and 2048, and MFU
against this machine's matrix-multiply rate, measured in the same run with
square torch matmuls of the dtype training uses.

The model is the pulled SmolLM2-135M (`--model`); when it is absent, a
randomly initialised model of the same architecture is built from its config
(speed depends on the shapes, not on the weights). Model FLOPs per token
follow the PaLM convention: 6 * parameters + 12 * layers * hidden * seq_len
(attention scores and values, forward and backward).

On a CPU shared with other work, wall-clock rates fall with the load; the
`*_cpu_s` figures and `mfu_cpu_time` divide by this process's CPU time (all
its threads) for both the matmul and the training step, so they say how well
the CPU time we did get was used, whatever the load.

    python benchmarks/pretrain.py [--model smollm2-135m] [--steps 2] [--threads N]
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

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                    max_position_embeddings=8192, rope_theta=100000.0)


def load_model(spec: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    try:
        from atelier.pretrain.modeling import resolve_model_path

        path = resolve_model_path(spec)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        source = str(path)
    except Exception as exc:  # absent weights: the architecture is what matters for speed
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M))
        source = f"config-built ({type(exc).__name__})"
    return model.to(device), source


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def matmul_gflops(device: str, dtype, n: int = 2048, repeats: int = 8) -> tuple[float, float]:
    """Best-of-`repeats` rate of an n x n x n matmul: GFLOP per wall second and per CPU second."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    flop = 2 * n**3
    return flop / best / 1e9, flop / max(best_cpu, 1e-9) / 1e9


def train_rate(model, seq_len: int, steps: int, warmup: int, device: str, batch: int) -> dict:
    import torch

    from atelier.pretrain.batches import masked_lm_loss
    from atelier.pretrain.modeling import autocast

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen).to(device)
    mask = torch.ones_like(ids)
    times, cpu_times = [], []
    model.train()
    for i in range(warmup + steps):
        sync(device)
        start, cpu = time.perf_counter(), time.process_time()
        with autocast(device, "auto"):
            logits = model(input_ids=ids).logits
        nll, count = masked_lm_loss(logits, ids, mask)
        (nll / count).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu)
    step_s, cpu_s = statistics.median(times), statistics.median(cpu_times)
    return {"seq_len": seq_len, "batch": batch, "step_s": round(step_s, 3), "step_cpu_s": round(cpu_s, 3),
            "tokens_per_s": round(batch * seq_len / step_s, 1),
            "tokens_per_cpu_s": round(batch * seq_len / cpu_s, 2), "steps_timed": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per length (median reported)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    record.add_no_save(parser)
    args = parser.parse_args()
    stamp = record.stamp()

    import torch
    from transformers.utils import logging as hf_logging

    from atelier.train.devices import pick_device

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = str(pick_device(args.device))
    bf16 = device == "cuda" and torch.cuda.is_bf16_supported()
    peak, peak_cpu = matmul_gflops(device, torch.bfloat16 if bf16 else torch.float32)
    model, source = load_model(args.model, device)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    results = []
    for seq_len in args.seq_lens:
        row = train_rate(model, seq_len, args.steps, args.warmup, device, args.batch)
        flops_per_token = 6 * params + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
        achieved = row["tokens_per_s"] * flops_per_token / 1e9
        achieved_cpu = row["tokens_per_cpu_s"] * flops_per_token / 1e9
        row.update(model_gflop_per_token=round(flops_per_token / 1e9, 3), achieved_gflops=round(achieved, 2),
                   mfu=round(achieved / peak, 4), mfu_cpu_time=round(achieved_cpu / peak_cpu, 4))
        results.append(row)
    print(json.dumps(record.finish("pretrain", {
        "benchmark": "pretrain", **stamp, "model": args.model, "weights": source, "params": params,
        "device": device, "precision": "bf16 autocast" if bf16 else "fp32", "threads": torch.get_num_threads(),
        "matmul_gflops": round(peak, 2), "matmul_gflops_per_cpu_s": round(peak_cpu, 2), "results": results,
    }, not args.no_save)))


if __name__ == "__main__":
    main()
