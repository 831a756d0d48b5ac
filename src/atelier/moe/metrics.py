"""Sampler-versus-trainer mismatch and router load balance: small pure functions.

Legend: B = sequences, T = tokens, E = experts.
"""

from __future__ import annotations

import torch


def sampler_mismatch(logp_BT: torch.Tensor, mu_BT: torch.Tensor, mask_BT: torch.Tensor,
                     is_cap: float) -> dict[str, float]:
    """How far the trainer's log pi is from the sampler's log mu on the trained tokens.

    mean/max |log pi - log mu|; k1 = mean(log mu - log pi), the plain
    estimator of KL(mu || pi) from the sampler's tokens; the fraction of
    tokens whose importance weight pi/mu exceeds `is_cap` (truncated)."""
    m = mask_BT.bool()
    n = int(m.sum())
    if n == 0:
        return {"mismatch_abs_mean": 0.0, "mismatch_abs_max": 0.0, "mismatch_k1": 0.0, "is_truncated_frac": 0.0}
    d = (logp_BT.detach().float() - mu_BT.float())[m]
    return {
        "mismatch_abs_mean": float(d.abs().mean()),
        "mismatch_abs_max": float(d.abs().max()),
        "mismatch_k1": float((-d).mean()),
        "is_truncated_frac": float((d.exp() > is_cap).float().mean()),
    }


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (all layers and k slots together); negative ids ignored."""
    ids = expert_ids.reshape(-1)
    return torch.bincount(ids[ids >= 0].long(), minlength=num_experts).cpu()


def load_balance(counts_E: torch.Tensor) -> dict[str, float | list[int]]:
    """Tokens per expert and the imbalance max/mean (1.0 is perfectly even)."""
    mean = counts_E.float().mean()
    return {"tokens_per_expert": counts_E.tolist(),
            "expert_imbalance": float(counts_E.max() / mean) if mean > 0 else 0.0}
