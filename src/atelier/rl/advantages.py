"""Group advantages and group statistics (pure): a sample leaves here with the advantage
the trainer uses, and the step runs only the samples that contribute to it.

Dr. GRPO style: the advantage of a sample is its reward minus the mean reward
of its group. We do not divide by the group's standard deviation — that
up-weights groups whose rewards barely differ (nearly solved or nearly
hopeless tasks) and biases the gradient toward them. A recipe may then train
the samples below their group's mean at a fraction of their advantage
(`weighted_advantage`); `final_advantages` is both, what the reconciler
records for each member of a group. With no KL term a sample whose final
advantage is 0 adds exactly nothing to the loss or its gradient, so a step
does not run it (`trained_samples`).

Rewards of samples lost to infrastructure failures arrive as `None`: they are
excluded from the mean and get no advantage (they are retried upstream, never
scored 0 — docs/pitfalls.md: scoring them 0 biased the advantages of their group).
"""

from __future__ import annotations

from typing import Sequence

from atelier.rl.sample import Sample


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
    attempts off the edit tool at their last turn: docs/log/2026-12-06-positive-advantages.md). At 0
    the step is the policy gradient on the samples above their group's mean alone, the mean still
    their baseline: rejection-sampling fine-tuning weighted by advantage.
    """
    if not 0.0 <= negative_scale <= 1.0:
        raise ValueError(f"negative_scale must be in [0, 1], got {negative_scale}")
    return advantage * negative_scale if advantage < 0.0 else advantage


def final_advantages(rewards: Sequence[float | None], negative_scale: float = 1.0) -> list[float | None]:
    """What each valid member of a group is trained with: its group advantage, a negative one
    then times `negative_scale` (`weighted_advantage`); None stays None."""
    return [None if a is None else weighted_advantage(a, negative_scale) for a in group_advantages(rewards)]


def trained_samples(samples: Sequence[Sample], kl_beta: float) -> list[Sample]:
    """The samples a step runs. With `kl_beta = 0` a sample whose advantage is 0 (every member of
    a zero-variance group; with `negative_advantage_scale = 0`, every sample below its group's
    mean) adds exactly nothing to the loss or its gradient, so it is not run: on a CPU a forward
    and backward of a 2,000-token rollout costs tens of seconds. With a KL term it still pulls
    towards the reference, so every sample is run."""
    return list(samples) if kl_beta else [s for s in samples if s.advantage != 0.0]


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
