"""Metrics over a run's attempts (pure: records in, numbers out).

Definitions (n_t = valid attempts of task t, c_t = successful ones):

- Valid attempt: one that is not an infrastructure error. Infrastructure
  errors are counted (`infra_errors`) but left out of every accuracy figure:
  scoring them 0 would blame the model for a dead sandbox.
- Success: reward >= `threshold` (1.0: every target test passes).
- Accuracy: the mean over tasks of each task's mean reward over its valid
  passes ("accuracy over several passes of the suite"). Each task weighs the
  same however many passes survived.
- Confidence interval: normal approximation over tasks, the clustered
  standard error of Miller (2024, "Adding Error Bars to Evals"): passes of
  one task are not independent, so the unit is the task. With m tasks and
  per-task means a_t, se = stdev(a_t) / sqrt(m) (sample stdev, m - 1), and
  the interval is accuracy ± z·se with z = 1.96 (95 %), clipped to the
  reward's range [0, 1]. None for m < 2.
- pass@k: the unbiased estimator of Chen et al. (2021), per task
  1 − C(n−c, k) / C(n, k), averaged over the tasks with n_t >= k.
- best-of-K: the mean over tasks of the best reward among a task's valid
  passes (with 0/1 rewards, the fraction of tasks solved at least once).
- Cost and latency: medians over valid attempts (one attempt = one task,
  one pass), plus totals and means.
- Tampered: valid attempts the grader found tampering with the tests
  (`atelier.tasks.tamper`); they score 0 and are counted, never excluded.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from atelier.eval.records import EvalRecord
from atelier.failures import is_out_of_memory
from atelier.tasks.tamper import is_tampered

Z_95 = 1.959963984540054


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k for one task: 1 − C(n−c,k)/C(n,k).

    Computed as 1 − prod_{i=n−c+1..n} (1 − k/i), which equals the ratio of
    binomials without forming them (stable for large n)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_ci(values: Sequence[float], z: float = Z_95) -> tuple[float, float | None, float | None]:
    """(mean, low, high) under the normal approximation; no interval below 2 values."""
    if not values:
        raise ValueError("mean_ci of no values")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None, None
    se = statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - z * se, mean + z * se


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


@dataclass
class TaskStats:
    task_id: str
    attempts: int
    valid: int
    successes: int
    infra_errors: int
    mean_reward: float | None
    best_reward: float | None
    median_cost: float | None
    median_wall_s: float | None
    mean_turns: float | None


@dataclass
class EvalMetrics:
    """What `atelier eval --json` prints and the report tabulates."""

    model: str = ""
    tasks: int = 0
    passes: int = 0
    attempts: int = 0
    valid_attempts: int = 0
    infra_errors: int = 0
    infra_error_types: dict[str, int] = field(default_factory=dict)
    infra_error_attempts: int = 0
    """Every attempt that hit an infrastructure error, retried ones included
    (`infra_errors` counts those still failed at the end)."""
    accuracy: float | None = None
    accuracy_ci: tuple[float, float] | None = None
    ci_method: str = "normal approximation over tasks (clustered SE), 95%"
    pass_accuracies: list[float] = field(default_factory=list)
    """Accuracy of each pass over the suite (pass index order)."""
    pass_at_k: dict[int, float] = field(default_factory=dict)
    pass_at_k_tasks: dict[int, int] = field(default_factory=dict)
    best_of_k: float | None = None
    median_cost: float | None = None
    total_cost: float | None = None
    median_wall_s: float | None = None
    mean_wall_s: float | None = None
    tokens: dict[str, int] = field(default_factory=dict)
    mean_tokens: dict[str, float] = field(default_factory=dict)
    mean_turns: float | None = None
    mean_tool_calls: float | None = None
    broken_calls: int = 0
    broken_call_rate: float | None = None
    """Broken calls per tool call."""
    exit_reasons: dict[str, int] = field(default_factory=dict)
    tampered: int = 0
    """Graded attempts whose tests the patch tampered with (reward 0,
    `grade_error` starts with "tampered: ")."""
    out_of_memory: int = 0
    """Graded attempts whose patch ran the tests past the memory limit under
    which the gold patch runs (reward 0, see `atelier.failures`)."""
    per_task: list[TaskStats] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        data["pass_at_k_tasks"] = {str(k): v for k, v in self.pass_at_k_tasks.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EvalMetrics":
        data = dict(data)
        data["pass_at_k"] = {int(k): v for k, v in data.get("pass_at_k", {}).items()}
        data["pass_at_k_tasks"] = {int(k): v for k, v in data.get("pass_at_k_tasks", {}).items()}
        data["per_task"] = [TaskStats(**t) for t in data.get("per_task", [])]
        if data.get("accuracy_ci") is not None:
            data["accuracy_ci"] = tuple(data["accuracy_ci"])
        return cls(**data)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def compute_metrics(records: Sequence[EvalRecord], *, passes: int | None = None,
                    threshold: float = 1.0, model: str = "", z: float = Z_95) -> EvalMetrics:
    """All metrics of one run. `passes` (K) bounds pass@k; default: the most
    attempts any task has."""
    # Long on purpose: one pass over the records per block of `EvalMetrics` fields, in field order; each
    # line sets one metric, and the formulas are the small functions above.
    by_task: dict[str, list[EvalRecord]] = defaultdict(list)
    for rec in records:
        by_task[rec.task_id].append(rec)
    valid = [r for r in records if not r.infra_error]
    K = passes if passes is not None else max((len(v) for v in by_task.values()), default=0)
    m = EvalMetrics(model=model or next((r.model for r in records if r.model), ""),
                    tasks=len(by_task), passes=K, attempts=len(records), valid_attempts=len(valid))
    m.tampered = sum(is_tampered(r.grade_error) for r in valid)
    m.out_of_memory = sum(is_out_of_memory(r.grade_error) for r in valid)
    for rec in records:
        if rec.infra_error:
            m.infra_errors += 1
            kind = rec.error_type or "infra"
            m.infra_error_types[kind] = m.infra_error_types.get(kind, 0) + 1

    task_means, best = [], []
    for task_id in sorted(by_task):
        recs = by_task[task_id]
        ok = [r for r in recs if not r.infra_error]
        rewards = [float(r.reward or 0.0) for r in ok]
        stats = TaskStats(
            task_id=task_id, attempts=len(recs), valid=len(ok),
            successes=sum(r.success for r in ok), infra_errors=len(recs) - len(ok),
            mean_reward=_mean(rewards), best_reward=max(rewards) if rewards else None,
            median_cost=median(r.cost for r in ok), median_wall_s=median(r.wall_s for r in ok),
            mean_turns=_mean([float(r.turns) for r in ok]))
        m.per_task.append(stats)
        if rewards:
            task_means.append(stats.mean_reward)
            best.append(stats.best_reward)
        for k in range(1, K + 1):
            if len(ok) >= k:
                m.pass_at_k[k] = m.pass_at_k.get(k, 0.0) + pass_at_k(len(ok), stats.successes, k)
                m.pass_at_k_tasks[k] = m.pass_at_k_tasks.get(k, 0) + 1
    for k in list(m.pass_at_k):
        m.pass_at_k[k] /= m.pass_at_k_tasks[k]

    if task_means:
        acc, low, high = mean_ci(task_means, z)
        m.accuracy = acc
        m.accuracy_ci = (max(low, 0.0), min(high, 1.0)) if low is not None else None
        m.best_of_k = statistics.fmean(best)
    by_pass: dict[int, list[float]] = defaultdict(list)
    for r in valid:
        by_pass[r.pass_index].append(float(r.reward or 0.0))
    m.pass_accuracies = [statistics.fmean(by_pass[i]) for i in sorted(by_pass)]

    costs = [r.cost for r in valid if r.cost is not None]
    m.median_cost = median(costs)
    m.total_cost = sum(costs) if costs else None
    m.median_wall_s = median(r.wall_s for r in valid)
    m.mean_wall_s = _mean([r.wall_s for r in valid])
    for r in valid:
        for kind, count in r.tokens.items():
            m.tokens[kind] = m.tokens.get(kind, 0) + int(count)
        m.exit_reasons[r.exit_reason or "?"] = m.exit_reasons.get(r.exit_reason or "?", 0) + 1
    if valid:
        m.mean_tokens = {kind: total / len(valid) for kind, total in m.tokens.items()}
    m.mean_turns = _mean([float(r.turns) for r in valid])
    m.mean_tool_calls = _mean([float(r.tool_calls) for r in valid])
    m.broken_calls = sum(r.broken_calls for r in valid)
    calls = sum(r.tool_calls for r in valid)
    m.broken_call_rate = m.broken_calls / calls if calls else None
    return m
