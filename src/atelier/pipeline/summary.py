"""`summary.json` of an `atelier run`: one object, every number recomputed
from what the stages left on disk (never copied from a log line).

- `evaluations`: before / after_sft / after_rl, each from its run's
  `results.jsonl` by `atelier.eval.compare.evaluation_figures` (pass rate with
  Wilson's 95% interval, best-of-K, mean reward, the headline measure);
- `headline`: the measure the recipe named *before* the run
  (`headline.measure`), after RL against after SFT, by the exact one-sided
  McNemar test paired by (task, pass); `significant` is p < `alpha`. The
  same test on every other measure is listed under `other_tests`, labelled as
  not pre-registered;
- `rl_tasks` (only when the run evaluated them, `eval.rl_tasks`): after_sft
  and after_rl on RL's own training tasks, figured the same way, and the same
  paired tests (`tests`): whether RL learned what it trained on. Not
  pre-registered, and not held out;
- `rl`: the reward, pass-rate and zero-variance curves per optimizer step
  (from `rl/metrics.jsonl` and `rl/ledger.jsonl`); a group whose members all
  got the same reward has zero advantage and teaches nothing (the whole-run
  fraction also counts the tied groups `rollout.skip_tied_groups` dropped);
- `wall_s` and peak memory per stage (from `stages.json`), over every
  start of a resumed stage (`stage_starts`), and the run's peak (the largest
  stage peak: stages run one after another): `peak_pss_mb` (shared pages
  split among their processes: what the budget is checked against) and
  `peak_rss_mb` (summed RSS, an upper bound; see `atelier.pipeline.memory`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from atelier.eval.compare import MEASURES, evaluation_figures, mcnemar_one_sided, pair_attempts
from atelier.eval.records import read_records
from atelier.pipeline.memory import PEAK_KEYS
from atelier.rl.advantages import tied
from atelier.rl.ledger import Ledger
from atelier.rl.reconciler import TIED_REASON

EVALUATIONS = {"before": "eval-before", "after_sft": "eval-sft", "after_rl": "eval-after"}
"""Summary label -> the stage (and run subdirectory) that evaluated."""
RL_TASK_EVALUATIONS = {"after_sft": "eval-rl-tasks/after-sft", "after_rl": "eval-rl-tasks/after-rl"}
"""The same for RL's own training tasks (`eval.rl_tasks`)."""


def zero_variance_fraction(groups: Sequence[Sequence[float]], skipped: int = 0) -> float | None:
    """Fraction of groups whose rewards are all equal, counting `skipped` tied groups that were
    never trained (pure); None for no group."""
    if not groups and not skipped:
        return None
    return (sum(1 for g in groups if tied(g)) + skipped) / (len(groups) + skipped)


def rl_groups(ledger_path: Path) -> tuple[dict[int, list[list[float]]], int]:
    """Rewards of each trained group, by the optimizer step that trained it, and how many groups
    were skipped as tied (`rollout.skip_tied_groups`); nothing when there is no ledger."""
    if not ledger_path.is_file():
        return {}, 0
    ledger = Ledger.load(ledger_path)
    by_step: dict[int, list[list[float]]] = defaultdict(list)
    for group in ledger.groups.values():
        slots = [ledger.slots[s] for s in group.slots]
        trained = [s for s in slots if s.state == "trained" and s.reward is not None]
        if trained:
            by_step[trained[0].step or 0].append([float(s.reward) for s in trained])
    skipped = sum(1 for g in ledger.groups.values() if g.dropped.startswith(TIED_REASON))
    return dict(by_step), skipped


def rl_curves(rl_dir: Path) -> dict[str, Any]:
    rows = []
    metrics = rl_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    groups, skipped = rl_groups(rl_dir / "ledger.jsonl")
    every = [g for step in sorted(groups) for g in groups[step]]
    return {
        "steps": [r["step"] for r in rows],
        "reward_mean": [r.get("reward_mean") for r in rows],
        "pass_rate": [r.get("pass_rate") for r in rows],
        "zero_variance_fraction": [zero_variance_fraction(groups.get(r["step"], [])) for r in rows],
        "groups": len(every),
        "tied_groups_skipped": skipped,
        "zero_variance_groups": sum(1 for g in every if tied(g)) + skipped,
        "zero_variance_fraction_all": zero_variance_fraction(every, skipped),
    }


def build_summary(run_dir: Path, stages: dict[str, dict[str, Any]], *, measure: str, alpha: float) -> dict[str, Any]:
    """The summary object of the run in `run_dir` (see the module docstring)."""
    records = _records(run_dir, EVALUATIONS)
    evaluations = {label: evaluation_figures(recs, measure) for label, recs in records.items()}
    tests = rl_vs_sft_tests(records, alpha)
    on_rl_tasks = _records(run_dir, RL_TASK_EVALUATIONS)
    rl_tasks = {"rl_tasks": {
        "evaluations": {label: evaluation_figures(recs, measure) for label, recs in on_rl_tasks.items()},
        "tests": rl_vs_sft_tests(on_rl_tasks, alpha), "pre_registered": False}} if on_rl_tasks else {}
    peaks = {key: {s: o[key] for s, o in stages.items() if o.get(key) is not None}
             for key in PEAK_KEYS}
    return {
        "headline": {"measure": measure, "pre_registered": True, **(tests.get(measure) or {})},
        "other_tests": {k: {**v, "pre_registered": False} for k, v in tests.items() if k != measure},
        "evaluations": evaluations,
        **rl_tasks,
        "rl": rl_curves(run_dir / "rl"),
        "wall_s": {s: o.get("wall_s") for s, o in stages.items()},
        "stage_starts": {s: o.get("starts", 1) for s, o in stages.items() if "wall_s" in o},
        "wall_s_total": round(sum(o.get("wall_s") or 0.0 for o in stages.values()), 1),
        **peaks,
        **{f"{key}_run": max(by_stage.values(), default=None) for key, by_stage in peaks.items()},
    }


def _records(run_dir: Path, evaluations: dict[str, str]) -> dict[str, list[Any]]:
    return {label: read_records(run_dir / sub) for label, sub in evaluations.items() if (run_dir / sub).is_dir()}


def rl_vs_sft_tests(records: dict[str, list[Any]], alpha: float) -> dict[str, Any]:
    """After RL against after SFT, paired by (task, pass), on every measure; {} unless both ran."""
    if "after_sft" not in records or "after_rl" not in records:
        return {}
    tests = {}
    for name, fn in MEASURES.items():
        result = mcnemar_one_sided(pair_attempts(records["after_sft"], records["after_rl"], fn))
        tests[name] = {**result, "compared": "after_rl vs after_sft", "alpha": alpha,
                       "significant": result["p_value"] < alpha}
    return tests
