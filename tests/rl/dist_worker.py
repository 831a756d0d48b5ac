"""One trainer rank for tests/rl/test_distributed.py: `python -m tests.rl.dist_worker SPEC OUT`.

Builds the step's samples from the spec (the same on every rank), takes
`steps` RL trainer steps, then `steps` SFT steps of the pretrain loop on
padded rows of random lengths, and writes, on rank 0, each step's metrics
and the final full weights of both to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from atelier.rl.config import TrainerConfig
from atelier.rl.sample import Sample
from atelier.rl.trainer import Trainer
from atelier.train.checkpoint import full_state_dict
from atelier.train.fsdp import shard
from atelier.train.head import PolicyHead
from atelier.train.ranks import Ranks, exit_rank, joined_ranks


def make_samples(seed: int, n: int, vocab: int, min_len: int = 6, max_len: int = 40) -> list[Sample]:
    """Random samples of varied lengths: a prompt, sampled tokens with plausible sampler logprobs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        mu = [0.0] * prompt + (-(torch.rand(length - prompt, generator=g) * 6 + 2)).tolist()
        versions = [-1] * prompt + [0] * (length - prompt)
        adv = float(torch.randn(1, generator=g))
        out.append(Sample(ids, mask, mu, versions, adv, f"g{i // 4}", f"t{i // 4}"))
    return out


def run(spec: dict, out: Path | None) -> tuple[list[dict], dict[str, torch.Tensor]]:
    with joined_ranks("cpu") as ranks:
        return _run(spec, out, ranks)


def _run(spec: dict, out: Path | None, ranks: Ranks) -> tuple[list[dict], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = TrainerConfig(**spec["trainer"])
    trainer = Trainer(spec["model"], cfg, temperature=spec.get("temperature", 1.0), ranks=ranks)
    vocab = trainer.model.config.vocab_size
    metrics = []
    for step in range(spec.get("steps", 1)):
        samples = make_samples(spec.get("seed", 0) + step, spec["samples"], vocab)
        metrics.append(trainer.train_step(samples))
    state = trainer.state_dict()
    sft_metrics, sft_state = run_sft(spec, trainer.ranks)
    if out is not None and trainer.ranks.main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps({"rl": metrics, "sft": sft_metrics}))
        torch.save({"rl": state, "sft": sft_state}, out / "state.pt")
    return {"rl": metrics, "sft": sft_metrics}, {"rl": state, "sft": sft_state}


def run_sft(spec: dict, ranks) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The pretrain loop's step on SFT-like rows (padding masked out), fp32; the spec's
    sft_micro_batch x sft_grad_accum (default 2 x 3) regroups the same 6 rows per step."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from atelier.pretrain.batches import ExampleBatches
    from atelier.pretrain.config import PhaseConfig
    from atelier.pretrain.train import _train_step

    lm = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    head = shard(PolicyHead(lm, 5), ranks, "fp32")
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, lm.config.vocab_size, size=(12, 24))
    mask = np.zeros_like(ids)
    for row, n in enumerate(rng.integers(3, 24, size=12)):
        mask[row, 1:n] = 1
    phase = PhaseConfig(name="sft", kind="sft", steps=spec.get("steps", 1), seq_len=24, lr=1e-3,
                        micro_batch=spec.get("sft_micro_batch", 2), grad_accum=spec.get("sft_grad_accum", 3),
                        trajectories=["unused"])
    batches = ExampleBatches(ids, mask, 0, 0)
    metrics = [_train_step(head, optimizer, batches, phase, step, ranks, "fp32") for step in range(phase.steps)]
    state = {k.removeprefix("lm."): v for k, v in full_state_dict(head, ranks).items()}
    return metrics, state


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    exit_rank(0)
