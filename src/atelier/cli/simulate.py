"""`atelier simulate …`: the RL pipeline simulated (SimPy), calibrated on real runs.

    atelier simulate calibrate RUN_DIR [--recipe R.toml] [--out cluster.toml]
    atelier simulate run CLUSTER.toml [--set key=value] [--fault inference_down:120:60]
    atelier simulate check RUN_DIR --from CALIBRATION_RUN_DIR
    atelier simulate sweep CLUSTER.toml --out DIR [--gpus 64,128] [--staleness 0,1,2]

Imports only typer at the top; the simulator (SimPy, numpy) is imported inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atelier.cli.options import SET_HELP

simulate_app = typer.Typer(help="Simulate the asynchronous RL pipeline, calibrated on real runs.",
                           no_args_is_help=True)

FAULT_HELP = ("A fault, KIND:AT_S[:DURATION_S[:TARGET]] with KIND inference_down, sandbox_down or trainer_lost "
              "and AT_S seconds or stepK (once step K is written), e.g. inference_down:120:90 (repeatable).")


def _faults(specs: List[str]):
    from atelier.sim.commands import parse_fault

    return [parse_fault(s) for s in specs]


@simulate_app.command("calibrate")
def calibrate_cmd(
    run_dir: Path = typer.Argument(..., help="A run directory of `atelier train` (or `atelier run`'s rl/)."),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="Simulate this recipe instead of the run's own."),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP.format(example="rollout.mode=sync")),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the cluster file (TOML) here."),
    as_json: bool = typer.Option(False, "--json", help="Print the calibration as one JSON object."),
) -> None:
    """Measure a run's components (rollouts, engine, trainer, sync) and write a cluster file
    that simulates its recipe, or another recipe, with them. Example:
    atelier simulate calibrate runs/rl-tiny --recipe recipes/rl-tiny.toml --set rollout.mode=sync --out sync.toml"""
    from atelier.sim.commands import calibrated_cluster, write_cluster

    calibration, cluster = calibrated_cluster(run_dir, recipe, overrides)
    if out is not None:
        write_cluster(cluster, out)
    described = calibration.describe()
    typer.echo(json.dumps(described, indent=None if as_json else 1))
    if out is not None and not as_json:
        typer.echo(f"cluster file: {out}  (atelier simulate run {out})", err=True)


@simulate_app.command("run")
def run_cmd(
    cluster: Path = typer.Argument(..., help="A cluster file (TOML), e.g. recipes/clusters/coder-7b.toml."),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP.format(example="rollout.max_staleness=2")),
    fault: List[str] = typer.Option([], "--fault", help=FAULT_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
) -> None:
    """Simulate a cluster: wall time, throughput, trainer idle time, staleness of trained tokens.
    Example: atelier simulate run recipes/clusters/coder-7b.toml --fault inference_down:300:120"""
    from atelier.config import load_config
    from atelier.sim.cluster import SimConfig
    from atelier.sim.commands import figures_table
    from atelier.sim.predict import simulate

    config = load_config(SimConfig, cluster, overrides)
    config = config.model_copy(update={"faults": [*config.faults, *_faults(fault)]})
    figures = simulate(config).figures
    if as_json:
        typer.echo(json.dumps(figures.to_dict()))
    else:
        typer.echo(figures_table(config, figures))


@simulate_app.command("check")
def check_cmd(
    run_dir: Path = typer.Argument(..., help="The run to predict and compare with."),
    calibration: Path = typer.Option(..., "--from", help="The run whose components calibrate the simulator."),
    fault: List[str] = typer.Option([], "--fault", help=FAULT_HELP + " Times count from the run's start."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as one JSON object."),
) -> None:
    """Predict RUN_DIR's recipe from another run's components and compare each figure with what
    RUN_DIR measured (relative errors; staleness by total variation). Example:
    atelier simulate check runs/rl-sync --from runs/rl"""
    from atelier.sim.commands import check

    result = check(run_dir, calibration, _faults(fault))
    typer.echo(json.dumps(result, indent=None if as_json else 1))


@simulate_app.command("sweep")
def sweep_cmd(
    cluster: Path = typer.Argument(..., help="A cluster file (TOML)."),
    out: Path = typer.Option(..., "--out", help="Where the JSON and the plots go."),
    gpus: str = typer.Option("", "--gpus", help="Total GPU counts to sweep, e.g. 8,64,512 (default: the file's)."),
    staleness: str = typer.Option("0,1,2,4", "--staleness", help="Staleness bounds to sweep."),
    shares: str = typer.Option("0.25,0.375,0.5,0.625,0.75", "--inference-share",
                               help="Fractions of the GPUs given to inference."),
    outage_s: float = typer.Option(600.0, "--outage-s", help="Length of the outages whose cost is simulated."),
    groups_per_gpu: float = typer.Option(0.0, "--groups-per-gpu",
                                         help="Grow the batch with the cluster: this many groups a step per GPU "
                                              "(0: the file's groups_per_step)."),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP.format(example="steps=6")),
) -> None:
    """Throughput and staleness against the GPU split and the staleness bound, async over sync,
    the cost of outages; writes sweep.json and PNG plots into --out. Example:
    atelier simulate sweep recipes/clusters/coder-7b.toml --gpus 8,64,512 --out sweep"""
    from atelier.sim.commands import parse_list
    from atelier.sim.sweep import run_sweep

    report = run_sweep(cluster, out, overrides=overrides, gpus=parse_list(gpus, int, "--gpus"),
                       staleness=parse_list(staleness, int, "--staleness"),
                       shares=parse_list(shares, float, "--inference-share"), outage_s=outage_s,
                       groups_per_gpu=groups_per_gpu)
    typer.echo(json.dumps(report["headline"], indent=1))
    typer.echo(f"wrote {out / 'sweep.json'} and {len(report['plots'])} plots", err=True)
