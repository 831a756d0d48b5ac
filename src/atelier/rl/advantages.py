"""Group advantages and group statistics (pure).

Dr. GRPO style: the advantage of a sample is its reward minus the mean reward
of its group. We do not divide by the group's standard deviation — that
up-weights groups whose rewards barely differ (nearly solved or nearly
hopeless tasks) and biases the gradient toward them.

Rewards of samples lost to infrastructure failures arrive as `None`: they are
excluded from the mean and get no advantage (they are retried upstream, never
scored 0 — PITFALLS: scoring them 0 biased the advantages of their group).
"""

from __future__ import annotations

from typing import Sequence


def group_advantages(rewards: Sequence[float | None]) -> list[float | None]:
    """reward - mean(valid rewards) for each valid entry; None stays None."""
    valid = [r for r in rewards if r is not None]
    if not valid:
        return [None for _ in rewards]
    mean = sum(valid) / len(valid)
    return [None if r is None else r - mean for r in rewards]


def weighted_advantage(advantage: float, negative_scale: float) -> float:
    """The advantage the trainer uses: a negative one times `negative_scale` (in [0, 1]), a
    positive one as it is (`trainer.negative_advantage_scale`).

    Why a recipe may turn the negative side down: at a peaked policy a negative advantage lowers
    the sampled tokens of a failed attempt and hands their probability to every other token,
    where a positive one sharpens what worked (in the demo, RL with every advantage moved held-out
    attempts off the edit tool at their last turn: recipes/demo.md, "Training on the samples that
    beat their group"). At 0 the step is the policy gradient on the samples above their group's
    mean alone, the mean still their baseline: rejection-sampling fine-tuning weighted by advantage.
    """
    if not 0.0 <= negative_scale <= 1.0:
        raise ValueError(f"negative_scale must be in [0, 1], got {negative_scale}")
    return advantage * negative_scale if advantage < 0.0 else advantage


def tied(rewards: Sequence[float]) -> bool:
    """Every reward the same (within rounding): every advantage is 0, so the group teaches nothing."""
    return max(rewards) - min(rewards) <= 1e-9


def group_stats(rewards: Sequence[float | None], passed: Sequence[bool | None]) -> dict[str, float]:
    """Mean reward, pass rate and best-of-K over the valid members of one group, and
    `zero_variance` (1.0 when every valid member got the same reward: every advantage is 0,
    so the group teaches nothing)."""
    valid = [r for r in rewards if r is not None]
    ok = [bool(p) for p in passed if p is not None]
    if not valid:
        return {"reward_mean": 0.0, "pass_rate": 0.0, "best_of_k": 0.0, "valid": 0.0, "zero_variance": 1.0}
    return {
        "reward_mean": sum(valid) / len(valid),
        "pass_rate": sum(ok) / len(ok) if ok else 0.0,
        "best_of_k": float(any(ok)),
        "valid": float(len(valid)),
        "zero_variance": float(tied(valid)),
    }
