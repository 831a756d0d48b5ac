"""Router replay: how far the trainer's logprobs are from the sampler's, with and without replay.

    python experiments/router_replay/run.py --out runs/router-replay [--smoke]

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
truncated importance sampling clips). Writes results.json.

Not measured here: reward curves of RL with replay on and off. The built-in
engine does not yet return the experts it chose, so `atelier train` cannot
replay them (trainer.router_replay needs Sample.routes).
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
    return p.parse_args(argv)


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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.smoke:
        args.pretrain_steps, args.sequences, args.new_tokens = 3, 2, 8
    torch.set_num_threads(args.threads)
    import importlib.util

    from transformers import AutoModelForCausalLM

    from atelier.inference.tiny import build_tiny_tokenizer, tiny_moe_config

    # the same corpus as experiments/moe_precision
    spec = importlib.util.spec_from_file_location(
        "moe_precision_run", Path(__file__).resolve().parents[1] / "moe_precision" / "run.py")
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)
    TRAIN_MODULES, HELDOUT_MODULES, corpus_tokens = mp.TRAIN_MODULES, mp.HELDOUT_MODULES, mp.corpus_tokens

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
    results: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "out"},
                               "pretrain_loss_first_last": [losses[0], losses[-1]]}
    results["same_weights"] = measure(trainer, sampled, args.new_tokens)
    trainer.train()
    opt = torch.optim.Adam(trainer.parameters(), lr=args.step_lr)
    batch = corpus_tokens(tok, TRAIN_MODULES[3:4])[: 8 * 128].view(8, 128)
    trainer(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    trainer.eval()
    results["one_step_later"] = measure(trainer, sampled, args.new_tokens)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: results[k] for k in ("same_weights", "one_step_later")}, indent=1))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    main()
