"""The report's figures, each returned as an `<img>` tag with an embedded PNG.

matplotlib runs on the Agg backend (no display); every figure is closed
after rendering so a long report does not pile up memory. Inputs are plain
numbers, so the figures can be tested without a run directory.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# Training metric families the report plots, each matched by substrings of the JSONL keys.
TRAINING_FAMILIES: dict[str, tuple[str, ...]] = {
    "reward": ("reward",),
    "pass rate": ("pass_rate", "pass@", "solve_rate", "success", "best_of"),
    "KL": ("kl",),
    "staleness": ("stale", "lag", "off_policy"),
    "tokens/s": ("tokens_per_s", "tok_per_s", "tokens/s", "throughput"),
    "loss": ("loss",),
}


def to_img(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return (f'<img class="plot" alt="{html.escape(alt)}" '
            f'src="data:image/png;base64,{data}">')


def pass_at_k_plot(curves: dict[str, dict[int, float]]) -> str:
    """One line per run: pass@k against k."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for label, curve in curves.items():
        ks = sorted(curve)
        if ks:
            ax.plot(ks, [curve[k] for k in ks], marker="o", label=label)
    ax.set_xlabel("k (attempts per task)")
    ax.set_ylabel("pass@k")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if curves:
        ax.legend(fontsize=8)
    ax.set_title("pass@k (unbiased estimator)")
    return to_img(fig, "pass@k curves")


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both cost (lower) and
    accuracy (higher), ordered by cost."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return front


def pareto_plot(runs: Sequence[dict], x_label: str) -> str:
    """runs: {label, x, accuracy, ci: (low, high) | None}; the frontier is drawn."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    pts = [(r["x"], r["accuracy"]) for r in runs]
    for r in runs:
        err = None
        if r.get("ci"):
            low, high = r["ci"]
            err = [[max(r["accuracy"] - low, 0)], [max(high - r["accuracy"], 0)]]
        ax.errorbar([r["x"]], [r["accuracy"]], yerr=err, fmt="o", capsize=3, label=r["label"])
    front = pareto_front(pts)
    if len(front) > 1:
        ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "--", color="grey",
                linewidth=1, label="Pareto frontier")
    ax.set_xlabel(x_label)
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if runs:
        ax.legend(fontsize=8)
    ax.set_title("accuracy against cost")
    return to_img(fig, "accuracy against cost (Pareto)")


def flatten_training_row(row: dict) -> dict:
    """One level of nesting flattened (`reward_parts.correctness`), a
    histogram (`staleness_hist`: {"0": n0, "1": n1}) turned into its mean
    (`staleness_mean`), bookkeeping counts (`ledger`) left out."""
    out: dict = {}
    for key, value in row.items():
        if not isinstance(value, dict):
            out[key] = value
        elif "hist" in key:
            pairs = [(float(k), v) for k, v in value.items() if _is_num(v) and _is_float(k)]
            total = sum(v for _, v in pairs)
            if total:
                out[key.replace("hist", "mean")] = sum(k * v for k, v in pairs) / total
        elif key != "ledger":
            out.update({f"{key}.{k}": v for k, v in value.items()})
    return out


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def training_families(rows: Sequence[dict]) -> dict[str, list[str]]:
    """Which numeric keys of the training log fall in each plotted family.

    RL's `reward_parts` (flattened) holds the reward's terms beside numbers
    that are not rewards (`atelier.rl.shaping`, `atelier.rl.task_env`): the
    grading fractions (`pass`, `fail_to_pass`, `pass_to_pass`) are plotted
    as pass rates, the raw length (`length_x`, in units of hundreds) and flags
    are left out (on the reward's axis they flatten it), and so are terms that
    are 0 in every row (switched off) and `total` when `reward_mean` is there."""
    keys: dict[str, None] = {}
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                keys.setdefault(key, None)
    out: dict[str, list[str]] = {family: [] for family in TRAINING_FAMILIES}
    for key in keys:
        if key.startswith("reward_parts."):
            family = _reward_part_family(key, rows, has_mean="reward_mean" in keys)
        elif key == "step":
            family = None
        else:
            family = next((f for f, needles in TRAINING_FAMILIES.items() if any(n in key.lower() for n in needles)),
                          None)
        if family is not None:
            out[family].append(key)
    return {family: hits for family, hits in out.items() if hits}


def _reward_part_family(key: str, rows: Sequence[dict], *, has_mean: bool) -> str | None:
    part = key.removeprefix("reward_parts.")
    if "pass" in part:
        return "pass rate"
    if part.endswith(("_x", "_flag")) or (part == "total" and has_mean):
        return None
    return "reward" if any(_is_num(r.get(key)) and r[key] != 0 for r in rows) else None


def training_plot(rows: Sequence[dict], title: str) -> str | None:
    """Small multiples of reward, pass rate, KL, staleness, tokens/s (and loss)
    against the step; None when the log has none of them."""
    rows = [flatten_training_row(r) for r in rows]
    families = training_families(rows)
    if not families:
        return None
    cols = min(3, len(families))
    nrows = math.ceil(len(families) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False)
    for ax in axes.flat[len(families):]:
        ax.set_visible(False)
    for ax, (family, keys) in zip(axes.flat, families.items()):
        for key in keys:
            xs = [row.get("step", i) for i, row in enumerate(rows) if _is_num(row.get(key))]
            ys = [row[key] for row in rows if _is_num(row.get(key))]
            ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=key)
        ax.set_title(family, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return to_img(fig, f"training curves: {title}")


def _is_num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
