"""Calibration: the simulator's component models, measured from a real run directory.

What `atelier train` leaves in RUN_DIR and what is read from it:

- `config.toml`: the recipe that ran (pipeline shape, engine, sync kind);
- `metrics.jsonl`: per step, the trainer's busy and idle time, `train_seconds`, the publish
  (`sync_bytes`, `sync_seconds`, `sync_kind`) and the engine's swap (`engine_swap_s`); the
  first line's `wall_s - interval_s` is the start-up, `summary.json`'s `wall_s` the end;
- `ledger.jsonl`: when each slot started running and was graded (every event's `t`), which
  step trained it;
- `rollouts/*.json`: each trajectory's model calls (`timings["generate"]`: start, seconds,
  context and sampled tokens), its length and reward.

From them: each rollout's profile (time before its first call, the environment's time after
each call: `atelier.sim.workload`), the trainer's step time against the positions it trained
(least squares, coefficients kept non-negative), the engine's call time against the tokens it
sampled and the calls decoding beside it (the same fit: a decode step of b sequences takes
`decode_step_s + decode_step_s_per_seq * b`), the prefill per uncached context token, the
publish rate, the swap, and the per-step overheads (what the busy time leaves unexplained).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from atelier.config import load_config
from atelier.errors import AtelierError
from atelier.inference.vllm_server import STARTED_IN
from atelier.rl.config import TrainConfig
from atelier.sim.results import RunFigures, StepRecord, figures
from atelier.sim.workload import GroupProfile, RolloutProfile, Turn


class CalibrationError(AtelierError):
    """A run directory the simulator cannot be calibrated on."""


@dataclass
class RunRecord:
    """What a run directory holds that calibration reads."""

    path: Path
    config: TrainConfig
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]]
    trajectories: dict[str, dict[str, Any]]
    summary: dict[str, Any] | None

    @property
    def start_unix(self) -> float:
        """The run's start (`open_run`) on the ledger's clock: step 1's line precedes its slots'
        `trained` events by a few milliseconds."""
        first = self.rows[0]
        trained = [e["t"] for e in self.events if e.get("state") == "trained" and e.get("step") == first["step"]]
        if not trained:
            raise CalibrationError(f"{self.path}: no slot of step {first['step']} is marked trained in the ledger")
        return min(trained) - first["wall_s"]


def read_run(run_dir: str | Path) -> RunRecord:
    path = Path(run_dir)
    for name in ("config.toml", "metrics.jsonl", "ledger.jsonl"):
        if not (path / name).is_file():
            raise CalibrationError(f"{path} has no {name}: it is not the run directory of `atelier train`",
                                   hint="pass a directory `atelier train --run-dir` (or `atelier run`'s rl/) wrote")
    config = load_config(TrainConfig, path / "config.toml")
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in (path / "ledger.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise CalibrationError(f"{path} trained no step yet", hint="calibrate on a run with a few steps done")
    if any("t" not in e for e in events):
        raise CalibrationError(f"{path}'s ledger has events without a time (`t`): it was written by an older atelier",
                               hint="run the recipe again with this version to calibrate on it")
    trajectories = {}
    for file in sorted((path / "rollouts").glob("*.json")):
        trajectories[file.stem.replace("--", "/")] = json.loads(file.read_text())
    summary_path = path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return RunRecord(path, config, rows, events, trajectories, summary)


# -- what happened to each slot ---------------------------------------------------------

@dataclass
class SlotHistory:
    group_id: str
    running_t: float = 0.0
    graded_t: float | None = None
    step: int | None = None
    tokens: int = 0


def slot_histories(run: RunRecord) -> tuple[dict[str, SlotHistory], dict[str, list[str]]]:
    """Per slot: its last start, its grading, the step that trained it; and each group's slots."""
    slots: dict[str, SlotHistory] = {}
    groups: dict[str, list[str]] = defaultdict(list)
    for e in run.events:
        if e["event"] == "group":
            for m in range(e["size"]):
                sid = f"{e['group_id']}/{m}"
                slots[sid] = SlotHistory(e["group_id"])
                groups[e["group_id"]].append(sid)
        elif e["event"] == "slot":
            h = slots[e["slot_id"]]
            if e["state"] == "running":
                h.running_t, h.graded_t = e["t"], None
            elif e["state"] == "graded":
                h.graded_t, h.tokens = e["t"], e.get("tokens", 0)
            elif e["state"] == "trained":
                h.step = e["step"]
    return slots, groups


def rollout_profile(traj: dict[str, Any], history: SlotHistory) -> RolloutProfile | None:
    calls = traj.get("timings", {}).get("generate") or []
    if not calls or history.graded_t is None:
        return None
    turns = []
    for i, (start, seconds, context, sampled) in enumerate(calls):
        end = start + seconds
        after = (calls[i + 1][0] if i + 1 < len(calls) else history.graded_t) - end
        turns.append(Turn(int(context), int(sampled), max(after, 0.0)))
    length = sum(len(seg["token_ids"]) for seg in traj.get("segments", []))
    return RolloutProfile(setup_s=max(calls[0][0] - history.running_t, 0.0), turns=tuple(turns), length=length,
                          reward=float(traj.get("reward") or 0.0))


def group_profiles(run: RunRecord) -> list[GroupProfile]:
    slots, groups = slot_histories(run)
    out = []
    for sids in groups.values():
        members = [rollout_profile(run.trajectories[s], slots[s]) for s in sids if s in run.trajectories]
        members = [m for m in members if m is not None]
        if members:
            out.append(tuple(members))
    if not out:
        raise CalibrationError(f"{run.path}'s trajectories carry no model-call timings",
                               hint="run the recipe again with this version to calibrate on it")
    return out


# -- fits -----------------------------------------------------------------------------------

def nonnegative_fit(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the columns that come out negative."""
    keep = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        if (sol >= 0).all():
            coef[keep] = sol
            return coef
        keep = [k for k, c in zip(keep, sol) if c > 0]
    return coef


def robust_fit(X: np.ndarray, y: np.ndarray, rounds: int = 20) -> np.ndarray:
    """Least absolute deviations (iteratively reweighted least squares), coefficients >= 0: a few
    calls slowed by something else (a trainer step on the same cores, a compile) move it little."""
    coef = nonnegative_fit(X, y)
    scale = max(float(np.median(np.abs(y))), 1e-9)
    for _ in range(rounds):
        w = 1.0 / np.sqrt(np.maximum(np.abs(y - X @ coef), 1e-3 * scale))
        coef = nonnegative_fit(X * w[:, None], y * w)
    return coef


def mean_concurrency(intervals: np.ndarray) -> np.ndarray:
    """For each [start, end] row, the mean number of rows in progress during it (itself included)."""
    points = np.unique(intervals.ravel())
    delta = np.zeros(len(points))
    np.add.at(delta, np.searchsorted(points, intervals[:, 0]), 1)
    np.add.at(delta, np.searchsorted(points, intervals[:, 1]), -1)
    active = np.cumsum(delta)[:-1]                     # on [points[j], points[j+1])
    area = np.concatenate([[0.0], np.cumsum(active * np.diff(points))])
    lo, hi = np.searchsorted(points, intervals[:, 0]), np.searchsorted(points, intervals[:, 1])
    span = intervals[:, 1] - intervals[:, 0]
    return np.where(span > 0, (area[hi] - area[lo]) / np.where(span > 0, span, 1), 1.0)


@dataclass
class EngineFit:
    call_s: float
    prefill_s_per_token: float
    decode_step_s: float
    decode_step_s_per_seq: float
    warmup_s: float
    calls: int
    r2: float


def fit_engine(trajectories: list[dict[str, Any]], prefix_cache: bool) -> EngineFit:
    """Each call's seconds against [1, uncached context, sampled, sampled x calls beside it].

    One-off stalls are left out of the fit and measured apart, as `warmup_s`: the calls in flight
    while the run's first call ran (the engine's first steps build its kernels: `torch.compile`,
    a server's graphs), and calls that took over three times what the fit says (the built-in
    engine compiles a decode step once for each new batch size). Overlapping stalled calls are
    one stall: the longest excess of each overlapping run of them counts once."""
    rows, intervals = [], []
    for traj in trajectories:
        cached = 0
        for start, seconds, context, sampled in traj.get("timings", {}).get("generate") or []:
            rows.append((seconds, max(context - cached, 0), sampled))
            intervals.append((start, start + seconds))
            cached = context + sampled if prefix_cache else 0
    if len(rows) < 4:
        raise CalibrationError("too few model calls with timings to fit the engine (fewer than 4)",
                               hint="calibrate on a run of a few steps")
    spans = np.array(intervals)
    y = np.array([r[0] for r in rows])
    sampled = np.array([r[2] for r in rows], dtype=float)
    X = np.column_stack([np.ones(len(y)), [r[1] for r in rows], sampled, sampled * mean_concurrency(spans)])
    stalled = spans[:, 0] < spans[:, 1].min()
    coef = np.zeros(4)
    for _ in range(5):
        fit = ~stalled if (~stalled).sum() >= 4 else np.ones(len(y), dtype=bool)
        coef = robust_fit(X[fit], y[fit])
        if coef[2] + coef[3] <= 0:   # no token cost found: spread the calls' time over their tokens
            coef[2] = float(y[fit].sum() / max(sampled[fit].sum(), 1))
        slow = (y > 3 * (X @ coef) + 0.05) | (spans[:, 0] < spans[:, 1].min())
        if (slow == stalled).all():
            break
        stalled = slow
    resid = y[fit] - X[fit] @ coef
    r2 = 1 - float((resid ** 2).sum()) / max(float(((y[fit] - y[fit].mean()) ** 2).sum()), 1e-12)
    return EngineFit(float(coef[0]), float(coef[1]), max(float(coef[2]), 1e-6), float(coef[3]),
                     one_off_stalls(spans[stalled], (y - X @ coef)[stalled]), int(fit.sum()), r2)


def one_off_stalls(spans: np.ndarray, excess: np.ndarray) -> float:
    """Seconds of stalls: overlapping calls share one stall, the largest excess among them."""
    total, end, worst = 0.0, -np.inf, 0.0
    for (start, stop), extra in sorted(zip(spans.tolist(), excess.tolist())):
        if start > end:
            total, worst = total + worst, 0.0
        worst, end = max(worst, extra), max(end, stop)
    return max(total + worst, 0.0)


@dataclass
class TrainerFit:
    step_fixed_s: float
    step_s_per_position: float
    positions: list[int] = field(default_factory=list)


def fit_trainer(run: RunRecord, profiles: dict[str, RolloutProfile]) -> TrainerFit:
    """`train_seconds` of each step against the positions of the samples it trained."""
    slots, _ = slot_histories(run)
    by_step: dict[int, int] = defaultdict(int)
    for sid, h in slots.items():
        if h.step is not None and sid in run.trajectories:
            by_step[h.step] += sum(len(seg["token_ids"]) for seg in run.trajectories[sid].get("segments", []))
    steps = [r for r in run.rows if by_step.get(r["step"])]
    if not steps:
        raise CalibrationError(f"{run.path}: no trained step has its trajectories")
    X = np.column_stack([np.ones(len(steps)), [by_step[r["step"]] for r in steps]])
    y = np.array([r["train_seconds"] for r in steps])
    fixed, per = nonnegative_fit(X, y)
    ranks = run.config.trainer.ranks
    return TrainerFit(float(fixed), float(per) * ranks, [by_step[r["step"]] for r in steps])


def median(values, default: float = 0.0) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else default


def measured_figures(run: RunRecord) -> RunFigures:
    """The run's figures, computed as `atelier.sim.results.figures` computes the simulator's."""
    slots, _ = slot_histories(run)
    tokens: dict[int, int] = defaultdict(int)
    for h in slots.values():
        if h.step is not None:
            tokens[h.step] += h.tokens
    steps = [StepRecord(r["step"], r["wall_s"], r["trainer_idle_s"], r["trainer_busy_s"], r["samples"],
                        {int(k): v for k, v in r.get("staleness_hist", {}).items()}, tokens[r["step"]])
             for r in run.rows]
    wall = run.summary["wall_s"] if run.summary else run.rows[-1]["wall_s"]
    return figures(steps, wall_s=wall, rollouts=sum(r["rollouts"] for r in run.rows),
                   failures=sum(r["rollout_failures"] for r in run.rows))


def server_start_s(run: RunRecord) -> float | None:
    """How long the run's vLLM server took to start (to its first healthy answer), as the server's
    log records it (`atelier.inference.vllm_server.STARTED_IN`); None without one."""
    log = run.path / "vllm" / "vllm-server.log"
    if not log.is_file():
        return None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(STARTED_IN):
            return float(line[len(STARTED_IN):].split()[0])
    return None
