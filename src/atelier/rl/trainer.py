"""The trainer: full-parameter AdamW on a Hugging Face causal LM.

Legend: B = sequences in a micro-batch, T = tokens (padded), V = vocabulary.

`train_step(samples)` runs one optimizer step over all `samples` (micro-
batched, gradients accumulated): it recomputes every token's logprob under
the *current* weights (never reusing the sampler's — PITFALLS: setting old
logprobs equal to rollout logprobs made the correction a no-op), computes
the loss of `atelier.rl.loss` against the sampler's logprobs, and steps.
Logprobs are those of log_softmax(logits / temperature), the same quantity
the engine reports (see atelier.inference.sampling).

The policy version is the number of optimizer steps taken: the weights after
step k are version k. Staleness of a token trained at step k is
(k - 1) - version(token).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from atelier.rl.config import TrainerConfig
from atelier.rl.loss import LossInputs, policy_loss
from atelier.rl.sample import Sample


def token_logprobs(model, ids_BT: torch.Tensor, attn_BT: torch.Tensor, temperature: float,
                   want_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token_t | tokens_<t) for t >= 1 (position 0 gets 0), and per-token entropy."""
    logits_BTV = model(input_ids=ids_BT, attention_mask=attn_BT).logits.float() / temperature
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1], dim=-1)
    picked_BT = logp_BTV.gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
    zero_B1 = torch.zeros_like(picked_BT[:, :1])
    entropy = None
    if want_entropy:
        with torch.no_grad():
            ent_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
            entropy = torch.cat([zero_B1, ent_BT], dim=1)
    return torch.cat([zero_B1, picked_BT], dim=1), entropy


class Trainer:
    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, *, temperature: float = 1.0,
                 step: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg, self.temperature, self.step = cfg, temperature, step
        dtype = getattr(torch, cfg.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        self.model.train()
        self.ref = None
        if cfg.kl_beta > 0:
            self.ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            self.ref.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    def _collate(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        T = max(len(s.token_ids) for s in samples)
        B = len(samples)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, T))
        mu = torch.zeros((B, T))
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            ids[i, :n] = torch.tensor(s.token_ids)
            attn[i, :n] = 1
            mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            mu[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        mask[:, 0] = 0.0  # nothing predicts the first token
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        return {"ids": ids, "attn": attn, "mask": mask, "mu": mu, "adv": adv}

    def train_step(self, samples: list[Sample]) -> dict[str, Any]:
        """One optimizer step over `samples`; returns metrics. Advances `self.step` by one."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        totals: Counter[str] = Counter()
        staleness: Counter[int] = Counter()
        ratio_max, ratio_min = 0.0, float("inf")
        ent_sum = 0.0
        n_tokens = 0.0
        for i in range(0, len(samples), self.cfg.micro_batch):
            chunk = samples[i:i + self.cfg.micro_batch]
            batch = self._collate(chunk)
            logp_BT, ent_BT = token_logprobs(self.model, batch["ids"], batch["attn"], self.temperature, True)
            ref_BT = None
            if self.ref is not None:
                with torch.no_grad():
                    ref_BT, _ = token_logprobs(self.ref, batch["ids"], batch["attn"], self.temperature)
            loss, m = policy_loss(LossInputs(logp_BT, batch["mu"], batch["adv"], batch["mask"], ref_BT),
                                  is_cap=self.cfg.is_cap, kl_beta=self.cfg.kl_beta,
                                  norm_tokens=self.cfg.norm_tokens)
            loss.backward()
            tok = m["tokens"]
            n_tokens += tok
            totals["loss"] += m["loss"]
            for key in ("is_weight_mean", "is_truncated_frac", "kl_k1", "sampler_mismatch"):
                totals[key] += m[key] * tok
            ratio_max, ratio_min = max(ratio_max, m["is_ratio_max"]), min(ratio_min, m["is_ratio_min"])
            ent_sum += float((ent_BT * batch["mask"]).sum())
            for s in chunk:
                for v, mk in zip(s.versions[1:], s.loss_mask[1:]):
                    if mk:
                        staleness[self.step - v] += 1
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        self.optimizer.step()
        self.step += 1
        n = max(n_tokens, 1.0)
        seconds = time.perf_counter() - start
        return {
            "loss": totals["loss"], "grad_norm": grad_norm, "train_tokens": n_tokens,
            "train_seconds": seconds, "train_tokens_per_s": n_tokens / seconds if seconds else 0.0,
            "is_weight_mean": totals["is_weight_mean"] / n, "is_truncated_frac": totals["is_truncated_frac"] / n,
            "is_ratio_max": ratio_max, "is_ratio_min": ratio_min if n_tokens else 1.0,
            "kl_k1": totals["kl_k1"] / n, "sampler_mismatch": totals["sampler_mismatch"] / n,
            "entropy": ent_sum / n, "staleness_hist": {str(k): v for k, v in sorted(staleness.items())},
            "staleness_max": max(staleness) if staleness else 0,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    # --- checkpoints (see atelier.rl.checkpoint for the layout) -----------
    def save(self, out_dir: Path, tokenizer=None) -> None:
        self.model.save_pretrained(out_dir / "model")
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir / "model")
        torch.save(self.optimizer.state_dict(), out_dir / "optimizer.pt")

    def load_optimizer(self, ckpt_dir: Path) -> None:
        self.optimizer.load_state_dict(torch.load(ckpt_dir / "optimizer.pt", weights_only=True))
