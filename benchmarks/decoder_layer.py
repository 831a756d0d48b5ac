"""One decoder layer's forward plus backward, fp32 vs bf16, eager vs compiled; prints one JSON object.

transformers' Llama decoder layer on SmolLM2-135M's shapes (SDPA attention,
rotary embeddings given), T tokens of one sequence, one thread. Every figure
is CPU-seconds of this process (`time.process_time`), best of `--repeats`
after two warm-up calls, the configurations alternated, so the ratios hold on
a machine loaded by other work. Also timed alone, in each dtype: the layer's
seven projections (forward and backward) and its attention (SDPA, the CPU
flash kernel). From those, `bf16_layer_bound` is the layer's bf16 speed-up if
everything but the projections and the attention cost nothing in bf16 (what
fusing the norms, rotary, SiLU, residuals and casts could at most buy).

`--compile` adds `torch.compile` (inductor) of the whole layer in each dtype:
its warm-up wall seconds are the compile time, and the compiled outputs and
input gradients are compared with eager's (relative error of the norm).

    python benchmarks/decoder_layer.py [--seq-len 2048] [--compile] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import record  # noqa: E402
from pretrain import SMOLLM2_135M  # noqa: E402


def projections_step(shapes, T: int, dt):
    """A forward and backward of the layer's seven projections alone, on T tokens."""
    import torch

    lins = [torch.nn.Linear(i, o, bias=False).to(dt) for i, o in shapes]
    xs = [torch.randn(T, i, dtype=dt) for i, _ in shapes]

    def step():
        for lin, x in zip(lins, xs):
            lin(x.requires_grad_()).float().sum().backward()
            lin.zero_grad(set_to_none=True)
            x.grad = None
    return step


def attention_step(heads: int, kv: int, T: int, d: int, dt):
    """A forward and backward of causal grouped-query attention alone, on T tokens."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, heads, T, d, dtype=dt)
    k, v = (torch.randn(1, kv, T, d, dtype=dt) for _ in range(2))

    def step():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True).float().sum().backward()
    return step


def time_steps(steps: dict, repeats: int) -> tuple[dict, dict, dict]:
    """Each step's best CPU time over `repeats` rounds (after two warm-up calls), its warm-up wall
    time and its first output."""
    warm_s, outputs = {}, {}
    for key, step in steps.items():
        start = time.perf_counter()
        outputs[key] = step()
        step()
        warm_s[key] = round(time.perf_counter() - start, 1)
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for key, step in steps.items():   # fp32 and bf16 alternate inside every round
            start = time.process_time()
            step()
            best[key] = min(best[key], time.process_time() - start)
    return best, warm_s, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    record.add_no_save(parser)
    args = parser.parse_args()
    stamp = record.stamp()

    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2_135M)
    cfg._attn_implementation = "sdpa"
    T, H = args.seq_len, cfg.hidden_size
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, H // cfg.num_attention_heads
    base = LlamaDecoderLayer(cfg, layer_idx=0)
    x_BTH = torch.randn(1, T, H)
    cos, sin = LlamaRotaryEmbedding(cfg)(x_BTH, torch.arange(T)[None])
    shapes = [(H, heads * d), (H, kv * d), (H, kv * d), (heads * d, H),
              (H, cfg.intermediate_size), (H, cfg.intermediate_size), (cfg.intermediate_size, H)]

    def layer_step(layer, fn, dt):
        def step():
            x = x_BTH.to(dt).detach().clone().requires_grad_()
            out = fn(x, position_embeddings=(cos.to(dt), sin.to(dt)))
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().mean().backward()
            layer.zero_grad(set_to_none=True)
            return out.detach().float(), x.grad.float()
        return step

    steps = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        layer = LlamaDecoderLayer(cfg, layer_idx=0).to(dt)
        layer.load_state_dict(base.state_dict())
        steps[f"layer_{name}"] = layer_step(layer, layer, dt)
        if args.compile:
            steps[f"layer_{name}_compiled"] = layer_step(layer, torch.compile(layer), dt)
        steps[f"projections_{name}"] = projections_step(shapes, T, dt)
        steps[f"attention_{name}"] = attention_step(heads, kv, T, d, dt)
    best, warm_s, outputs = time_steps(steps, args.repeats)

    def ratio(a: str, b: str) -> float:
        return round(best[a] / best[b], 2)

    result = {"benchmark": "decoder_layer", **stamp, "seq_len": T, "threads": 1,
              "cpu_s": {k: round(v, 4) for k, v in best.items()},
              "bf16_speedup": {part: ratio(f"{part}_fp32", f"{part}_bf16")
                               for part in ("layer", "projections", "attention")},
              "bf16_layer_bound": round(best["layer_fp32"] / (best["projections_bf16"] + best["attention_bf16"]), 2),
              "rest_of_layer_cpu_s": {name: round(best[f"layer_{name}"] - best[f"projections_{name}"]
                                                  - best[f"attention_{name}"], 4) for name in ("fp32", "bf16")}}
    if args.compile:
        def rel(a, b):
            return float((a - b).norm() / b.norm())

        result["compiled_speedup"] = {name: ratio(f"layer_{name}", f"layer_{name}_compiled")
                                      for name in ("fp32", "bf16")}
        result["bf16_compiled_over_fp32_eager"] = ratio("layer_fp32", "layer_bf16_compiled")
        result["compile_warmup_wall_s"] = {name: warm_s[f"layer_{name}_compiled"] for name in ("fp32", "bf16")}
        result["compiled_vs_eager_rel_err"] = {
            name: {"output": rel(outputs[f"layer_{name}_compiled"][0], outputs[f"layer_{name}"][0]),
                   "input_grad": rel(outputs[f"layer_{name}_compiled"][1], outputs[f"layer_{name}"][1])}
            for name in ("fp32", "bf16")}
    print(json.dumps(record.finish("decoder_layer", result, not args.no_save)))


if __name__ == "__main__":
    main()
