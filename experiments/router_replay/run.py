"""Router replay: how far the trainer's logprobs are from the sampler's, with and without replay.

    python experiments/router_replay/run.py --out runs/router-replay [--smoke] [--part offline|rl|all]

Two parts. "rl": `atelier train`'s own loop (`run_training` on
recipes/rl-tiny-moe.toml: the toy task, the built-in engine recording routes,
the fp32 trainer) in six arms, replay off and on for each of three samplers:
fp32 sync, bf16 sync, bf16 async (staleness up to 1). Per step: reward,
mean and max |log pi - log mu|, k1 = mean(log mu - log pi), the fraction of
tokens whose importance weight is truncated, and the routing flip rate (token
x layer rows where the trainer's forward used other experts than the
sampler's; 0 by construction with replay). "offline" (below):

A tiny Mixtral (the "tiny-moe" shape) is first trained briefly on Python
source so that its routers have preferences (a random router is nearly
uniform and rarely flips). Then a *sampler* copy in bfloat16 generates
sequences token by token through its KV cache, recording the experts it
chose (atelier.moe.replay), and a *trainer* copy in float32 recomputes the
sampled tokens' logprobs in one forward, as the RL trainer does, with and
without replaying the sampler's routes. Two trainer weights:

- "same weights": the trainer holds the sampler's weights (fp32 copy): only
  numerics differ (bf16 sampler, fp32 trainer);
- "one step later": the trainer took one more Adam step (the async case
  with a staleness of one version).

Per case: routing flips (tokens x layers whose set of experts differs from
the sampler's), mean and max |log pi - log mu|, k1 = mean(log mu - log pi),
and the fraction of tokens whose importance weight pi/mu exceeds 2 (what
truncated importance sampling clips).

Writes results.json (a rerun of one part keeps the other's results) and,
with the RL part, router_replay.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--pretrain-steps", type=int, default=150)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-lr", type=float, default=1e-3, help="learning rate of the 'one step later' update")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--part", choices=("offline", "rl", "all"), default="all")
    p.add_argument("--rl-steps", type=int, default=30)
    return p.parse_args(argv)


RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "rl-tiny-moe.toml"
# arm -> (sampler dtype, rollout mode, replay)
ARMS = {f"{dt}-{mode}-{'replay' if rep else 'free'}": (dt, mode, rep)
        for dt, mode in (("float32", "sync"), ("bfloat16", "sync"), ("bfloat16", "async")) for rep in (False, True)}


def rl_arm(out: Path, dtype: str, mode: str, replay: bool, steps: int, seed: int) -> dict[str, Any]:
    """One `run_training` of the tiny-MoE toy recipe; per-step curves from its metrics.jsonl."""
    from atelier.config import load_config
    from atelier.rl.config import TrainConfig
    from atelier.rl.run import run_training

    config = load_config(TrainConfig, RECIPE, [
        f"trainer.steps={steps}", f"seed={seed}", f"rollout.dtype={dtype}", f"rollout.mode={mode}",
        f"trainer.router_replay={'true' if replay else 'false'}",
        "trainer.moe_precision=bf16"])   # the trainer's experts in its own fp32: only the sampler differs
    if not (out / "metrics.jsonl").exists():
        run_training(config, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = {k: [r.get(k) for r in rows] for k in
             ("reward_mean", "sampler_mismatch", "sampler_mismatch_max", "sampler_k1", "is_truncated_frac",
              "is_ratio_max", "routes_match_frac", "expert_imbalance", "staleness_max")}
    curve["routing_flip_frac"] = [1.0 - m for m in curve.pop("routes_match_frac")]
    last = max(1, min(5, len(rows)))
    tokens = [r["train_tokens"] for r in rows]
    wmean = lambda xs: sum(x * t for x, t in zip(xs, tokens)) / max(1.0, sum(tokens))  # noqa: E731
    summary = {"reward_first": curve["reward_mean"][0], "reward_final": sum(curve["reward_mean"][-last:]) / last,
               "mismatch_abs_mean": wmean(curve["sampler_mismatch"]),
               "mismatch_abs_max": max(curve["sampler_mismatch_max"]),
               "mismatch_k1": wmean(curve["sampler_k1"]),
               "is_truncated_frac": wmean(curve["is_truncated_frac"]),
               "is_ratio_max": max(curve["is_ratio_max"]),
               "routing_flip_frac": sum(curve["routing_flip_frac"]) / len(rows)}
    return {"sampler_dtype": dtype, "mode": mode, "replay": replay, "steps": len(rows), "curves": curve,
            "summary": summary}


def run_rl(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    arms = {}
    for name, (dtype, mode, replay) in ARMS.items():
        if args.smoke and mode == "async":
            continue
        arms[name] = rl_arm(out / "rl" / name, dtype, mode, replay, args.rl_steps, args.seed)
        print(name, json.dumps(arms[name]["summary"]), flush=True)
    return arms


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [("reward_mean", "reward (mean of 16 samples)"), ("sampler_mismatch", "mean |log pi - log mu|"),
              ("sampler_mismatch_max", "max |log pi - log mu|"), ("routing_flip_frac", "routing flips (token x layer)")]
    colors = {"float32-sync": "tab:blue", "bfloat16-sync": "tab:orange", "bfloat16-async": "tab:red"}
    for ax, (key, title) in zip(axes.flat, panels):
        for name, arm in results["rl"].items():
            ys = arm["curves"][key]
            base = name.rsplit("-", 1)[0]
            ax.plot(range(1, len(ys) + 1), ys, color=colors.get(base), linestyle="-" if arm["replay"] else "--",
                    label=f"{base}, {'replay' if arm['replay'] else 'no replay'}")
        ax.set(title=title, xlabel="RL step")
        if key != "reward_mean":
            ax.set_yscale("symlog", linthresh=1e-4)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("tiny-moe on the toy task: router replay on (solid) and off (dashed); trainer fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pretrain(model, tokens: torch.Tensor, steps: int, lr: float, seed: int) -> list[float]:
    rows = tokens[: (len(tokens) // 128) * 128].view(-1, 128)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        batch = rows[torch.randint(0, len(rows), (8,), generator=g)]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def sample(model, prompt: list[int], n_new: int, seed: int):
    """Token-by-token sampling through the KV cache; the routes of every fed token."""
    from atelier.moe.replay import RouterReplay

    g = torch.Generator().manual_seed(seed)
    replay = RouterReplay(model)
    ids, logps = list(prompt), []
    with torch.no_grad(), replay.record():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(n_new):
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=g))
            ids.append(tok)
            logps.append(float(logp[tok]))
            out = model(input_ids=torch.tensor([[tok]]), cache=out.past_key_values, use_cache=True)
    routes = replay.recorded()[:-1]
    replay.remove()
    return ids, torch.tensor(logps), torch.cat([routes, torch.full_like(routes[:1], -1)])


def recompute(trainer, replay, ids: list[int], routes, n_new: int, use_replay: bool):
    from contextlib import nullcontext

    ctx = replay.replay(routes) if use_replay else nullcontext()
    with torch.no_grad(), ctx:
        logits = trainer(input_ids=torch.tensor([ids])).logits[0].float()
        used = replay.used()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logp[-n_new:], used


def measure(trainer, sampled, n_new: int) -> dict[str, Any]:
    from atelier.moe.metrics import sampler_mismatch
    from atelier.moe.replay import RouterReplay

    replay = RouterReplay(trainer)
    out = {}
    for use in (False, True):
        pis, mus, flips, total = [], [], 0, 0
        for ids, mu, routes in sampled:
            pi, used = recompute(trainer, replay, ids, routes, n_new, use)
            pis.append(pi)
            mus.append(mu)
            differ = (used[:-1].sort(-1).values != routes[:-1].sort(-1).values).any(-1)
            flips += int(differ.sum())
            total += differ.numel()
        pi, mu = torch.cat(pis)[None], torch.cat(mus)[None]
        m = sampler_mismatch(pi, mu, torch.ones_like(pi), is_cap=2.0)
        m["routing_flip_frac"] = flips / total
        out["replay" if use else "no_replay"] = m
    replay.remove()
    return out


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    """The pretrained-router measurement (see the module docstring)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    from atelier.inference.tiny import build_tiny_tokenizer, tiny_moe_config

    # the same corpus as experiments/moe_precision
    spec = importlib.util.spec_from_file_location(
        "moe_precision_run", Path(__file__).resolve().parents[1] / "moe_precision" / "run.py")
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)
    TRAIN_MODULES, HELDOUT_MODULES, corpus_tokens = mp.TRAIN_MODULES, mp.HELDOUT_MODULES, mp.corpus_tokens

    tok = build_tiny_tokenizer()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(len(tok)))
    losses = pretrain(model, corpus_tokens(tok, TRAIN_MODULES[:3]), args.pretrain_steps, args.lr, args.seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sampler = AutoModelForCausalLM.from_config(tiny_moe_config(len(tok)), dtype=torch.bfloat16).eval()
    sampler.load_state_dict({k: v.bfloat16() for k, v in state.items()})
    prompts_src = corpus_tokens(tok, HELDOUT_MODULES)
    sampled = []
    for i in range(args.sequences):
        start = 997 * i % (len(prompts_src) - 64)
        sampled.append(sample(sampler, prompts_src[start:start + 32].tolist(), args.new_tokens, args.seed + i))
    trainer = AutoModelForCausalLM.from_config(tiny_moe_config(len(tok))).eval()
    # the sampler's weights, in fp32 (what the trainer holds when it published them as bf16)
    trainer.load_state_dict({k: v.bfloat16().float() for k, v in state.items()})
    results: dict[str, Any] = {"pretrain_loss_first_last": [losses[0], losses[-1]]}
    results["same_weights"] = measure(trainer, sampled, args.new_tokens)
    trainer.train()
    opt = torch.optim.Adam(trainer.parameters(), lr=args.step_lr)
    batch = corpus_tokens(tok, TRAIN_MODULES[3:4])[: 8 * 128].view(8, 128)
    trainer(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    trainer.eval()
    results["one_step_later"] = measure(trainer, sampled, args.new_tokens)
    return results


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.smoke:
        args.pretrain_steps, args.sequences, args.new_tokens, args.rl_steps = 3, 2, 8, 2
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    results: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    results["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    if args.part in ("offline", "all"):
        results.update(run_offline(args))
    if args.part in ("rl", "all"):
        results["rl"] = run_rl(out, args)
        plot(results, out / "router_replay.png")
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: results[k] for k in ("same_weights", "one_step_later") if k in results}, indent=1))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    main()
