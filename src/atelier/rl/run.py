"""`run_training(config, run_dir, resume)`: the whole RL run, one screen of driver.

The driver is the trainer's thread:

    while (batch := reconciler.next_batch()) is not None:   # waits = trainer idle
        metrics = trainer.train_step(samples of batch)       # rollouts keep running
        checkpoint (every N steps; the rename commits the step)
        weight_sync.publish(weights, step); backend.update_weights(step)
        reconciler.commit(batch, step)                       # ledger: trained; admit more

Order matters: the checkpoint (which lists the batch's slots) is written
before the ledger marks them trained, and weights are live in the engine
before the reconciler admits groups at the new version. A `kill -9` between
any two lines resumes exactly: see `atelier.rl.checkpoint` and
`atelier.rl.ledger`.

Run directory: config.toml (resolved), ledger.jsonl, metrics.jsonl,
rollouts/<slot>.json (trajectories), checkpoints/step-<k>/, weights/ (delta
chain, when used), summary.json.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from atelier.config import dump_config
from atelier.errors import AtelierError
from atelier.rl.checkpoint import latest_checkpoint, read_meta, restore_rng, save_checkpoint
from atelier.rl.config import TrainConfig
from atelier.rl.curriculum import Curriculum
from atelier.rl.env import make_environment
from atelier.rl.ledger import Ledger
from atelier.rl.metrics import MetricsWriter, make_loggers, step_metrics
from atelier.rl.reconciler import Reconciler
from atelier.rl.sample import samples_from_trajectory
from atelier.rl.weight_sync import DeltaChainWeightSync, InProcessWeightSync


class RunDirError(AtelierError):
    """A run directory that cannot be started or resumed."""


@dataclass
class TrainSummary:
    run_dir: str
    steps: int
    mode: str
    wall_s: float
    reward_first: float | None
    reward_last: float | None
    trainer_idle_fraction: float
    gen_tokens_per_s: float
    ledger: dict[str, int]
    checkpoint: str | None
    metrics: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("metrics")
        return out


def resolve_model_dir(spec: str, run_dir: Path) -> Path:
    if spec == "tiny":
        from atelier.inference.tiny import build_tiny_model

        target = run_dir / "base-model"
        if not (target / "config.json").exists():
            build_tiny_model(target)
        return target
    from atelier.inference.models import resolve_model

    return resolve_model(spec)


def prepare_run_dir(config: TrainConfig, run_dir: Path, resume: bool) -> None:
    if resume:
        if not (run_dir / "config.toml").exists():
            raise RunDirError(f"{run_dir} is not a run directory (no config.toml)",
                              hint="pass the directory a previous `atelier train` wrote")
        return
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunDirError(f"run directory {run_dir} already exists and is not empty",
                          hint=f"resume it with --resume {run_dir}, or pick a new --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_config(config))


def make_backend(config: TrainConfig, env, model_path: Path, version: int, reader, chain_root: Path | None):
    if config.launcher == "ray":
        from atelier.rl.ray_launcher import RayBackend

        return RayBackend(config, model_path, version, chain_root=chain_root, reader=reader)
    from atelier.inference.engine import LocalEngine
    from atelier.rl.backends import LocalBackend

    engine = LocalEngine(model_path, version=version, max_batch=max(8, config.rollout.workers),
                         prefix_cache_tokens=config.rollout.prefix_cache_tokens)
    return LocalBackend(env, engine, reader, config.rollout.workers)


def run_training(config: TrainConfig, run_dir: str | Path, resume: bool = False,
                 on_step: Callable[[dict[str, Any]], None] | None = None) -> TrainSummary:
    """Train until the epoch (or `trainer.steps`) is done; resumable after any crash."""
    from atelier.rl.trainer import Trainer

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    run_dir = Path(run_dir)
    prepare_run_dir(config, run_dir, resume)
    loggers = make_loggers(config.loggers, run_dir, config.model_dump(mode="json"))
    base = resolve_model_dir(config.model, run_dir)
    ckpt = latest_checkpoint(run_dir) if resume else None
    step = read_meta(ckpt)["step"] if ckpt else 0
    model_path = ckpt / "model" if ckpt else base
    trainer = Trainer(model_path, config.trainer, temperature=config.rollout.temperature, step=step)
    if ckpt:
        trainer.load_optimizer(ckpt)
        restore_rng(ckpt)
    ledger = Ledger.load(run_dir / "ledger.jsonl", committed_step=step)
    if ckpt:  # the checkpoint committed these even if the ledger line never made it to disk
        for sid in read_meta(ckpt).get("trained_slots", []):
            if ledger.slots[sid].state != "trained":
                ledger.set(sid, "trained", step=step)

    if config.sync.kind == "delta":
        root = Path(config.sync.dir) if config.sync.dir else run_dir / "weights"
        writer = DeltaChainWeightSync(root, full_every=config.sync.full_every)
        writer.truncate_after(step)
        reader = DeltaChainWeightSync(root, full_every=config.sync.full_every)
    else:
        root = None
        writer = reader = InProcessWeightSync()
    if (writer.latest() or (None, -1))[1] != step:  # readers start from the trainer's weights
        writer.publish(_published(trainer.state_dict(), config.sync.dtype), step)

    env = make_environment(config.env, config.rollout, config.shaping, config.seed)
    backend = make_backend(config, env, model_path, step, reader, root)
    tokenizer = _tokenizer(model_path)
    reconciler = Reconciler(ledger=ledger, tasks=env.tasks(), category=env.category, backend=backend,
                            cfg=config.rollout, curriculum=Curriculum(config.curriculum),
                            rollouts_dir=run_dir / "rollouts", seed=config.seed, version=step,
                            total_steps=config.trainer.steps)
    writer_metrics = MetricsWriter(run_dir / "metrics.jsonl")
    idle_total = busy_total = 0.0
    try:
        reconciler.start()
        while True:
            t0 = time.perf_counter()
            batch = reconciler.next_batch()
            if batch is None:
                break
            t1 = time.perf_counter()
            trajs = {sid: reconciler.load_trajectory(sid) for sid in batch.slot_ids}
            samples = [s for sid, traj in trajs.items()
                       for s in samples_from_trajectory(traj, ledger.slots[sid].advantage or 0.0,
                                                        ledger.slots[sid].group_id)]
            train = trainer.train_step(samples)
            step = trainer.step
            if step % config.trainer.checkpoint_every == 0:
                save_checkpoint(run_dir, step, trainer, tokenizer,
                                {"trained_slots": batch.slot_ids, "cursor": sorted(ledger.task_ids())})
            sync = writer.publish(_published(trainer.state_dict(), config.sync.dtype), step)
            ts = time.perf_counter()
            backend.update_weights(step)
            engine_swap_s = time.perf_counter() - ts
            reconciler.commit(batch, step)
            t2 = time.perf_counter()
            idle_total += t1 - t0
            busy_total += t2 - t1
            record = step_metrics(step=step, batch_groups=[g.group_id for g in batch.groups], trajs=trajs,
                                  ledger=ledger, train=train, sync=sync, engine_swap_s=engine_swap_s,
                                  counters=reconciler.take_counters(), idle_s=t1 - t0, busy_s=t2 - t1,
                                  wall_s=time.perf_counter() - start, mode=config.rollout.mode)
            writer_metrics.write(record)
            for log in loggers:
                log(record)
            if on_step is not None:
                on_step(record)
        last = latest_checkpoint(run_dir)
        if trainer.step and (last is None or read_meta(last)["step"] < trainer.step):
            save_checkpoint(run_dir, trainer.step, trainer, tokenizer,
                            {"trained_slots": [], "cursor": sorted(ledger.task_ids())})
    finally:
        reconciler.close()
        backend.close()
        ledger.close()
    rows = writer_metrics.read_all()
    summary = TrainSummary(
        run_dir=str(run_dir), steps=trainer.step, mode=config.rollout.mode,
        wall_s=time.perf_counter() - start,
        reward_first=rows[0]["reward_mean"] if rows else None,
        reward_last=rows[-1]["reward_mean"] if rows else None,
        trainer_idle_fraction=idle_total / max(idle_total + busy_total, 1e-9),
        gen_tokens_per_s=sum(r["gen_tokens"] for r in rows) / max(sum(r["interval_s"] for r in rows), 1e-9)
        if rows else 0.0,
        ledger=ledger.counts(), checkpoint=str(latest_checkpoint(run_dir) or "") or None, metrics=rows)
    (run_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=1) + "\n")
    return summary


def _published(state_dict, dtype: str):
    if dtype == "same":
        return state_dict
    import torch

    return {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v for k, v in state_dict.items()}


def _tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
