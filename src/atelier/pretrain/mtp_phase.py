"""MTP heads in a pretrain run (the `[mtp]` section): which heads, their loss, their acceptance.

- `open_heads`: the heads a run trains (loaded from the starting model or checkpoint when it
  has them, else new) and the heads it only carries (a starting model's, with `mtp.heads = 0`:
  saved unchanged into every checkpoint, so a model never loses its heads by being trained).
- `policy_head`: the run's policy head; with heads, an `MTPPolicyHead`, the trunk's parameters
  frozen when `mtp.trunk = "frozen"`.
- `param_groups`: the trunk's parameters at the phase's learning rate, the heads' at
  `mtp.lr_scale` times it (`lr_scale` in each group; the step multiplies).
- `micro_loss`: one micro-batch's summed loss: the trunk's NLL (joint) plus
  `mtp.weight / D` x the heads' summed KL, both over the step's one normaliser (the caller's
  target count), so the heads' term is `weight` x the mean over heads and target tokens.
- `heldout_acceptance`: greedy acceptance on rows of the held-out split, logged as a metrics
  event; `write_acceptance_file` rebuilds `<run>/mtp-acceptance.json` from those events (so a
  resumed run's file holds exactly the events its metrics keep).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from atelier.fsio import atomic_dir, atomic_write
from atelier.mtp.acceptance import Acceptance
from atelier.mtp.config import MTPConfig
from atelier.mtp.heads import MTPError, MTPHeads
from atelier.mtp.policy import MTPPolicyHead, MTPStepOutput
from atelier.mtp.store import META, WEIGHTS, load_mtp_heads, write_weights_index
from atelier.train.collectives import all_reduce_sum
from atelier.train.head import PolicyHead

ACCEPTANCE_FILE = "mtp-acceptance.json"


def open_heads(config: MTPConfig, model, source: Path) -> tuple[MTPHeads | None, MTPHeads | None]:
    """(heads to train, heads to carry unchanged) for `model` loaded from `source`."""
    loaded = load_mtp_heads(source, model)
    if config.heads == 0:
        return None, loaded
    if loaded is not None and len(loaded) != config.heads:
        raise MTPError(f"{source} holds {len(loaded)} MTP heads but the recipe asks for mtp.heads = {config.heads}",
                       hint=f"set mtp.heads = {len(loaded)} to keep training them, or start from a model "
                            "without heads (delete its mtp.json and mtp.safetensors)")
    heads = loaded if loaded is not None else MTPHeads(model, config.heads, config.init)
    heads.draft_vocab = config.draft_vocab
    heads.info = {**heads.info, "trunk": config.trunk, "init": heads.info.get("init", config.init)}
    return heads, None


def policy_head(model, heads: MTPHeads | None, config: MTPConfig, logprob_chunk: int) -> PolicyHead:
    if heads is None:
        return PolicyHead(model, logprob_chunk)
    if config.trunk == "frozen":
        model.requires_grad_(False)
    return MTPPolicyHead(model, heads, config.trunk, logprob_chunk, config.chunk, config.draft_vocab)


def param_groups(head, config: MTPConfig) -> list[dict[str, Any]]:
    if not isinstance(head, MTPPolicyHead):
        return [{"params": list(head.parameters())}]
    mtp_ids = {id(p) for p in head.mtp.parameters()}
    trunk = [p for p in head.parameters() if p.requires_grad and id(p) not in mtp_ids]
    groups = [{"params": trunk, "lr_scale": 1.0}] if trunk else []
    return groups + [{"params": list(head.mtp.parameters()), "lr_scale": config.lr_scale}]


class StepStats:
    """The heads' KL and acceptance over one step's micro-batches (on this rank)."""

    def __init__(self, heads: int) -> None:
        self.kl = [0.0] * heads
        self.weights = [0.0] * heads
        self.acceptance = Acceptance(heads)

    def add(self, out: MTPStepOutput) -> None:
        self.kl = [a + b for a, b in zip(self.kl, out.kl_sums)]
        self.weights = [a + b for a, b in zip(self.weights, out.weight_sums)]
        self.acceptance.merge(out.acceptance)

    def metrics(self, ranks, tokens_seen: int) -> dict[str, Any]:
        """Summed over ranks: each head's mean KL and the batch's greedy acceptance."""
        acc, K = self.acceptance, len(self.kl)
        summed = all_reduce_sum(self.kl + self.weights + [acc.starts] + acc.chain + acc.matched, ranks)
        acc = Acceptance(K, int(summed[2 * K]), [int(x) for x in summed[2 * K + 1:3 * K + 1]],
                         [int(x) for x in summed[3 * K + 1:]])
        stats = acc.to_dict()
        return {"mtp_kl": [kl / max(w, 1.0) for kl, w in zip(summed[:K], summed[K:2 * K])],
                "mtp_accept": [h["rate"] for h in stats["per_head"]],
                "mtp_accepted_length": stats["mean_accepted_length"], "mtp_tokens_seen": tokens_seen}


def micro_loss(head, ids: torch.Tensor, mask: torch.Tensor, config: MTPConfig, stats: StepStats | None
               ) -> tuple[torch.Tensor, float]:
    """(the summed loss to backward, the summed NLL) of one micro-batch."""
    if stats is None:
        logp_NS, _ = head(ids, torch.ones_like(ids))
        nll = -(logp_NS * mask).sum()
        return nll, float(nll.detach())
    logp_NS, out = head(ids, torch.ones_like(ids), mtp_mask=mask)
    stats.add(out)
    nll = -(logp_NS * mask).sum()
    loss = out.loss * (config.weight / len(stats.kl))
    if config.trunk == "joint":
        loss = loss + nll
    return loss, float(nll.detach())


def heldout_acceptance(head: MTPPolicyHead, stream, seq_len: int, rows: int, device: str) -> dict[str, Any] | None:
    """Greedy acceptance and mean KL on the first `rows` held-out rows of `seq_len` (every rank the
    same rows: FSDP needs every rank in each forward)."""
    n = min(stream.rows(seq_len), rows)
    if n == 0:
        return None
    stats = StepStats(len(head.mtp))
    head.eval()
    with torch.no_grad():
        for i in range(n):
            ids = torch.from_numpy(stream.row(i, seq_len)[None]).to(device)
            mask = torch.ones_like(ids)
            mask[:, 0] = 0
            stats.add(head(ids, torch.ones_like(ids), mtp_mask=mask)[1])
    out = stats.acceptance.to_dict()
    out["kl"] = [kl / max(w, 1.0) for kl, w in zip(stats.kl, stats.weights)]
    out["tokens"] = n * seq_len
    return out


def write_acceptance_file(run_dir: Path, metrics_path: Path, heads: MTPHeads) -> None:
    history = []
    for line in metrics_path.read_text().splitlines() if metrics_path.exists() else []:
        record = json.loads(line)
        if "mtp_acceptance" in record:
            history.append(record)
    atomic_write(run_dir / ACCEPTANCE_FILE, json.dumps(
        {"heads": len(heads), "trunk": heads.info.get("trunk"), "init": heads.info.get("init"),
         "history": history}, indent=1) + "\n")


def check_attach(config) -> None:
    """`atelier mtp attach` trains heads on a frozen trunk whose files it links: refuse a recipe
    that would change the trunk or its config."""
    mtp = config.mtp
    if mtp.heads == 0:
        raise MTPError("the attach recipe has mtp.heads = 0: there are no heads to attach",
                       hint="set mtp.heads (e.g. --set mtp.heads=3)")
    if mtp.trunk != "frozen":
        raise MTPError(f"atelier mtp attach keeps the base model's weights, but mtp.trunk = {mtp.trunk!r}",
                       hint="set mtp.trunk = \"frozen\", or train trunk and heads together with atelier pretrain")
    scaled = [p.name for p in config.phases if p.rope_theta_scale != 1.0]
    if scaled:
        raise MTPError(f"phases {scaled} change the rotary base, which the linked base model would not have",
                       hint="attach heads with rope_theta_scale = 1, or train the long-context phase with "
                            "atelier pretrain")


def link_model_with_heads(base_dir: Path, heads_dir: Path, out: Path) -> Path:
    """`out`: every file of `base_dir` linked, the heads of `heads_dir` copied, and the weights
    index that keeps `mtp.safetensors` out of the model's weights (atelier.mtp.store)."""
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / META).is_file())):
        raise MTPError(f"{out} exists and is not a model directory with MTP heads: not replacing it",
                       hint="choose another --out, or remove it")
    with atomic_dir(out) as tmp:
        for path in sorted(Path(base_dir).iterdir()):
            if path.name not in (META, WEIGHTS) and path.is_file():
                (tmp / path.name).symlink_to(path.resolve())
        for name in (WEIGHTS, META):
            shutil.copyfile(Path(heads_dir) / name, tmp / name)
        write_weights_index(tmp)
    return out
