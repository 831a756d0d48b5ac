"""What a run did, simulated or measured, in the same figures.

`RunFigures` is what the simulator predicts and what `measured_figures` reads from a real run
directory, computed the same way from both so that a prediction and a measurement compare
like for like:

- `wall_s`: from the run's start (`atelier.rl.run.open_run`) to its summary;
- `steady_samples_per_s`: samples trained per second after the first step (start-up and the
  first batch's generation left out): the pipeline's throughput;
- `tokens_per_s`: sampled tokens of the trained samples per second of the whole run;
- `step_s`: mean seconds between two steps after the first;
- `trainer_idle_fraction`: of the time from the first wait for a batch to the last step;
- `staleness`: the fraction of trained tokens sampled 0, 1, 2 ... versions before the step.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class StepRecord:
    step: int
    end_s: float
    idle_s: float
    busy_s: float
    samples: int
    staleness: dict[int, float]
    tokens: int = 0


@dataclass
class RunFigures:
    wall_s: float
    steps: int
    samples: int
    steady_samples_per_s: float
    tokens_per_s: float
    step_s: float
    trainer_idle_fraction: float
    staleness: dict[str, float] = field(default_factory=dict)
    rollouts: int = 0
    failures: int = 0
    dropped_groups: int = 0
    stops: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 4)
        out["staleness"] = {k: round(v, 4) for k, v in self.staleness.items()}
        return out


def figures(steps: Sequence[StepRecord], *, wall_s: float, rollouts: int = 0, failures: int = 0,
            dropped_groups: int = 0, stops: Sequence[str] = ()) -> RunFigures:
    """The figures of a run from its steps (in order); see the module docstring."""
    samples = sum(s.samples for s in steps)
    stale: Counter = Counter()
    for s in steps:
        stale.update({int(k): v for k, v in s.staleness.items()})
    total = sum(stale.values()) or 1.0
    if len(steps) > 1:
        span = steps[-1].end_s - steps[0].end_s
        steady = sum(s.samples for s in steps[1:]) / span if span > 0 else 0.0
        step_s = span / (len(steps) - 1)
    else:
        steady, step_s = 0.0, 0.0
    idle, busy = sum(s.idle_s for s in steps), sum(s.busy_s for s in steps)
    return RunFigures(
        wall_s=wall_s, steps=len(steps), samples=samples, steady_samples_per_s=steady,
        tokens_per_s=sum(s.tokens for s in steps) / wall_s if wall_s > 0 else 0.0, step_s=step_s,
        trainer_idle_fraction=idle / (idle + busy) if idle + busy > 0 else 0.0,
        staleness={str(k): v / total for k, v in sorted(stale.items())}, rollouts=rollouts, failures=failures,
        dropped_groups=dropped_groups, stops=list(stops))


@dataclass
class SimResult:
    figures: RunFigures
    steps: list[StepRecord]

    @classmethod
    def build(cls, cfg, now: float, ledger, clock) -> "SimResult":
        steps = list(clock.steps)
        fig = figures(steps, wall_s=now, rollouts=ledger.rollouts, failures=ledger.failures,
                      dropped_groups=sum(ledger.dropped.values()), stops=clock.stops)
        return cls(fig, steps)


def relative_error(predicted: float, measured: float) -> float | None:
    """(predicted - measured) / measured; None when nothing was measured."""
    if not measured:
        return None
    return (predicted - measured) / measured


def compare(predicted: RunFigures, measured: RunFigures) -> dict[str, Any]:
    """Each figure predicted against measured, with the relative error of the scalar ones and the
    total variation distance between the staleness distributions."""
    out: dict[str, Any] = {}
    for key in ("wall_s", "steady_samples_per_s", "tokens_per_s", "step_s", "trainer_idle_fraction"):
        p, m = getattr(predicted, key), getattr(measured, key)
        err = relative_error(p, m)
        out[key] = {"predicted": round(p, 4), "measured": round(m, 4),
                    "relative_error": None if err is None else round(err, 4)}
    keys = set(predicted.staleness) | set(measured.staleness)
    tv = 0.5 * sum(abs(predicted.staleness.get(k, 0.0) - measured.staleness.get(k, 0.0)) for k in keys)
    out["staleness"] = {"predicted": predicted.to_dict()["staleness"], "measured": measured.to_dict()["staleness"],
                        "total_variation": round(tv, 4)}
    return out


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
