"""GPU check of the low-precision MoE kernels: compiled, against the reference, and timed.

    python benchmarks/moe_kernels.py                 # on a machine with a CUDA GPU
    python benchmarks/moe_kernels.py --interpret     # the same checks, tiny shapes, Triton's interpreter on CPU

`benchmarks/gpu_check.py` runs it too when a GPU is present (its
"moe_kernels" entry).

1. The Triton quantisers (NVFP4 variant, MXFP8) equal the PyTorch reference
   bit for bit on random and adversarial rows (the reference runs on the CPU).
2. The fused quantise + grouped GEMMs (forward NVFP4, dgrad and wgrad MXFP8)
   agree with the reference within |C - C_ref| <= 1e-5 * (|A'| @ |B'|) (the
   bound tests/kernels states).
3. Timing (GPU only): TFLOP/s of each low-precision grouped GEMM against the
   bf16 grouped GEMM (one torch matmul per expert) on the same shapes. The
   kernels emulate block scaling with float16 tensor-core products of exactly
   representable values, so on a GPU without FP4/MXFP8 tensor cores they are
   expected to be slower than bf16: the check proves numerics first.

Prints one JSON object; exits 1 if a numerical check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import record  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interpret", action="store_true", help="CPU and Triton's interpreter, tiny shapes")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192, help="(token, expert) pairs over all experts")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=1536, help="output features of the timed GEMM")
    p.add_argument("--repeats", type=int, default=10)
    record.add_no_save(p)
    return p.parse_args(argv)


def adversarial_rows(torch, R: int, K: int):
    x = torch.randn(R, K) * torch.exp2(torch.randint(-20, 20, (R, 1)).float())
    x[0] = 0.0
    x[1] = 1e-40
    x[2, 0] = 3e38
    x[3, 5] = float("nan")
    x[4, 17] = float("inf")
    x[5] = x[5].bfloat16().float()
    return x


def check_quantisers(torch, device) -> dict:
    from atelier.kernels.quant import mxfp8_quantize, nvfp4_quantize
    from atelier.kernels.triton_ops import mxfp8_quantize_triton, nvfp4_quantize_triton

    x = torch.cat([adversarial_rows(torch, 16, 256), torch.randn(240, 256).bfloat16().float()])
    ref_n, got_n = nvfp4_quantize(x), nvfp4_quantize_triton(x.to(device))
    ref_m, got_m = mxfp8_quantize(x), mxfp8_quantize_triton(x.to(device))
    same = lambda a, b: bool(torch.equal(a.cpu(), b))  # noqa: E731
    st_got, st_ref = got_n.token_scales_R.cpu(), ref_n.token_scales_R
    return {
        "nvfp4_codes_equal": same(got_n.packed_RH, ref_n.packed_RH),
        "nvfp4_block_scales_equal": same(got_n.block_scales_RB, ref_n.block_scales_RB),
        "nvfp4_token_scales_equal": bool(torch.equal(torch.nan_to_num(st_got, nan=-1.0),
                                                     torch.nan_to_num(st_ref, nan=-1.0))),
        "mxfp8_codes_equal": same(got_m.codes_RK, ref_m.codes_RK),
        "mxfp8_scales_equal": same(got_m.scales_RB, ref_m.scales_RB),
    }


def check_gemms(torch, device, E: int, M: int, K: int, N: int) -> dict:
    from atelier.kernels.grouped import grouped_mm_reference, grouped_wgrad_reference
    from atelier.kernels.quant import fake_quant
    from atelier.kernels.triton_ops import grouped_mm_triton, grouped_wgrad_triton

    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randint(0, M + 1, (E - 1,), generator=g)).values
    off = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([M])])
    x, w, dy = torch.randn(M, K, generator=g), torch.randn(E, N, K, generator=g) / 16, torch.randn(M, N, generator=g)
    out = {}
    cases = {"forward_nvfp4": (x, w.transpose(1, 2), "nvfp4"), "dgrad_mxfp8": (dy, w, "mxfp8")}
    for name, (a, b, fmt) in cases.items():
        got = grouped_mm_triton(a.to(device), b.to(device), off.to(device), fmt).cpu()
        ref = grouped_mm_reference(a, b, off, fmt)
        bound = torch.zeros_like(ref)
        aq = fake_quant(a, fmt).abs()
        for e in range(E):
            s, t = int(off[e]), int(off[e + 1])
            bound[s:t] = aq[s:t] @ fake_quant(b[e], fmt, dim=0).abs()
        out[name] = bool(((got - ref).abs() <= 1e-5 * bound + 1e-30).all())
    got = grouped_wgrad_triton(dy.to(device), x.to(device), off.to(device)).cpu()
    ref = grouped_wgrad_reference(dy, x, off, "mxfp8")
    bound = grouped_wgrad_reference(dy.abs(), x.abs(), off, "mxfp8")
    out["wgrad_mxfp8"] = bool(((got - ref).abs() <= 1e-5 * bound + 1e-30).all())
    return out


def timed(torch, fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def benchmark(torch, args) -> dict:
    from atelier.kernels.triton_ops import grouped_mm_triton, grouped_wgrad_triton

    E, M, K, N = args.experts, args.tokens, args.hidden, args.inter
    off = torch.linspace(0, M, E + 1).long().cuda()
    x = torch.randn(M, K, device="cuda")
    w = torch.randn(E, N, K, device="cuda") / 16
    dy = torch.randn(M, N, device="cuda")
    xb, wb, dyb = x.bfloat16(), w.bfloat16(), dy.bfloat16()
    bounds = off.tolist()

    def bf16_fwd():
        return [xb[bounds[e]:bounds[e + 1]] @ wb[e].t() for e in range(E)]

    flops = 2.0 * M * N * K
    rows = {
        "bf16_grouped_fwd": timed(torch, bf16_fwd, args.repeats),
        "nvfp4_fwd": timed(torch, lambda: grouped_mm_triton(x, w.transpose(1, 2), off, "nvfp4"), args.repeats),
        "mxfp8_fwd": timed(torch, lambda: grouped_mm_triton(x, w.transpose(1, 2), off, "mxfp8"), args.repeats),
        "mxfp8_dgrad": timed(torch, lambda: grouped_mm_triton(dy, w, off, "mxfp8"), args.repeats),
        "mxfp8_wgrad": timed(torch, lambda: grouped_wgrad_triton(dy, x, off), args.repeats),
        "bf16_grouped_dgrad": timed(torch, lambda: [dyb[bounds[e]:bounds[e + 1]] @ wb[e] for e in range(E)],
                                    args.repeats),
    }
    return {name: {"ms": t * 1e3, "tflops": flops / t / 1e12} for name, t in rows.items()}


def run(argv=None) -> dict:
    """The checks (and, on a GPU, the timings) as one dict with "ok"."""
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import torch

    if not args.interpret and not torch.cuda.is_available():
        return {"ok": False, "error": "no CUDA device; run with --interpret for the CPU check"}
    device = "cpu" if args.interpret else "cuda"
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"}
    report["quantisers"] = check_quantisers(torch, device)
    shape = (4, 100, 64, 64) if args.interpret else (args.experts, 1000, 256, 192)
    report["gemms"] = check_gemms(torch, device, *shape)
    ok = all(report["quantisers"].values()) and all(report["gemms"].values())
    if device == "cuda":
        report["timing"] = benchmark(torch, args)
    report["ok"] = ok
    return report


def main(argv=None) -> int:
    stamp = record.stamp()
    report = {"benchmark": "moe_kernels", **stamp, **run(argv)}
    print(json.dumps(record.finish("moe_kernels", report, not parse_args(argv).no_save), indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
