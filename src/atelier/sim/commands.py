"""What `atelier simulate`'s commands do, apart from parsing their arguments (`atelier.cli.simulate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from pydantic import ValidationError

from atelier.config import dump_config, load_config
from atelier.errors import AtelierError
from atelier.fsio import atomic_write
from atelier.rl.config import TrainConfig
from atelier.sim.calibrate import measured_figures, read_run
from atelier.sim.cluster import FaultSpec, SimConfig
from atelier.sim.predict import Calibration, calibrate, cluster_for, simulate
from atelier.sim.results import RunFigures, compare

T = TypeVar("T")


class SimulateError(AtelierError):
    """An argument of `atelier simulate` that cannot be used."""


def parse_fault(text: str) -> FaultSpec:
    """KIND:AT_S[:DURATION_S[:TARGET]] -> FaultSpec; AT_S may be `stepK` (once step K is written)."""
    parts = text.split(":")
    try:
        if not 2 <= len(parts) <= 4:
            raise ValueError("wrong number of fields")
        when = ({"after_step": int(parts[1][4:])} if parts[1].startswith("step") else {"at_s": float(parts[1])})
        fields: dict[str, Any] = {"kind": parts[0], **when}
        if len(parts) > 2:
            fields["duration_s"] = float(parts[2])
        if len(parts) > 3:
            fields["target"] = int(parts[3])
        return FaultSpec(**fields)
    except (ValueError, ValidationError) as exc:
        raise SimulateError(f"--fault {text!r} is not a fault ({str(exc).splitlines()[0]})",
                            hint="write KIND:AT_S[:DURATION_S[:TARGET]], KIND one of inference_down, "
                                 "sandbox_down, trainer_lost, AT_S seconds or stepK, e.g. --fault "
                                 "inference_down:120:90 or --fault inference_down:step4") from None


def parse_list(text: str, kind: Callable[[str], T], option: str) -> list[T]:
    """'1,2,4' -> [1, 2, 4] ('' -> [])."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SimulateError(f"{option} {text!r} is not a comma-separated list of numbers",
                            hint=f"e.g. {option} 1,2,4") from None


def calibrated_cluster(run_dir: Path, recipe: Path | None, overrides: Sequence[str]) -> tuple[Calibration, SimConfig]:
    """The calibration of `run_dir` and the cluster of `recipe` (default: the run's own config)."""
    calibration = calibrate(run_dir)
    source = recipe if recipe is not None else Path(run_dir) / "config.toml"
    config = load_config(TrainConfig, source, overrides)
    return calibration, cluster_for(config, calibration)


def write_cluster(cluster: SimConfig, out: Path) -> None:
    atomic_write(out, "# written by `atelier simulate calibrate`; [sources] says where each number comes from\n"
                 + dump_config(cluster))


def check(run_dir: Path, calibration_dir: Path, faults: Sequence[FaultSpec] = ()) -> dict[str, Any]:
    """Predict `run_dir`'s recipe from `calibration_dir`'s components; compare with what it measured."""
    target = read_run(run_dir)
    calibration = calibrate(calibration_dir)
    cluster = cluster_for(target.config, calibration, faults)
    predicted = simulate(cluster, calibration.groups).figures
    measured = measured_figures(target)
    return {"run": str(run_dir), "calibrated_on": str(calibration_dir), "predicted": predicted.to_dict(),
            "measured": measured.to_dict(), "errors": compare(predicted, measured)}


def figures_table(config: SimConfig, figures: RunFigures) -> str:
    """The figures as aligned lines of text, with the cluster's name."""
    staleness = ", ".join(f"{k}: {v:.0%}" for k, v in figures.staleness.items()) or "none trained"
    lines = [config.name or "simulated run",
             f"  wall time           {figures.wall_s:,.1f} s ({figures.steps} steps, {figures.samples} samples)",
             f"  throughput          {figures.steady_samples_per_s:,.3f} samples/s after the first step",
             f"  step                {figures.step_s:,.2f} s",
             f"  trainer idle        {figures.trainer_idle_fraction:.0%}",
             f"  tokens/s            {figures.tokens_per_s:,.1f} (sampled, trained)",
             f"  staleness           {staleness}",
             f"  rollouts            {figures.rollouts} ({figures.failures} failed, "
             f"{figures.dropped_groups} groups dropped)"]
    lines += [f"  stopped             {s}" for s in figures.stops]
    return "\n".join(lines)
