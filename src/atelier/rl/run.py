"""`run_training(config, run_dir)`: the whole RL run, one screen of driver.

The driver is the trainer's thread:

    while (batch := reconciler.next_batch()) is not None:   # waits = trainer idle
        metrics = trainer.train_step(samples of batch)       # rollouts keep running
        checkpoint (every N steps)
        weight_sync.publish(weights, step); backend.update_weights(step)
        metrics.jsonl += the step's line                     # commits the step
        reconciler.commit(batch, step)                       # ledger: trained; admit more

Order matters: the checkpoint (which lists the batch's slots) is written
before the ledger marks them trained, and weights are live in the engine
before the reconciler admits groups at the new version. The step's line in
metrics.jsonl is its commit record: a run resumes from the newest checkpoint
whose line is written. It comes before `reconciler.commit`, so that nothing a
resumed run throws away (a checkpoint, published weights) was ever built on:
no group is admitted at version k before step k is committed, and the
checkpoint's `trained_slots` stand in for ledger events that a kill cut off.
A `kill -9` between any two lines resumes exactly: see
`atelier.rl.checkpoint`, `atelier.rl.ledger` and `atelier.rl.metrics`; each
line is a named crash point (`atelier.fsio.crash_point`) where the tests
kill the run.

The named steps, in the order `run_training` calls them: `open_run`
(`prepare_run_dir`, `restore_trainer`, `restore_ledger`, the weight sync
from `make_weight_sync`, `make_backend`, the `Reconciler`), then
`train_step` per batch, `save_final_checkpoint`, `write_summary`.

With `trainer.ranks = N` this function runs in N processes (`atelier train`
starts them; see `atelier.train.launch`): rank 0 is the driver above, the others
only follow its trainer calls (`atelier.rl.mirror`: every collective is
announced, then made, so all ranks enter the same collectives in the same
order) and return None. Nothing else in the driver changes.

Run directory: config.toml (resolved), ledger.jsonl, metrics.jsonl,
rollouts/<slot>.json (trajectories), checkpoints/step-<k>/, weights/ (delta
chain, when used), summary.json.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from atelier.fsio import atomic_write, crash_point
from atelier.inference.forward import threads
from atelier.inference.models import resolve_or_build_tiny
from atelier.rl.advantages import trained_samples
from atelier.rl.backends import make_backend
from atelier.rl.checkpoint import committed_checkpoint, latest_checkpoint, read_meta, save_checkpoint, start_rng
from atelier.rl.config import TrainConfig
from atelier.rl.curriculum import Curriculum
from atelier.rl.env import make_environment
from atelier.rl.ledger import Ledger
from atelier.rl.metrics import (
    MetricsWriter,
    committed_counts,
    make_loggers,
    sample_metrics,
    staleness_counts,
    step_metrics,
)
from atelier.rl.mirror import Commands, follow, lead
from atelier.rl.reconciler import Batch, Reconciler
from atelier.rl.trainer import Trainer
from atelier.rl.weight_sync import WeightSync, make_weight_sync, map_tensors
from atelier.rundir import freeze_config
from atelier.train.ranks import joined_ranks


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


def prepare_run_dir(config: TrainConfig, run_dir: Path) -> bool:
    """Freeze `config` in `run_dir`, or check it against the run there (`atelier.rundir`); True
    when the run is continued. A continued run may be given more (or fewer) `trainer.steps`."""
    return freeze_config(config, run_dir, command="atelier train", may_change=("trainer.steps",))


@dataclass
class Run:
    """What one RL run holds open, built by `open_run` and released by `close`."""

    config: TrainConfig
    run_dir: Path
    trainer: Any
    tokenizer: Any
    ledger: Ledger
    weights: WeightSync
    backend: Any
    reconciler: Reconciler
    metrics: MetricsWriter
    loggers: list[Callable[[dict[str, Any]], None]]
    started: float = field(default_factory=time.perf_counter)
    idle_s: float = 0.0
    busy_s: float = 0.0

    def close(self) -> None:
        self.reconciler.close()
        self.backend.close()
        self.ledger.close()


def run_training(config: TrainConfig, run_dir: str | Path,
                 on_step: Callable[[dict[str, Any]], None] | None = None) -> TrainSummary | None:
    """Train until the epoch (or `trainer.steps`) is done; resumable after any crash.

    Sets torch's thread count to `trainer.threads` for the run and restores
    it after (`inference.forward.threads`).
    On trainer ranks other than 0 it follows rank 0 and returns None."""
    t = config.trainer
    with threads(t.threads), joined_ranks(t.device, t.timeout_s, wanted=t.ranks, key="trainer.ranks",
                                          command="atelier train") as ranks:
        commands = Commands(ranks) if ranks.sharded else None
        if not ranks.main:
            follow(partial(make_trainer, config, ranks=ranks, rng=True), commands)
            return None
        run = open_run(config, Path(run_dir), ranks, commands)
        try:
            run.reconciler.start()
            while True:
                waited = time.perf_counter()
                batch = run.reconciler.next_batch()
                if batch is None:
                    break
                record = train_step(run, batch, idle_s=time.perf_counter() - waited)
                for log in (*run.loggers, *([on_step] if on_step else [])):
                    log(record)
            save_final_checkpoint(run)
            if commands is not None:
                run.trainer.close()   # the followers return
        finally:
            run.close()
        return write_summary(run)


def open_run(config: TrainConfig, run_dir: Path, ranks=None, commands=None) -> Run:
    """Restore (or start) the trainer, ledger, weight sync, rollout backend and reconciler."""

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    prepare_run_dir(config, run_dir)
    loggers = make_loggers(config.loggers, run_dir, config.model_dump(mode="json"))
    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    ckpt = committed_checkpoint(run_dir, metrics.last_step())   # None at a first start
    metrics.truncate_after(read_meta(ckpt)["step"] if ckpt else 0)
    for_vllm = config.inference.engine == "vllm"
    model_path = ckpt / "model" if ckpt else resolve_or_build_tiny(config.model, run_dir, seed=config.seed,
                                                                   for_vllm=for_vllm)
    trainer = restore_trainer(config, model_path, ckpt, ranks, commands)
    ledger = restore_ledger(run_dir, ckpt, trainer.step)
    root = sync_root(config, run_dir)
    weights = make_weight_sync(config.sync.kind, root, config.sync.full_every)
    weights.truncate_after(trainer.step)
    if (weights.latest() or (None, -1))[1] != trainer.step:  # readers start from the trainer's weights
        weights.publish(_published(trainer.state_dict(), config.sync.dtype), trainer.step)
    env = make_environment(config.env, config.rollout, config.shaping, config.seed)
    backend = make_backend(config, env, model_path, trainer.step, weights.reader(), root,
                           work_dir=run_dir / "vllm")
    reconciler = Reconciler(ledger=ledger, tasks=env.tasks(), category=env.category, backend=backend,
                            cfg=config.rollout, curriculum=Curriculum(config.curriculum),
                            rollouts_dir=run_dir / "rollouts", seed=config.seed, version=trainer.step,
                            total_steps=config.trainer.steps,
                            negative_scale=config.trainer.negative_advantage_scale)
    run = Run(config, run_dir, trainer, _tokenizer(model_path), ledger, weights, backend, reconciler,
              metrics, loggers, started=started)
    # last, once the engine and weight sync are built: whatever their construction draws from the
    # RNGs, a fresh run and a resumed one then start their next step from the same states
    start_rng(config.seed, trainer.ranks.rank, ckpt)
    return run


def restore_trainer(config: TrainConfig, model_path: Path, ckpt: Path | None, ranks=None, commands=None):
    """A trainer on `model_path`; with a checkpoint, its step and optimizer state too.
    With N ranks, rank 0's trainer leads the followers' (atelier.rl.mirror)."""
    if commands is not None:
        return lead(partial(make_trainer, config, ranks=ranks), model_path, ckpt, commands)
    return make_trainer(config, model_path, ckpt, ranks=ranks)


def make_trainer(config: TrainConfig, model_path: Path, ckpt: Path | None, *, ranks=None, rng: bool = False):
    """The trainer (with its checkpoint's step and optimizer); `rng`: also start this rank's RNGs
    (the other ranks; rank 0 starts them at the end of `open_run`)."""
    step = read_meta(ckpt)["step"] if ckpt else 0
    trainer = Trainer(model_path, config.trainer, temperature=config.rollout.temperature, step=step,
                      ranks=ranks)
    if ckpt:
        trainer.load_optimizer(ckpt)
    if rng:
        start_rng(config.seed, trainer.ranks.rank, ckpt)
    return trainer


def restore_ledger(run_dir: Path, ckpt: Path | None, step: int) -> Ledger:
    """The slot ledger as of the committed `step`."""
    ledger = Ledger.load(run_dir / "ledger.jsonl", committed_step=step)
    # The checkpoint committed these even if the ledger line never made it to disk.
    for sid in read_meta(ckpt).get("trained_slots", []) if ckpt else []:
        if ledger.slots[sid].state != "trained":
            ledger.set(sid, "trained", step=step)
    return ledger


def sync_root(config: TrainConfig, run_dir: Path) -> Path | None:
    """Where the delta chain lives (None for the in-process sync)."""
    if config.sync.kind != "delta":
        return None
    return Path(config.sync.dir) if config.sync.dir else run_dir / "weights"


def train_step(run: Run, batch: Batch, *, idle_s: float) -> dict[str, Any]:
    """One step, in the commit order of the module docstring; returns its metrics record."""
    busy_from = time.perf_counter()
    config, trainer = run.config, run.trainer
    samples = batch.samples()
    staleness = staleness_counts(samples, trainer.step)
    trained = trained_samples(samples, config.trainer.kl_beta)
    train = trainer.train_step(trained)
    step = trainer.step
    crash_point("rl.after_train")
    if step % config.trainer.checkpoint_every == 0:
        save_checkpoint(run.run_dir, step, trainer, run.tokenizer,
                        {"trained_slots": batch.slot_ids, "cursor": sorted(run.ledger.task_ids())})
        crash_point("rl.after_checkpoint")
    sync = run.weights.publish(_published(trainer.state_dict(), config.sync.dtype), step)
    crash_point("rl.after_publish")
    swap_from = time.perf_counter()
    run.backend.update_weights(step)
    engine_swap_s = time.perf_counter() - swap_from
    busy_s = time.perf_counter() - busy_from
    run.idle_s += idle_s
    run.busy_s += busy_s
    record = step_metrics(step=step, batch=batch, ledger_counts=committed_counts(run.ledger, batch),
                          train={**train, **sample_metrics(staleness, len(samples) - len(trained))}, sync=sync,
                          engine_swap_s=engine_swap_s,
                          counters=run.reconciler.take_counters(), idle_s=idle_s, busy_s=busy_s,
                          wall_s=time.perf_counter() - run.started, mode=config.rollout.mode)
    speculation = getattr(run.backend, "speculation", None)
    if speculation is not None and (drafts := speculation()) is not None:
        record["speculation"] = drafts   # the MTP heads' acceptance as the policy moves
    run.metrics.write(record)  # commits the step
    crash_point("rl.after_metrics")
    run.reconciler.commit(batch, step)
    crash_point("rl.after_ledger_commit")
    return record


def save_final_checkpoint(run: Run) -> None:
    """Checkpoint the last step when `checkpoint_every` did not land on it."""
    last = latest_checkpoint(run.run_dir)
    step = run.trainer.step
    if step and (last is None or read_meta(last)["step"] < step):
        save_checkpoint(run.run_dir, step, run.trainer, run.tokenizer,
                        {"trained_slots": [], "cursor": sorted(run.ledger.task_ids())})


def write_summary(run: Run) -> TrainSummary:
    rows = run.metrics.read_all()
    summary = TrainSummary(
        run_dir=str(run.run_dir), steps=run.trainer.step, mode=run.config.rollout.mode,
        wall_s=time.perf_counter() - run.started,
        reward_first=rows[0]["reward_mean"] if rows else None,
        reward_last=rows[-1]["reward_mean"] if rows else None,
        trainer_idle_fraction=run.idle_s / max(run.idle_s + run.busy_s, 1e-9),
        gen_tokens_per_s=sum(r["gen_tokens"] for r in rows) / max(sum(r["interval_s"] for r in rows), 1e-9)
        if rows else 0.0,
        ledger=run.ledger.counts(), checkpoint=str(latest_checkpoint(run.run_dir) or "") or None, metrics=rows)
    atomic_write(run.run_dir / "summary.json", json.dumps(summary.to_dict(), indent=1) + "\n")
    return summary


def _published(state_dict, dtype: str):
    if dtype == "same":
        return state_dict

    return map_tensors(state_dict, lambda v: v.detach().to(torch.bfloat16) if v.is_floating_point() else v)


def _tokenizer(model_path: Path):
    return AutoTokenizer.from_pretrained(model_path)
