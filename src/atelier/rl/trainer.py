"""The trainer: full-parameter AdamW on a Hugging Face causal LM, on one rank or N.

Legend: B = sequences in a micro-batch, T = tokens (padded), V = vocabulary.

`train_step(samples)` runs one optimizer step over all `samples` (micro-
batched, gradients accumulated): it recomputes every token's logprob under
the *current* weights (never reusing the sampler's — docs/pitfalls.md: setting
old logprobs equal to rollout logprobs made the correction a no-op), computes
the loss of `atelier.rl.loss` against the sampler's logprobs, and steps.
The samples arrive with their final advantages (`atelier.rl.advantages`),
and only those the step runs (`trained_samples`): the trainer changes
neither. Logprobs are those of log_softmax(logits / temperature), the same quantity
the engine reports (see atelier.inference.sampling), computed in chunks of
`logprob_chunk` tokens so no fp32 [B, T, V] is ever held.

On one rank (`share_prefix`), the step walks the tree of token runs its
samples share (`atelier.train.prefix`): each run is fed once over its
parent's keys and values, its trained tokens' loss is every member's own
terms on its one logprob per token, and each sample's own tail is fed last
(`positions_run` against `positions_whole` in the metrics).

With `trainer.ranks = N` every rank builds a `Trainer` and calls
`train_step` with the *same* list of samples (the launcher broadcasts it):
each rank trains the share `atelier.train.batching.step_plan` gives it (token-
balanced, the same number of micro-batches everywhere), FSDP2 sums the
gradients, and the loss divides by the one constant `norm_tokens`, so N
ranks take the one-rank step (tests/rl/test_distributed.py checks it).
Metrics are summed across ranks. On an MoE model the trainer calls its
router hook (`atelier.moe.attach.RouterHook`) around every micro-batch: it
replays the sampler's experts (`router_replay`), counts tokens per expert and
how often the routing agrees with the sampler's.

The policy version is the number of optimizer steps taken: the weights after
step k are version k.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from atelier.fsio import crash_point
from atelier.moe.attach import attach
from atelier.moe.metrics import sampler_mismatch
from atelier.rl.checkpoint import save_rng
from atelier.rl.config import TrainerConfig
from atelier.rl.loss import LossInputs, policy_loss
from atelier.rl.sample import Sample
from atelier.train.batching import step_plan
from atelier.train.checkpoint import full_state_dict, load_sharded, save_sharded
from atelier.train.collectives import all_reduce_max, all_reduce_sum, clip_grad_norm, named_failure
from atelier.train.devices import peak_memory_gb, resolve_precision, trim_freed_memory
from atelier.train.fsdp import compute_weights, grad_scale, shard
from atelier.train.head import PolicyHead
from atelier.train.prefix import PrefixNode, SharedPrefix, encode_prefix, positions_run, prefix_forest
from atelier.train.ranks import DistributedError, Ranks, init_ranks

METRIC_SUMS = ("loss", "tokens", "is_weight_mean", "is_truncated_frac", "kl_k1", "sampler_mismatch", "entropy",
               "sampler_k1", "route_rows", "route_matches")


class _StepSums:
    """A step's loss metrics, summed over micro-batches and runs (each tokens-weighted)."""

    def __init__(self) -> None:
        self.sums: Counter[str] = Counter()
        self.ratio_max, self.neg_ratio_min, self.mismatch_max = 0.0, float("-inf"), 0.0

    def add(self, logp_BT: torch.Tensor, ent_BT: torch.Tensor | None, batch: dict[str, torch.Tensor],
            ref_BT: torch.Tensor | None, cfg: TrainerConfig, count_metrics: bool = True) -> torch.Tensor:
        """The loss of these rows (`batch`: mask, mu, adv), its metrics added unless `count_metrics`
        is off (the same rows' loss computed again for a recomputed backward)."""
        loss, m = policy_loss(LossInputs(logp_BT, batch["mu"], batch["adv"], batch["mask"], ref_BT),
                              is_cap=cfg.is_cap, kl_beta=cfg.kl_beta, norm_tokens=cfg.norm_tokens)
        if not count_metrics:
            return loss
        tok = m["tokens"]
        self.sums["loss"] += m["loss"]
        self.sums["tokens"] += tok
        for key in ("is_weight_mean", "is_truncated_frac", "kl_k1", "sampler_mismatch"):
            self.sums[key] += m[key] * tok
        self.sums["entropy"] += float((ent_BT * batch["mask"]).sum())
        if tok:
            mm = sampler_mismatch(logp_BT, batch["mu"], batch["mask"], cfg.is_cap)
            self.sums["sampler_k1"] += mm["mismatch_k1"] * tok
            self.mismatch_max = max(self.mismatch_max, mm["mismatch_abs_max"])
            self.ratio_max = max(self.ratio_max, m["is_ratio_max"])
            self.neg_ratio_min = max(self.neg_ratio_min, -m["is_ratio_min"])
        return loss


class Trainer:
    def __init__(self, model_dir: str | Path, cfg: TrainerConfig, *, temperature: float = 1.0,
                 step: int = 0, ranks: Ranks | None = None) -> None:
        self.cfg, self.temperature, self.step = cfg, temperature, step
        self.ranks = ranks or init_ranks(cfg.device, cfg.timeout_s)
        self.precision = resolve_precision(cfg.precision, self.ranks.device)
        dtype = getattr(torch, cfg.dtype)
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        lm.train()
        self.router = attach(lm, cfg.moe_precision, cfg.router_replay)   # does nothing on a dense model
        self.head = shard(PolicyHead(lm, cfg.logprob_chunk), self.ranks, self.precision,
                            activation_checkpointing=cfg.activation_checkpointing)
        self.model = self.head.lm   # the Hugging Face model (sharded parameters when ranks > 1)
        self.ref = None
        if cfg.kl_beta > 0:
            ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
            ref.requires_grad_(False)
            self.ref = shard(PolicyHead(ref, cfg.logprob_chunk), self.ranks, self.precision)
        # fused: one kernel per tensor, the same update in a fraction of the time
        # (docs/log/2026-12-03-figures-from-the-code.md)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, betas=cfg.betas,
                                           eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True)
        pad = getattr(lm.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0

    def _collate(self, samples: list[Sample]) -> dict[str, torch.Tensor]:
        """Pad to the longest sample; an empty list is one all-masked placeholder (see step_plan)."""
        if not samples:
            samples = [Sample([self.pad_id] * 2, [0, 0], [0.0, 0.0], [-1, -1], 0.0, "", "")]
        T = max(len(s.token_ids) for s in samples)
        B = len(samples)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, T), dtype=torch.long)
        mask = torch.zeros((B, T))
        mu = torch.zeros((B, T))
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            ids[i, :n] = torch.tensor(s.token_ids)
            attn[i, :n] = 1
            mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            mu[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        mask[:, 0] = 0.0  # nothing predicts the first token
        adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
        dev = self.ranks.device
        return {"ids": ids.to(dev), "attn": attn.to(dev), "mask": mask.to(dev), "mu": mu.to(dev),
                "adv": adv.to(dev)}

    def train_step(self, samples: list[Sample]) -> dict[str, Any]:
        """One optimizer step over `samples` (the same list on every rank); returns metrics."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        totals = _StepSums()
        forest = self._forest(samples)
        with named_failure(f"trainer step {self.step + 1}"):
            with compute_weights([self.head, self.ref], self.ranks, self.precision):
                self._train_forest(samples, *forest, None, None, totals)
            crash_point("trainer.after_backward")   # mid-step: gradients reduced, no step taken
            grad_norm = clip_grad_norm(self.head.parameters(), self.cfg.max_grad_norm)
            self.optimizer.step()
            sums = dict(zip(METRIC_SUMS, all_reduce_sum([totals.sums[k] for k in METRIC_SUMS], self.ranks)))
            ratio_max, neg_ratio_min, mismatch_max, peak_gb = all_reduce_max(
                [totals.ratio_max, totals.neg_ratio_min, totals.mismatch_max, peak_memory_gb(self.ranks.device)],
                self.ranks)
        if self.ranks.device.type == "cpu":
            trim_freed_memory()   # the step's freed heap memory does not pile up under the next
        self.step += 1
        n_tokens = sums["tokens"]
        n = max(n_tokens, 1.0)
        seconds = time.perf_counter() - start
        lengths = [len(s.token_ids) for s in samples]
        return {
            "loss": sums["loss"], "grad_norm": grad_norm, "train_tokens": n_tokens,
            "train_seconds": seconds, "train_tokens_per_s": n_tokens / seconds if seconds else 0.0,
            "is_weight_mean": sums["is_weight_mean"] / n, "is_truncated_frac": sums["is_truncated_frac"] / n,
            "is_ratio_max": ratio_max if n_tokens else 1.0, "is_ratio_min": -neg_ratio_min if n_tokens else 1.0,
            "kl_k1": sums["kl_k1"] / n, "sampler_mismatch": sums["sampler_mismatch"] / n,
            "sampler_mismatch_max": mismatch_max, "sampler_k1": sums["sampler_k1"] / n,
            "entropy": sums["entropy"] / n, "ranks": self.ranks.world,
            "positions_whole": sum(lengths), "positions_run": positions_run(forest, lengths),
            "peak_memory_gb": round(peak_gb, 3),
            **self.router.step_metrics(sums["route_rows"], sums["route_matches"]),
        }

    def _forest(self, samples: list[Sample]) -> tuple[list[PrefixNode], list[int]]:
        """The runs of tokens this step feeds once for the samples that share them
        (`trainer.share_prefix`; atelier.train.prefix); without sharing, every sample is a leaf."""
        if not self.cfg.share_prefix or self.ranks.sharded or self.router.routed:
            return [], list(range(len(samples)))
        return prefix_forest([s.token_ids for s in samples])

    def _train_forest(self, samples: list[Sample], nodes: list[PrefixNode], leaves: list[int],
                      parent: SharedPrefix | None, ref_parent: SharedPrefix | None, totals: _StepSums) -> None:
        """Forward and backward of `leaves` (each from the parent's end on) and of every node's run
        and then its continuations, depth first; a node's backward follows its continuations'."""
        begin = parent.length if parent is not None else 0
        tails = [samples[i].suffix(begin) if begin else samples[i] for i in leaves]
        # a step with no sample still runs step_plan's placeholder on every rank (ranks > 1 step together)
        plan = step_plan([len(s.token_ids) for s in tails], self.ranks.world, self.ranks.rank,
                           self.cfg.micro_batch) if tails or not (nodes or parent) else []
        for indices in plan:
            self._train_micro_batch(tails, indices, parent, ref_parent, totals)
        # with every layer checkpointed, a run's graph holds only its layers' inputs: recomputing it
        # whole as well would only add a forward
        recompute = self.cfg.recompute_prefix and not self.cfg.activation_checkpointing
        for node in nodes:
            ids_1P = torch.tensor([samples[node.members[0]].token_ids[node.start:node.end + 1]],
                                  device=self.ranks.device)
            labels = self._node_labels(samples, node)
            run = encode_prefix(self.head, ids_1P[:, :-1], recompute, parent=parent,
                                          labels_1P=ids_1P[:, 1:] if labels else None, temperature=self.temperature)
            ref_run = None
            if self.ref is not None:
                with torch.no_grad():
                    ref_run = encode_prefix(self.ref, ids_1P[:, :-1], parent=ref_parent,
                                                     labels_1P=ids_1P[:, 1:] if labels else None,
                                                     temperature=self.temperature)
            loss_of = None
            if labels:
                # every member's own loss terms on the run's one logprob per token (a sum over members:
                # the gradient of each member's copy, added up); metrics from the forward's logprobs, the
                # loss from those the backward reads (recomputed under `recompute`)
                ref_1P = ref_run.logprobs_1P if ref_run is not None else None
                rows = lambda t: None if t is None else t.expand(len(node.members), -1)   # noqa: E731
                totals.add(rows(run.logprobs_1P.detach()), rows(run.entropy_1P), labels, rows(ref_1P), self.cfg)

                def loss_of(logp_1P: torch.Tensor, labels=labels, ref_1P=ref_1P, rows=rows) -> torch.Tensor:
                    loss = totals.add(rows(logp_1P), None, labels, rows(ref_1P), self.cfg, count_metrics=False)
                    return loss * grad_scale(self.ranks)
            self._train_forest(samples, node.children, node.leaves, run, ref_run, totals)
            run.backward(loss_of)

    def _node_labels(self, samples: list[Sample], node: PrefixNode) -> dict[str, torch.Tensor] | None:
        """The loss inputs of a node's labels (the tokens at start+1..end) for each member; None when
        no member trains any of them (the system prompt, a task)."""
        window = slice(node.start + 1, node.end + 1)
        members = [samples[i] for i in node.members]
        if not any(any(s.loss_mask[window]) for s in members):
            return None
        dev = self.ranks.device
        return {"mask": torch.tensor([s.loss_mask[window] for s in members], dtype=torch.float32, device=dev),
                "mu": torch.tensor([s.logprobs[window] for s in members], dtype=torch.float32, device=dev),
                "adv": torch.tensor([s.advantage for s in members], dtype=torch.float32, device=dev)}

    def _train_micro_batch(self, samples: list[Sample], indices: list[int], prefix: SharedPrefix | None,
                           ref_prefix: SharedPrefix | None, totals: _StepSums) -> None:
        batch = self._collate([samples[i] for i in indices])
        with self.router.micro_batch([samples[i].routes for i in indices], batch["ids"].shape[1]):
            logp_BT, ent_BT = self.head(batch["ids"], batch["attn"], self.temperature, True, prefix)
            ref_BT = None
            if self.ref is not None:
                with torch.no_grad():
                    ref_BT, _ = self.ref(batch["ids"], batch["attn"], self.temperature, prefix=ref_prefix)
        loss = totals.add(logp_BT, ent_BT, batch, ref_BT, self.cfg)
        (loss * grad_scale(self.ranks)).backward()
        rows, matches = self.router.observe(batch["attn"])
        totals.sums["route_rows"] += rows
        totals.sums["route_matches"] += matches

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The full weights under Hugging Face names, on rank 0 (collective; empty on other ranks)."""
        with named_failure("gathering the weights"):
            state = full_state_dict(self.head, self.ranks, dtype)
        return {k.removeprefix("lm."): v for k, v in state.items()}

    # --- checkpoints (see atelier.rl.checkpoint for the layout) -----------
    def save(self, out_dir: Path, tokenizer=None) -> None:
        """model/ (Hugging Face, written by rank 0), the optimizer: optimizer.pt on one rank, a
        torch.distributed.checkpoint directory `sharded/` (model and optimizer) on N, and each
        rank's RNG states (`atelier.rl.checkpoint.save_rng`). Collective."""
        save_rng(out_dir, self.ranks.rank)
        state = self.state_dict()
        if self.ranks.main:
            self.model.save_pretrained(out_dir / "model", state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir / "model")
        if self.ranks.sharded:
            with named_failure("writing the sharded checkpoint"):
                save_sharded(out_dir / "sharded", self.head, self.optimizer)
        else:
            torch.save(self.optimizer.state_dict(), out_dir / "optimizer.pt")

    def load_optimizer(self, ckpt_dir: Path) -> None:
        if (ckpt_dir / "sharded").is_dir():
            with named_failure("reading the sharded checkpoint"):
                load_sharded(ckpt_dir / "sharded", self.head, self.optimizer)
            return
        if self.ranks.sharded:
            raise DistributedError(f"{ckpt_dir} was written by one trainer rank; it holds no sharded state",
                                     hint="it began on one rank: continue it with trainer.ranks = 1")
        self.optimizer.load_state_dict(torch.load(ckpt_dir / "optimizer.pt", weights_only=True,
                                                  map_location=self.ranks.device))
