"""Projection: a cluster file swept over what a planner chooses, and over what goes wrong.

`run_sweep` simulates, from one cluster file:
- the split of a fixed number of GPUs between training and inference (`ranks` trainer ranks
  of `gpus_per_rank`, `replicas` of `gpus_per_replica`; the rollouts at once follow the
  replicas when `inference.workers_per_replica` is set), for each total GPU count asked;
- the staleness bound at the best split of the first total, and sync mode beside it;
- the async-over-sync speed-up at each total's best split;
- the cost of outages at the file's own split: an inference replica (or region) down, a
  sandbox host (or region) down, the trainer's node lost, each `outage_s` long from 40% of
  the way through the run: the wall time and the throughput lost against the same run without it.

Everything else (step times, rollout shapes, bandwidths) is the file's; its `[sources]` say which
numbers are measured, published or assumed, and `sweep.json` repeats them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from atelier.config import load_config
from atelier.sim.cluster import FaultSpec, SimConfig
from atelier.sim.plots import plot_outages, plot_speedup, plot_split, plot_staleness
from atelier.sim.predict import simulate
from atelier.sim.results import RunFigures, write_json


def with_split(base: SimConfig, gpus: int, inference_share: float, groups_per_gpu: float = 0.0) -> SimConfig | None:
    """`base` with `gpus` GPUs split so that about `inference_share` serve inference (None when one
    side would get no whole rank or replica); with `groups_per_gpu`, the batch grows with the
    cluster (`rollout.groups_per_step` = that many groups per GPU, at least one)."""
    t, i = base.trainer, base.inference
    replicas = int(round(gpus * inference_share / i.gpus_per_replica))
    ranks = int((gpus - replicas * i.gpus_per_replica) // t.gpus_per_rank)
    if replicas < 1 or ranks < 1:
        return None
    cfg = base.model_copy(update={"trainer": t.model_copy(update={"ranks": ranks}),
                                  "inference": i.model_copy(update={"replicas": replicas})})
    if groups_per_gpu:
        cfg = with_rollout(cfg, groups_per_step=max(1, round(groups_per_gpu * gpus)))
    return cfg


def with_rollout(base: SimConfig, **fields: Any) -> SimConfig:
    return base.model_copy(update={"rollout": base.rollout.model_copy(update=fields)})


def _row(cfg: SimConfig, fig: RunFigures, **keys: Any) -> dict[str, Any]:
    mean_stale = sum(int(k) * v for k, v in fig.staleness.items())
    return {**keys, "ranks": cfg.trainer.ranks, "replicas": cfg.inference.replicas, "workers": cfg.workers(),
            "wall_s": round(fig.wall_s, 1), "samples_per_s": round(fig.steady_samples_per_s, 5),
            "tokens_per_s": round(fig.tokens_per_s, 2), "step_s": round(fig.step_s, 2),
            "trainer_idle_fraction": round(fig.trainer_idle_fraction, 3), "mean_staleness": round(mean_stale, 3),
            "staleness": fig.to_dict()["staleness"], "stops": fig.stops}


def split_sweep(base: SimConfig, totals: Sequence[int], shares: Sequence[float],
                groups_per_gpu: float = 0.0) -> list[dict[str, Any]]:
    rows = []
    for gpus in totals:
        for share in shares:
            cfg = with_split(base, gpus, share, groups_per_gpu)
            if cfg is not None:
                rows.append(_row(cfg, simulate(cfg).figures, gpus=gpus, inference_share=share,
                                 groups_per_step=cfg.rollout.groups_per_step))
    return rows


def best_split(rows: list[dict[str, Any]], gpus: int) -> dict[str, Any]:
    return max((r for r in rows if r["gpus"] == gpus), key=lambda r: r["samples_per_s"])


def staleness_sweep(cfg: SimConfig, bounds: Sequence[int]) -> list[dict[str, Any]]:
    rows = [_row(cfg, simulate(with_rollout(cfg, mode="sync")).figures, mode="sync", max_staleness=0)]
    for bound in bounds:
        run = with_rollout(cfg, mode="async", max_staleness=bound)
        rows.append(_row(run, simulate(run).figures, mode="async", max_staleness=bound))
    return rows


def outage_costs(base: SimConfig, outage_s: float) -> list[dict[str, Any]]:
    clean = simulate(base).figures
    at = round(0.4 * clean.wall_s, 1)
    scenarios = {"none": []}
    inf_regions = sorted(set(base.inference.regions))
    scenarios["inference replica down" if not inf_regions else f"inference region {inf_regions[0]} down"] = [
        FaultSpec(kind="inference_down", at_s=at, duration_s=outage_s,
                  **({"region": inf_regions[0]} if inf_regions else {"target": 0}))]
    host_regions = sorted(set(base.sandboxes.regions))
    scenarios["sandbox host down" if not host_regions else f"sandbox region {host_regions[0]} down"] = [
        FaultSpec(kind="sandbox_down", at_s=at, duration_s=outage_s,
                  **({"region": host_regions[0]} if host_regions else {"target": 0}))]
    scenarios["trainer node lost"] = [FaultSpec(kind="trainer_lost", at_s=at, duration_s=outage_s)]
    rows = []
    for name, faults in scenarios.items():
        fig = clean if not faults else simulate(base.model_copy(update={"faults": faults})).figures
        # a run the outage stopped (the failure breaker) did not finish: its wall time is no cost
        finished = fig.steps >= clean.steps
        rows.append({**_row(base, fig, outage=name, at_s=at, outage_s=0 if not faults else outage_s),
                     "extra_wall_s": round(fig.wall_s - clean.wall_s, 1) if finished else None,
                     "steps_done": fig.steps, "run_stopped": not finished})
    return rows


def run_sweep(cluster: Path, out: Path, *, overrides: Sequence[str] = (), gpus: Sequence[int] = (),
              staleness: Sequence[int] = (0, 1, 2, 4), shares: Sequence[float] = (0.25, 0.5, 0.75),
              outage_s: float = 600.0, groups_per_gpu: float = 0.0) -> dict[str, Any]:
    base = load_config(SimConfig, cluster, overrides)
    own = base.trainer.ranks * base.trainer.gpus_per_rank + base.inference.replicas * base.inference.gpus_per_replica
    totals = list(gpus) or [own]
    split = split_sweep(base, totals, shares, groups_per_gpu)
    if not split:
        raise ValueError("no split of the GPUs asked for gives both sides a whole rank and replica")
    bests = {g: best_split(split, g) for g in totals if any(r["gpus"] == g for r in split)}
    speedups = {}
    for g, best in bests.items():
        cfg = with_split(base, g, best["inference_share"], groups_per_gpu)
        sync = simulate(with_rollout(cfg, mode="sync")).figures
        speedups[g] = round(best["samples_per_s"] / sync.steady_samples_per_s, 3) if sync.steady_samples_per_s else None
    first = with_split(base, totals[0], bests[totals[0]]["inference_share"], groups_per_gpu)
    stale = staleness_sweep(first, staleness)
    outages = outage_costs(base, outage_s)
    out.mkdir(parents=True, exist_ok=True)
    plots = [plot_split(split, out / "split.png", base.name), plot_staleness(stale, out / "staleness.png", base.name),
             plot_speedup(speedups, out / "speedup.png", base.name),
             plot_outages(outages, out / "outages.png", base.name)]
    keep = ("inference_share", "ranks", "replicas", "groups_per_step", "samples_per_s", "mean_staleness")
    headline = {"cluster": base.name, "best_split": {str(g): {k: b[k] for k in keep}
                                                     for g, b in bests.items()},
                "async_over_sync": {str(g): s for g, s in speedups.items()},
                "outage_extra_wall_s": {r["outage"]: r["extra_wall_s"] if not r["run_stopped"] else
                                        f"the run stopped after step {r['steps_done']}"
                                        for r in outages if r["outage"] != "none"}}
    report = {"headline": headline, "split": split, "staleness": stale, "outages": outages,
              "sources": base.sources, "plots": [str(p.name) for p in plots]}
    write_json(out / "sweep.json", report)
    return report
