"""The RL objective as one pure function (tensor in, loss and metrics out).

Legend for shape suffixes: B = samples in the batch, T = tokens (padded).

What we keep and what we dropped from GRPO / PPO, and why:

- Kept: a fixed group of samples per prompt and a group-relative advantage
  (reward minus the group mean, see `atelier.rl.advantages`).
- Dropped: division by the group's reward std (biases toward near-solved and
  near-hopeless groups), and per-sequence length normalisation (makes a token
  of a long rollout count less than one of a short rollout, which rewards
  long wrong answers). The loss is a *sum* over tokens divided by one constant
  (`norm_tokens`), the same for every batch.
- Dropped: PPO's ratio clipping and multiple epochs per batch. Every batch is
  used for exactly one optimizer step (single epoch), so the trainer's policy
  before the step *is* the current policy and there is no old-policy ratio to
  clip. What remains off-policy is the gap between the sampler (stale weights,
  a different numeric path) and the trainer: that is corrected with a
  *truncated importance weight* w = min(pi_theta / mu, C) against the
  sampler's own per-token logprobs mu, treated as a constant (stop-gradient),
  as in IMPALA / truncated-IS for asynchronous samplers. The weight multiplies
  the REINFORCE term A * log pi_theta, so the gradient is w * A * grad log pi.
- KL: optional, the plain k1 estimator log pi_theta - log pi_ref per token
  (not k3, whose variance explodes when the policies diverge). As a loss term
  its expected gradient is zero, so it enters as a per-token *reward* penalty:
  the token's advantage becomes A - beta * k1 (stop-gradient), which gives the
  true gradient of beta * KL. With beta = 0 the reference model is never run.
- No value function, no entropy bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossInputs:
    logprobs_BT: torch.Tensor        # log pi_theta(token), with grad
    sampler_logprobs_BT: torch.Tensor  # log mu(token), from the sampler
    advantages_B: torch.Tensor
    mask_BT: torch.Tensor            # 1 where the token was sampled (trained on)
    ref_logprobs_BT: torch.Tensor | None = None


def policy_loss(
    inputs: LossInputs, *, is_cap: float = 2.0, kl_beta: float = 0.0, norm_tokens: float = 1024.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated-IS policy gradient loss; returns (loss, metrics).

    loss = -(1 / norm_tokens) * sum_{b,t} mask * w * (A_b - beta * k1) * log pi_theta
    with w = min(exp(log pi_theta - log mu), is_cap) and k1 = log pi_theta - log pi_ref,
    both detached.
    """
    if norm_tokens <= 0:
        raise ValueError("norm_tokens must be positive")
    mask_BT = inputs.mask_BT.to(inputs.logprobs_BT.dtype)
    logp_BT = inputs.logprobs_BT
    log_ratio_BT = (logp_BT.detach() - inputs.sampler_logprobs_BT) * mask_BT
    ratio_BT = torch.exp(log_ratio_BT)
    weight_BT = torch.clamp(ratio_BT, max=is_cap)
    adv_BT = inputs.advantages_B[:, None].to(logp_BT.dtype).expand_as(logp_BT)
    kl_BT = torch.zeros_like(logp_BT)
    if kl_beta > 0.0:
        if inputs.ref_logprobs_BT is None:
            raise ValueError("kl_beta > 0 needs reference logprobs")
        kl_BT = (logp_BT.detach() - inputs.ref_logprobs_BT) * mask_BT
        adv_BT = adv_BT - kl_beta * kl_BT
    loss = -(mask_BT * weight_BT * adv_BT * logp_BT).sum() / norm_tokens
    n = mask_BT.sum().clamp(min=1.0)
    sampled = mask_BT.bool()
    metrics = {
        "loss": float(loss.detach()),
        "tokens": float(mask_BT.sum()),
        "is_weight_mean": float((weight_BT * mask_BT).sum() / n),
        "is_ratio_max": float(ratio_BT[sampled].max()) if sampled.any() else 1.0,
        "is_ratio_min": float(ratio_BT[sampled].min()) if sampled.any() else 1.0,
        "is_truncated_frac": float(((ratio_BT > is_cap) & sampled).sum() / n),
        "kl_k1": float(kl_BT.sum() / n),
        "sampler_mismatch": float((log_ratio_BT.abs()).sum() / n),
    }
    return loss, metrics
