"""One trainer rank for tests/rl/test_distributed.py: `python -m tests.rl.dist_worker SPEC OUT`.

Builds the step's samples from the spec (the same on every rank), takes
`steps` trainer steps and writes, on rank 0, each step's metrics and the
final full weights to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from atelier.rl.config import TrainerConfig
from atelier.rl.sample import Sample
from atelier.rl.trainer import Trainer


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
    torch.manual_seed(0)
    cfg = TrainerConfig(**spec["trainer"])
    trainer = Trainer(spec["model"], cfg, temperature=spec.get("temperature", 1.0))
    vocab = trainer.model.config.vocab_size
    metrics = []
    for step in range(spec.get("steps", 1)):
        samples = make_samples(spec.get("seed", 0) + step, spec["samples"], vocab)
        metrics.append(trainer.train_step(samples))
    state = trainer.state_dict()
    if out is not None and trainer.ranks.main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics))
        torch.save(state, out / "state.pt")
    return metrics, state


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
