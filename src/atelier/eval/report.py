"""`atelier report`: one self-contained HTML page over evaluation and training runs.

The page holds a summary table, pass@k curves, an accuracy-against-cost
Pareto plot, training curves (for a run directory with a training log), a
per-task table and a trajectory viewer. Plots are PNGs embedded as base64;
CSS and JS are inline; nothing is fetched, so the file can be mailed or
opened offline.

What a RUN_DIR may be:
- an evaluation run (`results.jsonl`, see `atelier.eval.records`);
- a training run: `metrics.jsonl` (as `atelier.rl` writes it), else any
  other `*.jsonl` beside it whose rows carry a `step` (keys
  are matched loosely: reward, pass rate, KL, staleness, tokens/s, loss;
  missing keys are simply not plotted);
- a directory whose subdirectories are evaluation runs (e.g. a training run
  with `eval-before/` and `eval-after/`): each becomes its own run.

A run is shown under its directory's name and its model under the name its
evaluation recorded (the model directory's last part), unless `names` says
what each run is: `atelier run` passes "SmolLM2-135M-Instruct", "... after
SFT", "... after RL", so the page names models by what they are.

Every string from a run (task ids, model names, trajectories) is escaped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Sequence

from atelier.eval.metrics import EvalMetrics, compute_metrics
from atelier.eval.records import META_FILE, RESULTS_FILE, EvalError, EvalRecord, read_json, read_records
from atelier.eval.viewer import VIEWER_JS, viewer_html
from atelier.harness.trajectory import Trajectory

MAX_TRAJECTORIES = 300
TRAINING_LOGS = ("metrics.jsonl", "train_metrics.jsonl")
"""Looked at first (`atelier.rl` writes `metrics.jsonl`); any other `*.jsonl` with steps after them."""
NOT_TRAINING_LOGS = (RESULTS_FILE, "ledger.jsonl")


@dataclass
class RunData:
    label: str
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    records: list[EvalRecord] = field(default_factory=list)
    metrics: EvalMetrics | None = None
    training: list[dict[str, Any]] = field(default_factory=list)
    training_file: str | None = None
    model: str | None = None
    """What the model is, for people (`build_report`'s `names`); None: the evaluation's own name."""


def read_training_log(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows if rows and any("step" in r for r in rows) else []


def _eval_run(path: Path, label: str) -> RunData:
    meta = read_json(path / META_FILE) or {}
    records = read_records(path)
    run = RunData(label=label, path=path, meta=meta, records=records)
    if records:
        run.metrics = compute_metrics(records, passes=meta.get("passes"), model=meta.get("model", ""),
                                      threshold=(meta.get("eval_config") or {}).get("threshold", 1.0))
        run.metrics.infra_error_attempts = sum(r.infra_error for r in read_records(path, latest=False))
    return run


def discover_runs(path: str | Path) -> list[RunData]:
    """The runs a RUN_DIR argument stands for (see the module docstring)."""
    root = Path(path)
    if not root.is_dir():
        raise EvalError(f"run directory not found: {path}",
                        hint="pass directories written by `atelier eval --out` or a training run")
    runs: list[RunData] = []
    if (root / RESULTS_FILE).is_file() or (root / META_FILE).is_file():
        runs.append(_eval_run(root, root.name))
    logs = sorted(root.glob("*.jsonl"), key=lambda p: (p.name not in TRAINING_LOGS, p.name))
    for log in logs:
        if log.name in NOT_TRAINING_LOGS:
            continue
        rows = read_training_log(log)
        if rows:
            runs.append(RunData(label=f"{root.name} (training)", path=root, training=rows,
                                training_file=log.name))
            break
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        if (sub / RESULTS_FILE).is_file():
            runs.append(_eval_run(sub, f"{root.name}/{sub.name}"))
    if not runs:
        raise EvalError(f"{path} holds no evaluation results ({RESULTS_FILE}) and no training log",
                        hint="run `atelier eval --run-dir DIR` first, or pass a training run directory")
    return runs


def _fmt(value: float | None, spec: str = ".3f", unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def summary_table(runs: Sequence[RunData]) -> str:
    head = ["run", "model", "tasks", "passes", "accuracy (95% CI)", "pass@1", "pass@K", "best-of-K",
            "median cost / task", "total cost", "median latency", "turns", "tool calls",
            "broken calls", "tokens in / out per attempt", "infra errors", "tampered"]
    rows = []
    for run in runs:
        m = run.metrics
        if m is None:
            continue
        ci = f" ({m.accuracy_ci[0]:.3f}–{m.accuracy_ci[1]:.3f})" if m.accuracy_ci else ""
        k_max = max(m.pass_at_k, default=None)
        tin = sum(r.tokens_in for r in run.records if not r.infra_error)
        tout = sum(r.tokens_out for r in run.records if not r.infra_error)
        n = max(m.valid_attempts, 1)
        cells = [run.label, run.model or m.model, m.tasks, m.passes, _fmt(m.accuracy) + ci,
                 _fmt(m.pass_at_k.get(1)),
                 (f"{_fmt(m.pass_at_k[k_max])} (k={k_max})" if k_max else "—"), _fmt(m.best_of_k),
                 _fmt(m.median_cost, ".4f", " $"), _fmt(m.total_cost, ".4f", " $"),
                 _fmt(m.median_wall_s, ".1f", " s"), _fmt(m.mean_turns, ".1f"),
                 _fmt(m.mean_tool_calls, ".1f"),
                 f"{m.broken_calls}" + (f" ({m.broken_call_rate:.0%})" if m.broken_call_rate else ""),
                 f"{tin / n:.0f} / {tout / n:.0f}",
                 f"{m.infra_errors}" + (" (" + ", ".join(f"{k} {v}" for k, v in
                                                          m.infra_error_types.items()) + ")"
                                        if m.infra_error_types else "")
                + (f"; {m.infra_error_attempts} attempt(s) hit one"
                   if m.infra_error_attempts > m.infra_errors else ""),
                 m.tampered]
        rows.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
    if not rows:
        return '<p class="muted">No evaluation results.</p>'
    return ('<table id="summary"><tr>' + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>"
            + "".join(rows) + "</table>")


def per_task_table(runs: Sequence[RunData], traj_ids: dict[tuple[int, str, int], str]) -> str:
    evals = [(i, r) for i, r in enumerate(runs) if r.metrics is not None]
    if not evals:
        return ""
    tasks = sorted({t.task_id for _, r in evals for t in r.metrics.per_task})
    head = "<tr><th>task</th>" + "".join(f"<th>{escape(r.label)}</th>" for _, r in evals) + "</tr>"
    rows = []
    for task in tasks:
        cells = [f"<td>{escape(task)}</td>"]
        for i, run in evals:
            stats = next((t for t in run.metrics.per_task if t.task_id == task), None)
            if stats is None:
                cells.append("<td>—</td>")
                continue
            links = " ".join(
                f'<a href="#" class="show-traj" data-traj="{escape(traj_ids[(i, task, r.pass_index)])}">'
                f'{"✓" if r.success else ("!" if r.infra_error else "✗")}</a>'
                for r in run.records if r.task_id == task and (i, task, r.pass_index) in traj_ids)
            text = (f"{stats.successes}/{stats.valid} solved · mean {_fmt(stats.mean_reward, '.2f')}"
                    + (f" · {stats.infra_errors} infra" if stats.infra_errors else ""))
            cls = "good" if stats.successes else ("bad" if stats.valid else "muted")
            cells.append(f'<td class="{cls}">{escape(text)} {links}</td>')
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return '<table id="per-task">' + head + "".join(rows) + "</table>"


def _interval(iv: Sequence[float] | None) -> str:
    return f" [{iv[0]:.2f}, {iv[1]:.2f}]" if iv else ""


def _evaluations_table(table_id: str, evals: dict[str, Any], measure: str, headline: bool = True) -> str:
    """The summary's evaluations (label -> figures) side by side, in pipeline order, with the
    rate of `measure` (marked as the headline's when `headline`)."""
    cols = [("before", "before training"), ("after_sft", "after SFT"), ("after_rl", "after RL")]
    cols = [(k, label) for k, label in cols if k in evals]

    def row(name: str, cell) -> str:
        return f"<tr><th>{escape(name)}</th>" + "".join(f"<td>{escape(cell(evals[k]))}</td>" for k, _ in cols) + "</tr>"

    rows = [row("attempts (valid)", lambda e: f"{e['attempts']} ({e['valid_attempts']})"),
            row("pass rate [95% Wilson]",
                lambda e: _fmt(e["pass_rate"], ".3f") + _interval(e["pass_rate_interval_95"])),
            row("best-of-K (tasks solved at least once)", lambda e: _fmt(e["best_of_k"], ".3f")),
            row("mean reward", lambda e: _fmt(e["mean_reward"], ".3f"))]
    if measure != "pass":
        rows.append(row(f"{measure} rate [95% Wilson]" + (" (headline)" if headline else ""),
                        lambda e: _fmt(e[measure]["rate"], ".3f") + _interval(e[measure]["interval_95"])))
    return (f'<table id="{table_id}"><tr><th></th>' + "".join(f"<th>{escape(label)}</th>" for _, label in cols)
            + "</tr>" + "".join(rows) + "</table>")


def _paired_test(test: dict[str, Any]) -> str:
    return (f"{escape(test['test'])} over {test['pairs']} paired attempts: {test['improved']} improved, "
            f"{test['worsened']} worsened, one-sided p = {test['p_value']:.4f}")


def headline_section(summary: dict[str, Any]) -> str:
    """The three evaluations of `atelier run` side by side and its pre-registered
    test (`summary` as `atelier.pipeline.summary.build_summary` makes it); with
    `rl_tasks`, the same for RL's own training tasks below them."""
    head = summary.get("headline", {})
    measure = head.get("measure", "pass")
    table = _evaluations_table("headline", summary.get("evaluations", {}), measure)
    if "p_value" in head:
        verdict = "significant" if head.get("significant") else "not significant"
        test = (f"<p>Headline, named in the recipe before the run: <b>{escape(measure)}</b>, after RL against "
                f"after SFT, {_paired_test(head)} (<b>{verdict}</b> at α = {head['alpha']}).</p>")
    else:
        test = '<p class="muted">No headline test: an evaluation after SFT or after RL is missing.</p>'
    rl = summary.get("rl") or {}
    zero = rl.get("zero_variance_fraction_all")
    skipped = rl.get("tied_groups_skipped", 0)
    rl_line = (f'<p class="muted">RL: {len(rl.get("steps", []))} steps, {rl.get("groups", 0)} groups trained'
               + (f", {skipped} more skipped as tied" if skipped else "") + ", "
               f'{rl.get("zero_variance_groups", 0)} with zero reward variance'
               + (f" ({zero:.0%})" if zero is not None else "") + "; rewards per step: "
               + escape(", ".join(_fmt(v) for v in rl.get("reward_mean", []))) + "</p>")
    return "<h2>Before training, after SFT, after RL</h2>" + table + test + rl_line + _rl_tasks_section(summary)


def _rl_tasks_section(summary: dict[str, Any]) -> str:
    """The SFT and RL models on RL's own training tasks (`eval.rl_tasks`): not held out, not the
    headline; what RL learned where it trained, for reading the held-out result beside it."""
    own = summary.get("rl_tasks")
    if not own:
        return ""
    measure = summary.get("headline", {}).get("measure", "pass")
    test = own["tests"].get(measure)
    line = (f"<p>After RL against after SFT on <b>{escape(measure)}</b>, {_paired_test(test)} "
            "(not pre-registered).</p>") if test else ""
    return ("<h3>On RL's own training tasks (not held out)</h3>"
            + _evaluations_table("rl-tasks", own["evaluations"], measure, headline=False) + line)


def build_report(run_dirs: Sequence[str | Path], out: str | Path, *,
                 max_trajectories: int = MAX_TRAJECTORIES, title: str = "atelier report",
                 headline: dict[str, Any] | None = None, names: dict[str, str] | None = None) -> Path:
    """Write the page for `run_dirs` to `out` and return its path; `headline`
    (an `atelier run` summary) adds its comparison section on top; `names` maps a run
    directory (as given) to what its model is, which labels the run and names its model."""
    # The page's sections in page order, each made by its own function; the plots (matplotlib) load here.
    from atelier.eval import plots

    if not run_dirs:
        raise EvalError("no run directories given", hint="atelier report RUN_DIR [RUN_DIR ...] --out report.html")
    runs = [run for d in run_dirs for run in discover_runs(d)]
    by_path = {Path(d).resolve(): name for d, name in (names or {}).items()}
    for run in runs:
        if run.path.resolve() in by_path:
            run.model = by_path[run.path.resolve()]
            run.label = run.model
    evals = [r for r in runs if r.metrics is not None]

    sections = [f"<h1>{escape(title)}</h1>"] + ([headline_section(headline)] if headline else [])
    sections += ["<h2>Summary</h2>", summary_table(runs)]
    if evals:
        sections += ["<h2>pass@k</h2>", plots.pass_at_k_plot({r.label: r.metrics.pass_at_k for r in evals})]
        priced = [r for r in evals if r.metrics.median_cost is not None and r.metrics.accuracy is not None]
        if priced and any(r.metrics.median_cost > 0 for r in priced):
            x_label = "median cost per attempt ($)"
            points = [dict(label=r.label, x=r.metrics.median_cost, accuracy=r.metrics.accuracy,
                           ci=r.metrics.accuracy_ci) for r in priced]
        else:  # local models cost nothing in dollars: their cost is the tokens they sample
            x_label = "sampled tokens per attempt (no dollar prices for these models)"
            points = [dict(label=r.label, x=r.metrics.mean_tokens.get("completion", 0.0),
                           accuracy=r.metrics.accuracy, ci=r.metrics.accuracy_ci)
                      for r in evals if r.metrics.accuracy is not None]
        sections += ["<h2>Accuracy against cost</h2>", plots.pareto_plot(points, x_label)]
        placed = {p["label"] for p in points}
        left = [r.label for r in evals if r.label not in placed]
        if left:
            sections.append(f'<p class="muted">Not placed (no price for the model, or no valid attempt): '
                            f'{escape(", ".join(left))}. Add the model to the price table '
                            "(<code>--prices</code>) to place it.</p>")
    for run in runs:
        if run.training:
            img = plots.training_plot(run.training, run.label)
            sections += [f"<h2>Training: {escape(run.label)}</h2>",
                         f'<p class="muted">{len(run.training)} rows of {escape(run.training_file or "")}</p>',
                         img or '<p class="muted">The training log has none of the plotted metrics.</p>']

    traj_ids: dict[tuple[int, str, int], str] = {}
    items = []
    for i, run in enumerate(runs):
        for rec in run.records:
            if len(items) >= max_trajectories or not rec.trajectory:
                continue
            path = run.path / rec.trajectory
            try:
                traj = Trajectory.load(path)
            except (OSError, ValueError, TypeError, KeyError):
                continue
            dom_id = f"traj-{len(items)}"
            traj_ids[(i, rec.task_id, rec.pass_index)] = dom_id
            items.append((dom_id, f"{run.label} · {rec.task_id} · pass {rec.pass_index}", traj))
    if evals:
        sections += ["<h2>Per task</h2>", per_task_table(runs, traj_ids)]
    sections += ['<h2>Trajectories</h2><div id="viewer">', viewer_html(items), "</div>"]
    page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head><body>{''.join(sections)}"
            f"<script>{VIEWER_JS}</script></body></html>")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.good { background: #eef9ee; } td.bad { background: #fbeeee; }
.muted { color: #888; } .error { color: #b00; }
img.plot { max-width: 100%; margin: 0.5em 1em 0.5em 0; }
pre { background: #f7f7f7; padding: 6px; white-space: pre-wrap; word-break: break-word;
      max-height: 30em; overflow: auto; margin: 2px 0; }
.msg { border-left: 4px solid #bbb; margin: 8px 0; padding-left: 8px; }
.msg.assistant { border-color: #36c; } .msg.user { border-color: #3a3; }
.msg.tool { border-color: #c83; } .msg.system { border-color: #999; }
.role { font-weight: bold; font-size: 12px; text-transform: uppercase; color: #555; }
.call { border: 1px dashed #c83; margin: 4px 0 4px 24px; padding: 4px 8px; }
.call.broken { border-color: #b00; } .label { font-size: 11px; color: #777; }
.tag { font-size: 11px; padding: 0 4px; border-radius: 3px; background: #ddd; }
.tag.ok { background: #cec; } .tag.broken, .tag.failed { background: #ecc; }
.diff .add { color: #070; } .diff .del { color: #a00; } .diff .hunk { color: #06a; }
.diff .meta { color: #666; font-weight: bold; }
a.show-traj { text-decoration: none; margin-right: 2px; }
"""
