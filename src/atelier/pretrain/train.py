"""The CPT / long-context / SFT loop: `run_pretrain(config, run_dir)`.

Phases run in recipe order on one model. Each phase gets a fresh AdamW and
its own warm-up + cosine schedule; a long-context phase first multiplies the
rotary base (see modeling.scale_rope_theta) and then reads rows of its own
length from the same token shards. An optimizer step sums the masked NLL of
`grad_accum` micro-batches and divides by the step's total target count.

Resume: a checkpoint stores the weights, the optimizer, RNG states and the
data cursor; the schedule and the data order are functions of counters
(schedule.py), so a resumed run repeats the uninterrupted run's losses and
ends with its weights, bit for bit (with the same ranks and threads).
Metrics logged after the checkpoint a resume starts from are dropped and
logged again. Commit points, in the order of one step: the step's metrics
line (fsynced), then the checkpoint's `state.json` (atomic), then, after
the last step, `final/` (an atomic directory) and `summary.json`. Each
moment in between is a named crash point (`atelier.fsio.crash_point`):
`pretrain.after_backward` (mid-step: gradients reduced, no optimizer step),
`pretrain.after_metrics`, `pretrain.before_commit` (a checkpoint with
everything but state.json), `pretrain.after_checkpoint`,
`pretrain.before_final`; tests/pretrain/test_pretrain_ranks.py kills a rank
at them and resumes to the uninterrupted run.

N ranks (`ranks = N`; `atelier pretrain` starts them, see atelier.train.launch):
every rank draws the same rows in the same order (the data cursor is a
counter), trains the token-balanced share `atelier.train.batching.step_plan`
gives it, and divides its summed NLL by the *step's* target count over all
rows, so FSDP's gradient sum is the one-rank gradient. Rank 0 writes the
metrics, the Hugging Face checkpoints and the final model (the full weights
gathered from the shards); every rank writes its optimizer shards with
torch.distributed.checkpoint into the checkpoint's `sharded/` before rank 0
writes `state.json`, the commit point.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from atelier.fsio import append_line, atomic_dir, atomic_write, crash_point
from atelier.inference.models import resolve_or_build_tiny
from atelier.moe.attach import RouterHook, attach
from atelier.mtp.config import MTPConfig
from atelier.mtp.heads import MTPHeads
from atelier.pretrain.batches import ExampleBatches, MixtureBatches
from atelier.pretrain.checkpoint import (
    latest_checkpoint,
    load_trainer_state,
    restore_rng,
    save_checkpoint,
    save_model_dir,
)
from atelier.pretrain.config import PhaseConfig, PretrainConfig
from atelier.pretrain.corpus import build_corpus
from atelier.pretrain.evals import run_base_evals
from atelier.pretrain.modeling import load_model_and_tokenizer, resolve_model_path, scale_rope_theta
from atelier.pretrain.mtp_phase import (
    StepStats,
    heldout_acceptance,
    micro_loss,
    open_heads,
    param_groups,
    policy_head,
    write_acceptance_file,
)
from atelier.pretrain.plots import plot_losses
from atelier.pretrain.schedule import lr_at
from atelier.pretrain.sft_data import load_chat, load_trajectories, pack_examples
from atelier.pretrain.sources import DataError
from atelier.rundir import RunDirError, freeze_config
from atelier.train.batching import step_plan
from atelier.train.checkpoint import full_state_dict, load_sharded
from atelier.train.collectives import all_reduce_sum, barrier, clip_grad_norm, named_failure
from atelier.train.devices import resolve_precision
from atelier.train.fsdp import compute_weights, grad_scale, shard
from atelier.train.head import PolicyHead
from atelier.train.ranks import joined_ranks

METRICS = "metrics.jsonl"


@dataclass
class RunResult:
    run_dir: Path
    final_model: Path | None          # None when the run stopped early (stop_after)
    global_step: int
    stopped: bool
    losses: list[float] = field(default_factory=list)  # training loss of every step this call ran
    evals: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "final_model": str(self.final_model) if self.final_model else None,
                "global_step": self.global_step, "stopped": self.stopped, "losses": self.losses,
                "evals": self.evals}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunResult:
        return cls(Path(d["run_dir"]), Path(d["final_model"]) if d["final_model"] else None, d["global_step"],
                   d["stopped"], d["losses"], d["evals"])


def run_pretrain(config: PretrainConfig, run_dir: str | Path, *, quiet: bool = True) -> RunResult:
    """Run every phase of `config` in `run_dir`, or continue the run there from its last
    checkpoint; return where the model is (at once when the run there is finished)."""
    finished = _finished(config, Path(run_dir))
    if finished is not None:
        return finished
    with joined_ranks(config.device, config.timeout_s, wanted=config.ranks, key="ranks",
                      command="atelier pretrain") as ranks:
        return _run_phases(config, Path(run_dir), quiet, ranks)


def _run_phases(config: PretrainConfig, run_dir: Path, quiet: bool, ranks) -> RunResult:
    """Each phase's loop in commit order (batches, step, metrics, checkpoint), as torchtitan's
    train loop reads; `_open` restores or starts the run, `_finish` writes the final model."""
    run = _open(config, run_dir, quiet, ranks)
    result = RunResult(run_dir, None, run.state["global_step"], False)
    for index in range(run.state["phase"], len(config.phases)):
        if _run_phase(run, index, result):
            return result
    return _finish(run, result)


@dataclass
class _Run:
    """What one pretrain run holds open across its phases."""

    config: PretrainConfig
    run_dir: Path
    ranks: Any
    checkpoint: Path | None
    state: dict[str, Any]
    """phase, phase_step, global_step, cursor: where the run is (what a checkpoint commits)."""
    payload: dict[str, Any] | None
    model: Any
    tokenizer: Any
    router: RouterHook
    head: PolicyHead
    corpus: Any
    log: _Logger
    precision: str
    heads: MTPHeads | None = None
    """The MTP heads the run trains (`[mtp]`), inside `head`."""
    carried: MTPHeads | None = None
    """Heads of the starting model the run does not train, saved unchanged with every checkpoint."""

    @property
    def device(self) -> str:
        return str(self.ranks.device)


def _open(config: PretrainConfig, run_dir: Path, quiet: bool, ranks) -> _Run:
    """Start the run in `run_dir`, or restore it from its last checkpoint: the model, its
    head, the RNGs and the data."""
    if ranks.main:
        prepare_run_dir(config, run_dir)
    barrier(ranks)
    checkpoint = latest_checkpoint(run_dir)
    if config.threads:
        torch.set_num_threads(config.threads)
    precision = resolve_precision(config.precision, ranks.device)
    torch.manual_seed(config.seed)
    state: dict[str, Any] = {"phase": 0, "phase_step": 0, "global_step": 0, "cursor": None}
    payload = None
    if checkpoint is not None:
        state, payload = load_trainer_state(checkpoint)
    if ranks.main:   # lines after the checkpoint (all, at a first start) are written again
        _truncate_metrics(run_dir / METRICS, state["global_step"])
    if config.model in ("tiny", "tiny-moe"):
        if ranks.main:
            resolve_or_build_tiny(config.model, run_dir, seed=config.seed)   # built once, reused on resume
        barrier(ranks)
    model_spec = str(base_model_dir(config, run_dir))
    model, tokenizer = load_model_and_tokenizer(str(checkpoint or model_spec), str(ranks.device))
    heads, carried = open_heads(config.mtp, model, resolve_model_path(str(checkpoint or model_spec)))
    router = attach(model, config.moe_precision, router_replay=False)   # does nothing on a dense model
    head = shard(policy_head(model, heads, config.mtp, config.logprob_chunk), ranks, precision,
                 activation_checkpointing=config.activation_checkpointing)
    if payload is not None:
        restore_rng(payload)
    if ranks.main:   # one rank tokenizes; the others then read the finished cache
        corpus = _corpus(config, tokenizer, run_dir, quiet)
    barrier(ranks)
    if not ranks.main:
        corpus = _corpus(config, tokenizer, run_dir, True)
    log = _Logger(run_dir / METRICS, quiet, enabled=ranks.main)
    if heads is not None and corpus is not None:   # where `atelier mtp eval` measures them by default
        heads.info["heldout_repos"] = corpus.heldout_repos
    return _Run(config, run_dir, ranks, checkpoint, state, payload, model, tokenizer, router, head, corpus, log,
                precision, heads, carried)


def _run_phase(run: _Run, index: int, result: RunResult) -> bool:
    """Phase `index`, from where the run stands; True when `stop_after` stopped the run in it."""
    config, ranks, head, state = run.config, run.ranks, run.head, run.state
    phase = config.phases[index]
    mid_phase = index == state["phase"] and state["phase_step"] > 0
    start = state["phase_step"] if mid_phase else 0
    if start >= phase.steps:
        return False
    if not mid_phase and phase.rope_theta_scale != 1.0:
        theta = scale_rope_theta(run.model, phase.rope_theta_scale, phase.seq_len)
        # `step`: the first step it holds for, so a resume from before that step logs it again
        run.log.event({"step": state["global_step"] + 1, "phase": phase.name, "rope_theta": theta})
    batches = _batches(config, phase, index, run.corpus, run.tokenizer, state["cursor"] if mid_phase else None)
    # fused, as the RL trainer's (one kernel per tensor, no list-wide temporaries): the same update
    optimizer = torch.optim.AdamW(param_groups(head, config.mtp), lr=phase.lr, betas=phase.betas,
                                  weight_decay=phase.weight_decay, fused=True)
    if mid_phase:
        _restore_optimizer(run, optimizer)
    for step in range(start, phase.steps):
        metrics = _train_step(head, optimizer, batches, phase, step, ranks, run.precision, run.router,
                              config.mtp if run.heads is not None else None)
        state = run.state = {"phase": index, "phase_step": step + 1, "global_step": state["global_step"] + 1,
                             "cursor": batches.cursor()}
        result.losses.append(metrics["loss"])
        if (step + 1) % config.log_every == 0 or step + 1 == phase.steps:
            run.log.step({"step": state["global_step"], "phase": phase.name, "phase_step": step + 1, **metrics})
        crash_point("pretrain.after_metrics")
        if config.eval_every and state["global_step"] % config.eval_every == 0 and run.corpus.heldout:
            val = _val_loss(head, run.corpus.heldout, phase, config, run.device)
            run.log.event({"step": state["global_step"], "phase": phase.name, "val_loss": val})
        last = step + 1 == phase.steps
        every = config.mtp.eval_every
        if run.heads is not None and (last or every and state["global_step"] % every == 0):
            _mtp_acceptance(run, phase)
        if last or state["global_step"] % config.checkpoint_every == 0:
            save_checkpoint(run.run_dir, head, run.tokenizer, optimizer, state, config.keep_checkpoints, ranks,
                            carried=run.carried)
            crash_point("pretrain.after_checkpoint")
        if config.stop_after is not None and state["global_step"] >= config.stop_after and not (
                last and index == len(config.phases) - 1):
            result.global_step, result.stopped = state["global_step"], True
            barrier(ranks)
            return True
    return False


def _mtp_acceptance(run: _Run, phase: PhaseConfig) -> None:
    """The heads' greedy acceptance on held-out rows: a metrics event and mtp-acceptance.json."""
    stream = run.corpus.heldout if run.corpus is not None else None
    if stream is None:   # e.g. an SFT-only recipe: no held-out split to measure on
        return
    with compute_weights([run.head], run.ranks, run.precision):   # the precision the heads train in
        stats = heldout_acceptance(run.head, stream, phase.seq_len, run.config.mtp.eval_rows, run.device)
    if stats is None:
        return
    run.log.event({"step": run.state["global_step"], "phase": phase.name,
                   "mtp_tokens_seen": run.heads.tokens_seen, "mtp_acceptance": stats})
    if run.ranks.main:
        write_acceptance_file(run.run_dir, run.run_dir / METRICS, run.heads)


def _restore_optimizer(run: _Run, optimizer) -> None:
    """The optimizer state of the phase the run's checkpoint was taken in."""
    checkpoint, payload = run.checkpoint, run.payload
    if checkpoint is not None and (checkpoint / "sharded").is_dir():
        with named_failure("reading the sharded checkpoint"):
            load_sharded(checkpoint / "sharded", run.head, optimizer)
    elif payload is not None and payload["optimizer"] is not None:
        if run.ranks.sharded:
            raise RunDirError(f"{checkpoint} was written by one rank and holds no sharded optimizer",
                              hint="it began on one rank: continue it with ranks = 1")
        optimizer.load_state_dict(payload["optimizer"])


def _finish(run: _Run, result: RunResult) -> RunResult:
    """The final model (the full weights gathered from the shards), the loss plot, the base-model
    evals and summary.json, written by rank 0."""
    result.global_step = run.state["global_step"]
    final = run.run_dir / "final"
    with named_failure("gathering the final weights"):
        weights = full_state_dict(run.head, run.ranks)
    result.final_model = final
    if not run.ranks.main:
        return result
    crash_point("pretrain.before_final")
    with atomic_dir(final) as tmp:
        save_model_dir(tmp, run.head, run.tokenizer, weights, run.carried)
    _plot(run.run_dir)
    if run.config.evals.enabled:
        result.evals = _base_evals(run.config, final, run.corpus, run.run_dir, run.device)
    atomic_write(run.run_dir / "summary.json", json.dumps({
        "final_model": str(final), "global_step": result.global_step,
        "phases": [p.name for p in run.config.phases], "evals": result.evals}, indent=1) + "\n")
    return result


def _finished(config: PretrainConfig, run_dir: Path) -> RunResult | None:
    """The result of the run in `run_dir` when it is this config's and finished every phase."""
    summary = run_dir / "summary.json"
    if not summary.is_file() or not (run_dir / "final").is_dir() or not prepare_run_dir(config, run_dir):
        return None
    done = json.loads(summary.read_text())
    if done.get("global_step") != sum(p.steps for p in config.phases):
        return None
    return RunResult(run_dir, run_dir / "final", done["global_step"], False, [], done.get("evals"))


def base_model_dir(config: PretrainConfig, run_dir: Path) -> Path:
    """The model directory the run starts from (a tiny model is built into the run directory)."""
    if config.model in ("tiny", "tiny-moe"):
        return Path(run_dir) / "base-model"
    return resolve_model_path(config.model)


def prepare_run_dir(config: PretrainConfig, run_dir: Path) -> bool:
    """Freeze `config` in `run_dir`, or check it against the run there (`atelier.rundir`); True
    when the run is continued. `stop_after` is left out: it is a property of one call, not of the
    run, so a continued run does not stop again."""
    return freeze_config(config.model_copy(update={"stop_after": None}), run_dir, command="atelier pretrain")


def _corpus(config: PretrainConfig, tokenizer, run_dir: Path, quiet: bool):
    if not config.data.sources:
        return None
    data_dir = Path(config.data.cache_dir).expanduser() if config.data.cache_dir else run_dir / "data"
    return build_corpus(config.data, tokenizer, data_dir, quiet=quiet)


def _batches(config: PretrainConfig, phase: PhaseConfig, index: int, corpus, tokenizer, cursor):
    if phase.kind == "pretrain":
        names = [s.name for s in config.data.sources]
        streams = [corpus.train[n] for n in names]
        short = [n for n, s in zip(names, streams) if s.rows(phase.seq_len) == 0]
        if short:
            raise DataError(f"phase '{phase.name}': sources {short} hold fewer tokens than one "
                            f"sequence of {phase.seq_len}", hint="add data or lower seq_len")
        weights = [s.weight for s in config.data.sources]
        return MixtureBatches(streams, weights, phase.seq_len, config.seed, index, cursor)
    examples = load_chat(phase.chat, tokenizer) + load_trajectories(phase.trajectories, phase.min_reward)
    ids_NS, mask_NS = pack_examples(examples, phase.seq_len, tokenizer.pad_token_id)
    return ExampleBatches(ids_NS, mask_NS, config.seed, index, cursor)


def _train_step(head, optimizer, batches, phase: PhaseConfig, step: int, ranks, precision: str,
                router: RouterHook | None = None, mtp: MTPConfig | None = None) -> dict[str, Any]:
    """One optimizer step; on an MoE model (`router`, which only observes) also the routers' load
    balance over every position they saw this step on this rank; with `mtp` (the head is an
    MTPPolicyHead) also the heads' KL and greedy acceptance on the step's rows."""

    started = time.perf_counter()
    lr = lr_at(step, lr=phase.lr, steps=phase.steps, warmup_steps=phase.warmup_steps,
               min_lr_ratio=phase.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    micro = [batches.next(phase.micro_batch) for _ in range(phase.grad_accum)]
    ids_RS = np.concatenate([ids for ids, _ in micro])
    mask_RS = np.concatenate([mask for _, mask in micro])
    total = max(int(mask_RS[:, 1:].sum()), 1)   # the step's targets over all ranks: the one normaliser
    plan = step_plan([int(m.sum()) + 1 for m in mask_RS], ranks.world, ranks.rank, phase.micro_batch)
    head.train()
    loss_sum = 0.0
    stats = StepStats(mtp.heads) if mtp is not None else None
    with named_failure(f"step {step + 1} of phase '{phase.name}'"):
        with compute_weights([head], ranks, precision):
            for rows in plan:
                ids = torch.from_numpy(ids_RS[rows] if rows else ids_RS[:1]).to(ranks.device)
                mask = torch.from_numpy(mask_RS[rows] if rows else np.zeros_like(mask_RS[:1])).to(ranks.device)
                loss, nll = micro_loss(head, ids, mask, mtp, stats)
                (loss * (grad_scale(ranks) / total)).backward()
                loss_sum += nll
                if router is not None and rows:
                    router.count_experts()
        crash_point("pretrain.after_backward")   # mid-step: gradients reduced, no step taken
        grad_norm = clip_grad_norm(head.parameters(), phase.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum = all_reduce_sum([loss_sum], ranks)[0]
    elapsed = time.perf_counter() - started
    tokens = phase.grad_accum * phase.micro_batch * phase.seq_len
    if stats is not None:
        head.mtp.tokens_seen += tokens
    return {"loss": loss_sum / total, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
            "targets": total, "tokens_per_s": tokens / elapsed, "step_s": elapsed, "ranks": ranks.world,
            **(router.load_balance() if router is not None else {}),
            **(stats.metrics(ranks, head.mtp.tokens_seen) if stats is not None else {})}


def _val_loss(head, stream, phase: PhaseConfig, config: PretrainConfig, device: str) -> float | None:
    n = min(stream.rows(phase.seq_len), config.eval_batches * phase.micro_batch)
    if n == 0:
        return None
    head.eval()
    total, count = 0.0, 0.0
    with torch.no_grad():   # every rank computes the same rows (FSDP needs every rank in each forward)
        for i in range(n):
            ids = torch.from_numpy(stream.row(i, phase.seq_len)[None]).to(device)
            logp, _ = head(ids, torch.ones_like(ids))
            total, count = total - float(logp[:, 1:].sum()), count + float(ids.shape[1] - 1)
    return total / count


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the whole lines of steps up to `step` (a torn last line, cut by a kill mid-write, goes
    too), in one atomic replace."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if record.get("step", 0) <= step:
            kept.append(line)
    atomic_write(path, "".join(line + "\n" for line in kept))


class _Logger:
    """Appends one JSON object per line to metrics.jsonl; prints a short line unless quiet."""

    def __init__(self, path: Path, quiet: bool, enabled: bool = True) -> None:
        self.path, self.quiet, self.enabled = path, quiet, enabled

    def _write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        append_line(self.path, json.dumps(record))

    def step(self, record: dict[str, Any]) -> None:
        self._write(record)
        if self.enabled and not self.quiet:
            print(f"step {record['step']:>6} [{record['phase']}] loss {record['loss']:.4f} "
                  f"lr {record['lr']:.2e} gnorm {record['grad_norm']:.2f} "
                  f"{record['tokens_per_s']:.0f} tok/s" + _mtp_line(record), flush=True)

    def event(self, record: dict[str, Any]) -> None:
        self._write(record)
        if self.enabled and not self.quiet:
            accepted = record.get("mtp_acceptance")
            shown = {**record, "mtp_acceptance": _mtp_line(accepted)} if accepted else record
            print("  " + " ".join(f"{k} {v}" for k, v in shown.items()), flush=True)


def _mtp_line(record: dict[str, Any]) -> str:
    """The heads' acceptance, short: per-head rates and the mean accepted length."""
    if "mtp_accept" in record:
        rates, length = record["mtp_accept"], record["mtp_accepted_length"]
    elif "per_head" in record:
        rates, length = [h["rate"] for h in record["per_head"]], record["mean_accepted_length"]
    else:
        return ""
    return f" mtp accept {'/'.join(f'{r:.2f}' for r in rates)} length {length:.2f}"


def _plot(run_dir: Path) -> None:
    plot_losses(run_dir / METRICS, run_dir / "loss.png")


def _base_evals(config: PretrainConfig, final: Path, corpus, run_dir: Path, device: str) -> dict[str, Any]:
    repos = corpus.heldout_repos if corpus is not None else []
    if not repos:  # e.g. only JSONL sources: nothing laid out as a repository to read whole
        return {"skipped": "no held-out code repositories; run `atelier base-eval --repo DIR`"}
    return run_base_evals(str(final), repos, config.evals, out_dir=run_dir, device=device)
