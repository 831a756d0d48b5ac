"""Compare two evaluations of one model family on the same tasks and passes
(pure: records in, numbers out). Used by `atelier run` for its headline:
after RL against after the SFT warm start.

Definitions:

- An *attempt measure* turns one attempt into 0 or 1 (`MEASURES`). It is
  named in the recipe before any run, so nothing is chosen after seeing what
  moved: `pass` (every target test passes, the grader's success) or `edit`
  (the final diff applies and changes something: the model made a
  well-formed edit, whether or not it was right).
- Rate: successes over valid attempts (infrastructure errors are left out,
  as in `atelier.eval.metrics`). Its 95% interval is Wilson's score
  interval, which stays inside [0, 1] and is not degenerate at 0 or 1
  successes, unlike the normal approximation. It treats attempts as
  independent; the passes of one task are not, so it is somewhat narrow when
  passes agree (the clustered interval over tasks is in `EvalMetrics`).
- Best-of-K: the fraction of tasks with at least one success among their
  valid passes.
- The test: exact one-sided McNemar (the sign test on discordant pairs).
  Attempts are paired by (task, pass): the same task under the same pass
  seed before and after. With b pairs that went 0 -> 1 and c that went
  1 -> 0, under H0 (no change) b ~ Binomial(b + c, 1/2), and
  p = P(X >= b) = sum_{i=b}^{b+c} C(b+c, i) / 2^(b+c). It needs no normal
  approximation, so it is valid at the small counts a laptop run has; pairs
  that agree carry no information about the direction and do not enter.
  With no discordant pair, p = 1.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Sequence

from atelier.eval.metrics import Z_95
from atelier.eval.records import EvalRecord

Measure = Callable[[EvalRecord], bool]


def _passed(record: EvalRecord) -> bool:
    return bool(record.success)


def _edited(record: EvalRecord) -> bool:
    return record.diff_lines > 0 and not record.grade_error


MEASURES: dict[str, Measure] = {"pass": _passed, "edit": _edited}
"""Attempt measures a recipe may name as its headline (see the module docstring)."""


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float] | None:
    """Wilson's score interval for a binomial proportion; None for n = 0."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}, {n}")
    if n == 0:
        return None
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def binomial_upper_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly (integer arithmetic, then one division)."""
    if n < 0 or k > n + 1:
        raise ValueError(f"need n >= 0 and k <= n + 1, got k={k}, n={n}")
    if k <= 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


def mcnemar_one_sided(pairs: Sequence[tuple[bool, bool]]) -> dict[str, Any]:
    """Exact one-sided McNemar test that `after` is better than `before` over
    paired 0/1 outcomes `(before, after)`; see the module docstring."""
    improved = sum(1 for a, b in pairs if not a and b)
    worsened = sum(1 for a, b in pairs if a and not b)
    n = improved + worsened
    return {"test": "exact one-sided McNemar (sign test on discordant pairs)", "pairs": len(pairs),
            "improved": improved, "worsened": worsened,
            "p_value": binomial_upper_tail(improved, n) if n else 1.0}


def pair_attempts(before: Sequence[EvalRecord], after: Sequence[EvalRecord],
                  measure: Measure) -> list[tuple[bool, bool]]:
    """Outcomes of the attempts valid in both runs, paired by (task, pass)."""
    first = {r.key: r for r in before if not r.infra_error}
    return [(measure(first[r.key]), measure(r)) for r in sorted(after, key=lambda r: r.key)
            if not r.infra_error and r.key in first]


def evaluation_figures(records: Sequence[EvalRecord], measure: str) -> dict[str, Any]:
    """One evaluation's figures: rate, interval and best-of-K of every measure
    (the `measure` one repeated as `headline`, the `pass` one as `pass_rate`,
    `pass_rate_interval_95` and `best_of_k`), plus the mean reward."""
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}; known: {', '.join(MEASURES)}")
    valid = [r for r in records if not r.infra_error]
    out: dict[str, Any] = {"attempts": len(records), "valid_attempts": len(valid),
                           "tasks": len({r.task_id for r in records}),
                           "mean_reward": (sum(float(r.reward or 0.0) for r in valid) / len(valid)
                                           if valid else None)}
    for name, fn in MEASURES.items():
        hits = sum(fn(r) for r in valid)
        by_task: dict[str, bool] = defaultdict(bool)
        for r in valid:
            by_task[r.task_id] |= fn(r)
        out[name] = {"rate": hits / len(valid) if valid else None, "successes": hits,
                     "interval_95": wilson_interval(hits, len(valid)),
                     "best_of_k": sum(by_task.values()) / len(by_task) if by_task else None}
    out["headline"] = {"measure": measure, **out[measure]}
    out["pass_rate"], out["pass_rate_interval_95"] = out["pass"]["rate"], out["pass"]["interval_95"]
    out["best_of_k"] = out["pass"]["best_of_k"]
    return out
