"""MoE precision: the tiny MoE trained in bf16, MXFP8 and the NVFP4-forward/MXFP8-backward recipe.

    python experiments/moe_precision/run.py --out runs/moe-precision [--steps 200] [--smoke]

One tiny Mixtral (atelier.inference.tiny, "tiny-moe" shape, wider) is
initialised once; every arm starts from those weights, sees the same batches
of Python source in the same order and uses the same optimizer. Only the two
expert matmuls of every MoE layer differ (atelier.moe.precision with the
reference kernels; everything else is float32):

- bf16_operands: operands rounded to bfloat16, float32 accumulation (the baseline);
- mxfp8: forward and both backward GEMMs in MXFP8;
- nvfp4_fwd_mxfp8_bwd: the report's recipe (NVFP4 variant with a per-token FP32 scale);
- nvfp4_tensor_fwd_mxfp8_bwd: the same with one FP32 scale per tensor;
- nvfp4_fwd_mxfp8_bwd_reciprocal: the report's recipe with x * (1/d) in place of x / d.

Besides the loss curves it measures (results.json, moe_precision.png):

- batch invariance: the logits of one sequence run alone and inside a batch
  of others, per recipe (max |difference|);
- the division finding: on the activations that reach the expert GEMMs of
  the trained baseline, how many NVFP4 codes x * (1/d) changes against x / d,
  as float32 and rounded to bfloat16 (what a bf16 model feeds the kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

ARMS = ["bf16_operands", "mxfp8", "nvfp4_fwd_mxfp8_bwd", "nvfp4_tensor_fwd_mxfp8_bwd",
        "nvfp4_fwd_mxfp8_bwd_reciprocal"]
TRAIN_MODULES = ["json", "email", "http", "urllib", "logging", "concurrent", "xml", "html", "wsgiref"]
HELDOUT_MODULES = ["tomllib", "zoneinfo", "xmlrpc"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--expert", type=int, default=64, help="expert intermediate size (a multiple of 32)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--smoke", action="store_true", help="a few steps of every arm (tests)")
    return p.parse_args(argv)


def corpus_tokens(tokenizer, modules: list[str]) -> torch.Tensor:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in modules:
        target = root / name
        files = sorted(target.rglob("*.py")) if target.is_dir() else [root / f"{name}.py"]
        for f in files:
            if f.is_file():
                ids.extend(tokenizer.encode(f.read_text(encoding="utf-8", errors="replace")))
    return torch.tensor(ids, dtype=torch.long)


def batches(tokens: torch.Tensor, seq_len: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    rows = tokens[: (len(tokens) // seq_len) * seq_len].view(-1, seq_len)
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(rows), generator=g) for _ in range(steps * batch // len(rows) + 1)])
    return [rows[order[i * batch:(i + 1) * batch]] for i in range(steps)]


def build_model(args, vocab: int):
    from transformers import AutoModelForCausalLM

    from atelier.inference.tiny import tiny_moe_config

    torch.manual_seed(args.seed)
    config = tiny_moe_config(vocab, hidden_size=args.hidden, intermediate_size=args.expert,
                             num_local_experts=args.experts, num_hidden_layers=args.layers)
    return AutoModelForCausalLM.from_config(config)


def eval_loss(model, heldout: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float(model(input_ids=b, labels=b).loss) for b in heldout) / len(heldout)


def train_arm(arm: str, init_state, args, vocab: int, data, heldout) -> dict[str, Any]:
    from atelier.moe.precision import apply_moe_precision

    model = build_model(args, vocab)
    model.load_state_dict(init_state)
    apply_moe_precision(model, arm, backend="reference")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, evals = [], []
    start = time.perf_counter()
    for step, batch in enumerate(data, 1):
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % args.eval_every == 0 or step == len(data):
            evals.append({"step": step, "loss": eval_loss(model, heldout)})
        if not torch.isfinite(loss):
            break
    seconds = time.perf_counter() - start
    print(f"{arm}: final train {sum(losses[-10:]) / len(losses[-10:]):.4f} eval {evals[-1]['loss']:.4f} "
          f"({seconds:.0f} s)", flush=True)
    return {"train_loss": losses, "eval": evals, "seconds": seconds, "model": model}


def batch_invariance(init_state, args, vocab: int, batch: torch.Tensor) -> dict[str, float]:
    from atelier.moe.precision import apply_moe_precision

    out = {}
    for arm in ARMS:
        model = build_model(args, vocab)
        model.load_state_dict(init_state)
        apply_moe_precision(model, arm, backend="reference")
        model.eval()
        with torch.no_grad():
            alone = model(input_ids=batch[:1]).logits[0]
            together = model(input_ids=batch).logits[0]
        out[arm] = float((alone - together).abs().max())
    return out


def expert_inputs(model, batch: torch.Tensor) -> list[torch.Tensor]:
    """The activations the expert GEMMs quantise: each layer's MoE input rows and the gated
    intermediate (captured with hooks on the experts modules and their down projection input)."""
    from atelier.moe.precision import experts_modules

    captured: list[torch.Tensor] = []
    hooks = []
    for m in experts_modules(model):
        hooks.append(m.register_forward_hook(lambda mod, args, out: captured.append(args[0].detach())))
        gate = m._apply_gate

        def wrapped(h, _gate=gate):
            out = _gate(h)
            captured.append(out.detach())
            return out
        m._apply_gate = wrapped
    with torch.no_grad():
        model(input_ids=batch)
    for h in hooks:
        h.remove()
    for m in experts_modules(model):
        del m._apply_gate
    return captured


def division_counts(acts: list[torch.Tensor]) -> dict[str, Any]:
    from atelier.kernels.quant import nvfp4_quantize

    out: dict[str, Any] = {}
    for label, cast in (("float32", lambda t: t.float()), ("bfloat16", lambda t: t.bfloat16().float())):
        total = differ = scales = 0
        for a in acts:
            x = cast(a.reshape(-1, a.shape[-1]))
            e, r = nvfp4_quantize(x), nvfp4_quantize(x, division="reciprocal")
            total += e.codes().numel()
            differ += int((e.codes() != r.codes()).sum())
            scales += int((e.block_scales_RB != r.block_scales_RB).sum())
        out[label] = {"values": total, "codes_differ": differ, "block_scales_differ": scales,
                      "fraction": differ / total if total else 0.0}
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, r in results["arms"].items():
        loss = torch.tensor(r["train_loss"])
        k = max(1, len(loss) // 20)
        smooth = torch.nn.functional.avg_pool1d(loss[None, None], k, stride=1)[0, 0] if len(loss) >= k else loss
        ax.plot(range(k, k + len(smooth)), smooth.tolist(), label=arm)
        bx.plot([e["step"] for e in r["eval"]], [e["loss"] for e in r["eval"]], marker="o", label=arm)
    ax.set(title="training loss (moving average)", xlabel="step", ylabel="cross-entropy")
    bx.set(title="held-out loss", xlabel="step", ylabel="cross-entropy")
    ax.legend(fontsize=8)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.smoke:
        args.steps, args.eval_every, args.seq_len = 3, 3, 64
    torch.set_num_threads(args.threads)
    from atelier.inference.tiny import build_tiny_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    vocab = len(tokenizer)
    train_tokens = corpus_tokens(tokenizer, TRAIN_MODULES[:2] if args.smoke else TRAIN_MODULES)
    held_tokens = corpus_tokens(tokenizer, HELDOUT_MODULES)
    data = batches(train_tokens, args.seq_len, args.batch, args.steps, args.seed)
    heldout = batches(held_tokens, args.seq_len, args.batch, 1 if args.smoke else 4, args.seed + 1)
    init_state = {k: v.clone() for k, v in build_model(args, vocab).state_dict().items()}
    results: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                               "train_tokens": len(train_tokens), "heldout_tokens": len(held_tokens),
                               "arms": {}}
    models = {}
    for arm in args.arms.split(","):
        r = train_arm(arm, init_state, args, vocab, data, heldout)
        models[arm] = r.pop("model")
        results["arms"][arm] = r
    base = results["arms"].get("bf16_operands")
    for arm, r in results["arms"].items():
        r["final_train"] = sum(r["train_loss"][-10:]) / len(r["train_loss"][-10:])
        r["final_eval"] = r["eval"][-1]["loss"]
        if base:
            r["gap_to_bf16_eval"] = r["final_eval"] - base["eval"][-1]["loss"]
    probe = heldout[0]
    results["batch_invariance_max_abs_logit_diff"] = batch_invariance(init_state, args, vocab, probe)
    if "bf16_operands" in models:
        results["division"] = division_counts(expert_inputs(models["bf16_operands"], probe))
        exact, recip = results["arms"].get("nvfp4_fwd_mxfp8_bwd"), results["arms"].get(
            "nvfp4_fwd_mxfp8_bwd_reciprocal")
        if exact and recip:
            diffs = [abs(a - b) for a, b in zip(exact["train_loss"], recip["train_loss"])]
            results["division"]["train_loss_max_abs_diff"] = max(diffs)
            results["division"]["first_step_losses_differ"] = next(
                (i + 1 for i, d in enumerate(diffs) if d > 0), None)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out / "moe_precision.png")
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    main()
