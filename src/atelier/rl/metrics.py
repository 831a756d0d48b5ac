"""Per-step metrics, one JSON line per step in RUN_DIR/metrics.jsonl.

A step's line is written after its checkpoint and its published weights,
just before the ledger marks its slots trained, and it is fsynced: it is
the step's commit record. On resume, lines beyond the checkpoint the run restarts
from, and a torn last line, are cut (`truncate_after`), and a checkpoint whose
line never made it to disk is not resumed from (`atelier.rl.checkpoint.
committed_checkpoint`): the step is trained again and writes its line then.
So the file holds each committed step once, in order, whatever moment
`kill -9` hits.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

from atelier.errors import AtelierError
from atelier.failures import is_out_of_memory
from atelier.fsio import append_line, atomic_write
from atelier.rl.advantages import group_stats
from atelier.rl.reconciler import Batch
from atelier.rl.sample import Sample
from atelier.tasks.tamper import is_tampered


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        append_line(self.path, json.dumps(record))

    def last_step(self) -> int:
        """The step of the last whole line (0 when there is none)."""
        rows = self.read_all()
        return rows[-1]["step"] if rows else 0

    def truncate_after(self, step: int) -> None:
        """Keep the whole lines of steps up to `step`; drop the rest and a torn
        last line (a crash mid-write), in one atomic replace."""
        if not self.path.exists():
            return
        rows = self.read_all()
        kept = [r for r in rows if r["step"] <= step]
        if len(kept) != len(rows) or self.path.read_text(encoding="utf-8").count("\n") != len(rows):
            atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def read_all(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return rows


def committed_counts(ledger, batch: Batch) -> dict[str, int]:
    """The ledger's counts as the step commits them: the batch's slots
    `trained` (the metrics line is written just before the ledger says so)."""
    counts = ledger.counts()
    moved = sum(ledger.slots[sid].state == "ready" for sid in batch.slot_ids)
    counts["ready"] -= moved
    counts["trained"] += moved
    return counts


def step_metrics(*, step: int, batch: Batch, ledger_counts: dict[str, int], train: dict[str, Any], sync,
                 engine_swap_s: float, counters, idle_s: float, busy_s: float, wall_s: float,
                 mode: str) -> dict[str, Any]:
    """Reward and its parts, pass rate, best-of-K, staleness, IS weights, KL, entropy, throughput;
    `tampered`: samples whose grading found the tests tampered with (reward 0); `out_of_memory`:
    samples whose patch ran the graded tests past the memory limit (reward 0); `failures`: the
    three classes of `atelier.failures` — infrastructure failures since the last step (also by
    exception type in `infra_types`; `rollout_failures` is the same count), the batch's samples
    with a malformed tool call (scored, not failures of the rollout), and the batch's samples
    whose rollout once hit a bug that stopped the run (run again after the resume)."""
    rewards, parts, per_group, tampered, oom = [], Counter(), [], 0, 0
    for group in batch.groups:
        slots = [s for s in batch.slots if s.group_id == group.group_id]
        per_group.append(group_stats([s.reward for s in slots], [s.passed for s in slots]))
        for s in slots:
            rewards.append(s.reward)
            traj = batch.trajectories[s.slot_id]
            grade_error = getattr(traj, "limits", {}).get("grade_error")
            tampered += is_tampered(grade_error)
            oom += is_out_of_memory(grade_error)
            for k, v in traj.reward_parts.items():
                parts[k] += v
    n = max(len(rewards), 1)
    interval = max(idle_s + busy_s, 1e-9)
    gen_interval = max(1e-9, _elapsed(counters))
    return {
        "step": step, "mode": mode, "wall_s": wall_s, "interval_s": interval,
        "reward_mean": sum(rewards) / n,
        "reward_parts": {k: v / n for k, v in parts.items()},
        "pass_rate": sum(g["pass_rate"] for g in per_group) / max(len(per_group), 1),
        "best_of_k": sum(g["best_of_k"] for g in per_group) / max(len(per_group), 1),
        "groups": len(batch.groups), "samples": len(rewards),
        "zero_variance_groups": int(sum(g["zero_variance"] for g in per_group)),
        "tied_groups_skipped": counters.tied_groups,
        "tampered": tampered, "out_of_memory": oom,
        "gen_tokens": counters.gen_tokens, "gen_tokens_per_s": counters.gen_tokens / gen_interval,
        "rollouts": counters.rollouts, "rollout_failures": counters.failures,
        "failures": failure_counts(batch, counters), "infra_types": dict(sorted(counters.infra_types.items())),
        "trainer_idle_s": idle_s, "trainer_busy_s": busy_s, "trainer_idle_fraction": idle_s / interval,
        "sync_bytes": sync.bytes, "sync_seconds": sync.seconds, "sync_kind": sync.kind,
        "sync_bytes_per_s": sync.bytes / max(sync.seconds, 1e-9), "engine_swap_s": engine_swap_s,
        "ledger": ledger_counts,
        **train,
    }


def staleness_counts(samples: Sequence[Sample], step: int) -> Counter[int]:
    """How many trained tokens were sampled how many steps before `step` (the policy being
    updated): a token trained at step k + 1 is k - version(token) steps stale."""
    counts: Counter[int] = Counter()
    for s in samples:
        for v, mk in zip(s.versions[1:], s.loss_mask[1:]):
            if mk:
                counts[step - v] += 1
    return counts


def sample_metrics(staleness: Counter[int], skipped: int) -> dict[str, Any]:
    """A step's staleness histogram over every sample of its batch, and the samples it did not
    run (`skipped_zero_advantage`: zero advantage and no KL term, `trained_samples`)."""
    return {"staleness_hist": {str(k): v for k, v in sorted(staleness.items())},
            "staleness_max": max(staleness) if staleness else 0, "skipped_zero_advantage": skipped}


def failure_counts(batch: Batch, counters) -> dict[str, int]:
    """{"infra": since the last step, "malformed": samples with a broken call, "bug": samples
    whose ledger history holds a bug (the run stopped on it and resumed)}."""
    malformed = sum(1 for s in batch.slots if batch.trajectories[s.slot_id].broken_calls)
    bugs = sum(1 for s in batch.slots if any(f.startswith("bug:") for f in s.failures))
    return {"infra": counters.failures, "malformed": malformed, "bug": bugs}


def _elapsed(counters) -> float:
    return time.perf_counter() - counters.since


class MissingLogger(AtelierError):
    """A metrics logger was asked for but its package is not installed."""


def flat_scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a metrics record as `a/b` keys (for TensorBoard and W&B)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_scalars(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def make_loggers(kinds: list[str], run_dir: Path, config: dict[str, Any]) -> list[Callable[[dict], None]]:
    """Extra sinks besides metrics.jsonl: "tensorboard" and/or "wandb"."""
    loggers: list[Callable[[dict], None]] = []
    for kind in kinds:
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise MissingLogger("TensorBoard logging needs the tensorboard package",
                                    hint="pip install tensorboard, or drop 'tensorboard' from loggers") from None
            writer = SummaryWriter(str(run_dir / "tensorboard"))

            def to_tensorboard(record: dict, w=writer) -> None:
                for key, value in flat_scalars(record).items():
                    w.add_scalar(key, value, record["step"])
                w.flush()

            loggers.append(to_tensorboard)
        elif kind == "wandb":
            try:
                import wandb
            except ImportError:
                raise MissingLogger("Weights & Biases logging needs the wandb package",
                                    hint="pip install wandb, or drop 'wandb' from loggers") from None
            wandb_run = wandb.init(project="atelier", dir=str(run_dir), config=config, resume="allow",
                                   id=run_dir.name)
            loggers.append(lambda r, run=wandb_run: run.log(flat_scalars(r), step=r["step"]))
    return loggers
