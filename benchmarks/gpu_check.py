"""One-shot device check: a few RL steps of a small model on whatever GPU is present; one JSON object.

    python benchmarks/gpu_check.py [--steps 4] [--ranks N] [--engine auto|builtin|vllm] [--out DIR]
                                   [--demo-model MODEL_DIR]

What it runs is `atelier train` itself (`run_training`, or the local rank
launcher when --ranks > 1): the toy environment in sync mode, a model with
SmolLM2-135M's shapes (30 layers, hidden 576; random weights and the tiny
byte-level tokenizer, so nothing is downloaded), the trainer on CUDA with
FSDP2 across `--ranks` GPUs (default: all of them), bf16 compute with fp32
master weights, and rollouts from vLLM when its environment is installed
(`--engine auto`; see the README's vLLM section), else the built-in engine.

It prints one JSON object: the device, the engine, trainer tokens/s and step
time (median over the steps after the first), MFU against the bf16 matmul
rate measured in the same run (6 * parameters per trained token: prompt
tokens and the checkpointed recomputation count as overhead), peak GPU
memory per rank, and checks that say
the path is sound (finite losses, weights that moved, importance weights
near 1: the trainer and the sampler agree on the logprobs).

With `--demo-model` and a GPU it then runs the main job's GPU recipe
(`atelier run recipes/demo-gpu.toml` with that model directory) and adds its
summary (the three evaluations' pass rates, the headline test, wall time,
peak memory) under "demo_gpu"; the job failing fails the check.

Without a GPU it says so in the JSON ("gpu": null, and a "note"), runs the
same path on the CPU with the tiny model in fp32 (a smoke test of this script,
not a measurement) and exits 0. Exit status 1 means a check failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import record  # noqa: E402

SMALL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=2048)


def matmul_tflops(device: str, n: int = 8192, repeats: int = 10) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def vllm_available() -> bool:
    try:
        from atelier.inference.vllm_server import VLLMConfig, find_vllm_python

        find_vllm_python(VLLMConfig())
        return True
    except Exception:   # not installed, or this atelier predates the vLLM backend
        return False


def overrides(gpu: bool, steps: int, ranks: int, engine: str, model_dir: Path) -> list[str]:
    sets = [f"model={model_dir}", f"trainer.steps={steps}", "rollout.mode=sync", "rollout.group_size=8",
            "rollout.groups_per_step=4", "rollout.max_tokens=64", "rollout.workers=16",
            f"trainer.ranks={ranks}", "trainer.norm_tokens=1024", "trainer.lr=1e-5", "trainer.checkpoint_every=1000",
            "sync.kind=inprocess" if ranks == 1 else "sync.kind=delta", "env.toy.tasks=64"]
    if gpu:
        sets += ["trainer.device=cuda", "trainer.precision=bf16", "trainer.micro_batch=32",
                 "trainer.logprob_chunk=512"]
    else:
        sets += ["trainer.device=cpu", "trainer.precision=fp32", "trainer.micro_batch=16", "trainer.threads=2"]
    if engine == "vllm":
        sets += ["inference.engine=vllm"]
    return sets


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=0, help="trainer ranks (default: every GPU; 1 on the CPU)")
    parser.add_argument("--engine", default="auto", choices=["auto", "builtin", "vllm"])
    parser.add_argument("--out", default=None, help="keep the run directory here (default: a temporary one)")
    parser.add_argument("--demo-model", help="also run recipes/demo-gpu.toml with this model directory (GPU only)")
    record.add_no_save(parser)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    stamp = record.stamp()

    import torch

    from atelier.config import load_config
    from atelier.inference.tiny import build_tiny_model
    from atelier.rl.config import TrainConfig

    gpu = torch.cuda.is_available()
    ranks = args.ranks or (torch.cuda.device_count() if gpu else 1)
    engine = args.engine
    if engine == "auto":
        engine = "vllm" if gpu and vllm_available() else "builtin"
    report: dict = {"check": "gpu", **stamp, "torch": torch.__version__, "gpu": None, "engine": engine, "ranks": ranks}
    if gpu:
        props = torch.cuda.get_device_properties(0)
        report.update(gpu=props.name, gpus=torch.cuda.device_count(),
                      gpu_memory_gb=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                      bf16_matmul_tflops=round(matmul_tflops("cuda"), 1))
    else:
        report["note"] = ("no GPU present: torch sees no CUDA device. Ran the same path on the CPU with the tiny "
                          "model in fp32 as a smoke test of this script; the figures are not a GPU measurement.")
    with tempfile.TemporaryDirectory(prefix="atelier-gpu-check-") as tmp:
        work = Path(args.out) if args.out else Path(tmp)
        model_dir = build_tiny_model(work / "model", **(SMALL if gpu else {}))
        run_dir = work / "run"
        config = load_config(TrainConfig, ROOT / "recipes" / "rl-tiny.toml",
                             overrides(gpu, args.steps, ranks, engine, model_dir))
        started = time.perf_counter()
        if ranks > 1:   # what `atelier train` does with trainer.ranks > 1: torchrun's agent starts the ranks
            from atelier.cli.rank import start_ranks

            start_ranks("train", config, run_dir, world=ranks)
        else:
            from atelier.rl.run import run_training

            run_training(config, run_dir)
        report["wall_s"] = round(time.perf_counter() - started, 1)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        params = _params(model_dir)
    timed = rows[1:] or rows
    step_s = statistics.median(r["train_seconds"] for r in timed)
    tokens_per_s = statistics.median(r["train_tokens_per_s"] for r in timed)
    flops_per_token = 6 * params   # per trained (sampled) token; prompts and recomputation are overhead
    report.update(params=params, steps=len(rows), train_step_s=round(step_s, 3),
                  train_tokens_per_s=round(tokens_per_s, 1),
                  gen_tokens_per_s=round(statistics.median(r["gen_tokens_per_s"] for r in rows), 1),
                  peak_memory_gb_per_rank=max(r.get("peak_memory_gb", 0.0) for r in rows))
    if gpu:
        achieved = tokens_per_s * flops_per_token / 1e12
        report["mfu"] = round(achieved / (report["bf16_matmul_tflops"] * ranks), 4)
    checks = {
        "losses_finite": all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in rows),
        "grad_norm_positive": all(r["grad_norm"] > 0 for r in rows),
        "every_step_ran": len(rows) == args.steps,
        "trainer_matches_sampler": all(abs(r["is_weight_mean"] - 1.0) < (0.1 if gpu else 0.01) for r in rows[:1]),
    }
    if args.demo_model:
        if gpu:
            report["demo_gpu"] = run_demo_gpu(args.demo_model, Path(args.out or tempfile.mkdtemp()) / "demo-gpu")
            checks["demo_gpu_ran"] = "error" not in report["demo_gpu"]
        else:
            report["demo_gpu"] = {"skipped": "no GPU present"}
    if gpu:   # the low-precision MoE kernels, compiled: bit-exact quantisers, GEMM bounds, TFLOP/s
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from moe_kernels import run as moe_kernels

        report["moe_kernels"] = moe_kernels([])
        checks["moe_kernels_match_reference"] = bool(report["moe_kernels"]["ok"])
    report["checks"] = checks
    report["ok"] = all(checks.values())
    print(json.dumps(record.finish("gpu_check", report, not args.no_save)))
    return 0 if report["ok"] else 1


def run_demo_gpu(model_dir: str, out: Path) -> dict:
    """`atelier run recipes/demo-gpu.toml` in a child process; the summary's main figures."""
    import subprocess

    cmd = [sys.executable, "-m", "atelier.cli", "run", str(ROOT / "recipes" / "demo-gpu.toml"),
           "--set", f"model.name={json.dumps(str(Path(model_dir).resolve()))}", "--run-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": f"exit status {done.returncode}", "stderr_tail": done.stderr[-2000:]}
    summary = json.loads((out / "summary.json").read_text())
    return {"pass_rate": {k: v["pass_rate"] for k, v in summary["evaluations"].items()},
            "headline": summary["headline"], "wall_s_total": summary["wall_s_total"],
            "peak_rss_mb_run": summary["peak_rss_mb_run"], "run_dir": str(out)}


def _params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                if k != "lm_head.weight":   # tied to the embeddings
                    total += _numel(st.get_slice(k).get_shape())
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


if __name__ == "__main__":
    sys.exit(main())
