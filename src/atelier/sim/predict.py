"""A recipe's run predicted from a calibration: the recipe's pipeline, the measured components.

`calibrate(run_dir)` measures the components of one run (`atelier.sim.calibrate`);
`cluster_for(config, calibration)` builds the cluster the simulator runs for any recipe (a
`TrainConfig`): its shape (mode, groups, staleness bound, workers, retries, steps, ranks,
checkpoint and sync cadence) from the recipe, every time and size from the calibration, each
number's source recorded in `sources`. What a single-rank run cannot measure (the gradient
all-reduce of several ranks, a killed server's restart) comes from the calibration where it has
it (a server's start) and is marked assumed where it does not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from atelier.rl.config import TrainConfig
from atelier.sim.calibrate import (
    EngineFit,
    RunRecord,
    TrainerFit,
    fit_engine,
    fit_trainer,
    group_profiles,
    median,
    read_run,
    server_start_s,
    slot_histories,
)
from atelier.sim.cluster import FaultSpec, HostSpec, InferenceSpec, SandboxSpec, SimConfig, SyncSpec, TrainerSpec
from atelier.sim.pipeline import Pipeline
from atelier.sim.results import SimResult
from atelier.sim.workload import GroupProfile, ParametricWorkload, ReplayedWorkload

COLLECTIVE_BYTES_PER_S = 2e9
"""Assumed: a gloo all-reduce between processes of one host, through shared memory."""


@dataclass
class Calibration:
    run_dir: Path
    engine_kind: str
    groups: list[GroupProfile]
    engine: EngineFit
    trainer: TrainerFit
    startup_s: float
    shutdown_s: float
    step_overhead_s: float
    checkpoint_s: float
    swap_s: float
    sync_kind: str
    full_bytes: float
    delta_bytes: float
    publish_fixed_s: float
    upload_bytes_per_s: float
    grad_bytes: float
    server_start_s: float | None = None
    """A vLLM server's start, read from the run's server log (None: the built-in engine)."""
    cores: int = 0
    """CPU cores of the machine the run ran on (taken as the one calibrating), 0 on GPUs."""

    def describe(self) -> dict:
        e, t = self.engine, self.trainer
        return {"run_dir": str(self.run_dir), "engine": self.engine_kind, "groups": len(self.groups),
                "server_start_s": self.server_start_s,
                "rollouts": sum(len(g) for g in self.groups), "startup_s": round(self.startup_s, 3),
                "shutdown_s": round(self.shutdown_s, 3),
                "engine_fit": {"calls": e.calls, "r2": round(e.r2, 3), "call_s": e.call_s,
                               "prefill_s_per_token": e.prefill_s_per_token, "decode_step_s": e.decode_step_s,
                               "decode_step_s_per_seq": e.decode_step_s_per_seq, "warmup_s": e.warmup_s},
                "trainer_fit": {"step_fixed_s": t.step_fixed_s, "step_s_per_position": t.step_s_per_position},
                "step_overhead_s": self.step_overhead_s, "checkpoint_s": self.checkpoint_s, "swap_s": self.swap_s,
                "sync": {"kind": self.sync_kind, "full_bytes": self.full_bytes, "delta_bytes": self.delta_bytes,
                         "publish_fixed_s": self.publish_fixed_s, "upload_bytes_per_s": self.upload_bytes_per_s}}


def calibrate(run_dir: str | Path) -> Calibration:
    run = read_run(run_dir)
    groups = group_profiles(run)
    cfg = run.config
    prefix = cfg.inference.engine == "vllm" or cfg.rollout.prefix_cache_tokens > 0
    engine = fit_engine(list(run.trajectories.values()), prefix_cache=prefix)
    trainer = fit_trainer(run, {})
    rows = run.rows
    every = cfg.trainer.checkpoint_every
    residual = {r["step"]: r["trainer_busy_s"] - r["train_seconds"] - r["sync_seconds"] - r["engine_swap_s"]
                for r in rows}
    plain = [v for s, v in residual.items() if s % every]
    ckpt = [v for s, v in residual.items() if s % every == 0]
    overhead = max(median(plain), 0.0)
    kinds = {k: [r for r in rows if r["sync_kind"] == k] for k in ("full", "delta", "inprocess")}
    moved = sum(r["sync_bytes"] for r in rows if r["sync_kind"] != "inprocess")
    seconds = sum(r["sync_seconds"] for r in rows if r["sync_kind"] != "inprocess")
    return Calibration(
        run_dir=run.path, engine_kind=cfg.inference.engine, groups=groups, engine=engine, trainer=trainer,
        startup_s=max(rows[0]["wall_s"] - rows[0]["interval_s"], 0.0),
        shutdown_s=max((run.summary or {}).get("wall_s", rows[-1]["wall_s"]) - rows[-1]["wall_s"], 0.0),
        step_overhead_s=overhead, checkpoint_s=max(median(ckpt) - overhead, 0.0),
        swap_s=median(r["engine_swap_s"] for r in rows),
        sync_kind=cfg.sync.kind,
        full_bytes=median((r["sync_bytes"] for r in kinds["full"]), _full_file_bytes(run)),
        delta_bytes=median(r["sync_bytes"] for r in kinds["delta"]),
        publish_fixed_s=median(r["sync_seconds"] for r in kinds["inprocess"]),
        upload_bytes_per_s=moved / seconds / cfg.trainer.ranks if seconds else 0.0,
        grad_bytes=_model_bytes(run), server_start_s=server_start_s(run),
        cores=0 if cfg.trainer.device == "cuda" else os.cpu_count() or 1)


def _full_file_bytes(run: RunRecord) -> float:
    fulls = sorted((run.path / "weights").glob("*.full")) if (run.path / "weights").is_dir() else []
    return float(fulls[-1].stat().st_size) if fulls else 0.0


def _model_bytes(run: RunRecord) -> float:
    """The trained weights' bytes (fp32 gradients of the same count): the newest checkpoint's model."""
    models = sorted(run.path.glob("checkpoints/step-*/model/model.safetensors"))
    return float(models[-1].stat().st_size) if models else 0.0


def epoch_tasks(config: TrainConfig) -> int:
    """Tasks in the recipe's epoch when the recipe says (0: unknown, the step budget bounds the run)."""
    if config.env.kind == "toy":
        return config.env.toy.tasks
    if config.env.kind == "tasks" and config.env.tasks is not None and config.env.tasks.tasks is not None:
        return len(config.env.tasks.tasks)
    return 0


def cluster_for(config: TrainConfig, cal: Calibration, faults: Sequence[FaultSpec] = ()) -> SimConfig:
    """The simulated cluster of `config`'s run, every component as `cal` measured it."""
    measured = f"measured: {cal.run_dir.name}"
    e, t = cal.engine, config.trainer
    tasks = epoch_tasks(config)
    steps = t.steps or max(1, tasks // config.rollout.groups_per_step)
    inference = InferenceSpec(
        max_batch=max(8, config.rollout.workers), kv_tokens=config.rollout.kv_cache_tokens if cal.engine_kind != "vllm"
        else 0, decode_step_s=e.decode_step_s, decode_step_s_per_seq=e.decode_step_s_per_seq,
        prefill_s_per_token=e.prefill_s_per_token, call_s=e.call_s, warmup_s=e.warmup_s,
        prefix_cache=cal.engine_kind == "vllm" or config.rollout.prefix_cache_tokens > 0,
        swap_s=cal.swap_s, restart_s=cal.server_start_s if cal.server_start_s is not None else cal.startup_s)
    trainer = TrainerSpec(
        ranks=t.ranks, startup_s=cal.startup_s, shutdown_s=cal.shutdown_s, step_fixed_s=cal.trainer.step_fixed_s,
        step_s_per_position=cal.trainer.step_s_per_position, grad_bytes=cal.grad_bytes,
        collective_bytes_per_s=COLLECTIVE_BYTES_PER_S, step_overhead_s=cal.step_overhead_s,
        checkpoint_every=t.checkpoint_every, checkpoint_s=cal.checkpoint_s, restart_s=cal.startup_s)
    host = HostSpec()
    if cal.cores and config.trainer.device != "cuda":
        host = HostSpec(cores=cal.cores, trainer_cores=min(cal.cores, t.threads * t.ranks),
                        engine_cores=cal.cores if cal.engine_kind == "vllm" else 1.0)
    sync = SyncSpec(kind=config.sync.kind, full_every=config.sync.full_every, full_bytes=cal.full_bytes,
                    delta_bytes=cal.delta_bytes, publish_fixed_s=cal.publish_fixed_s,
                    upload_bytes_per_s=cal.upload_bytes_per_s)
    sources = {key: measured for key in (
        "trainer.startup_s", "trainer.shutdown_s", "trainer.step_fixed_s", "trainer.step_s_per_position",
        "trainer.step_overhead_s", "trainer.checkpoint_s", "trainer.grad_bytes", "inference.decode_step_s",
        "inference.decode_step_s_per_seq", "inference.prefill_s_per_token", "inference.call_s", "inference.swap_s",
        "inference.warmup_s",
        "sync.full_bytes", "sync.delta_bytes", "sync.publish_fixed_s", "sync.upload_bytes_per_s", "workload.run_dir")}
    sources["inference.restart_s"] = (f"measured: {cal.run_dir.name}'s vLLM server start (its log)"
                                      if cal.server_start_s is not None else
                                      f"measured: {cal.run_dir.name}'s start-up (the engine's start among it)")
    sources["trainer.restart_s"] = f"measured: {cal.run_dir.name}'s start-up"
    sources["trainer.collective_bytes_per_s"] = "assumed: gloo between processes of one host"
    sources["rollout"] = "the recipe"
    if host.cores:
        sources["host.cores"] = "measured: this machine's cores (the calibration run's, taken as the same)"
        sources["host.engine_cores"] = "assumed: the built-in engine drops to one thread when contended; vLLM's " \
                                       "CPU workers keep every core"
        sources["host.trainer_cores"] = "the recipe: trainer.threads x trainer.ranks"
    return SimConfig(name=f"{config.rollout.mode} run calibrated on {cal.run_dir.name}", seed=config.seed, steps=steps,
                     tasks=tasks, rollout=config.rollout, trainer=trainer, inference=inference,
                     sandboxes=SandboxSpec(), host=host, sync=sync, faults=list(faults), sources=sources,
                     workload={"run_dir": str(cal.run_dir)})


def simulate(cluster: SimConfig, groups: list[GroupProfile] | None = None) -> SimResult:
    """Run the cluster; a replayed workload's groups are read from its run directory unless given."""
    if cluster.workload.run_dir:
        if groups is None:
            groups = group_profiles(read_run(cluster.workload.run_dir))
        workload = ReplayedWorkload(groups)
    else:
        workload = ParametricWorkload(cluster.workload)
    return Pipeline(cluster, workload).run()


__all__ = ["Calibration", "calibrate", "cluster_for", "epoch_tasks", "simulate", "slot_histories"]
