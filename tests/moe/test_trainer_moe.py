"""The RL trainer on the tiny MoE: low-precision experts, router replay from samples, load balance."""

from __future__ import annotations

import pytest
import torch

from atelier.moe.attach import MissingRoutes
from atelier.moe.replay import pack_routes
from atelier.rl.config import TrainerConfig
from atelier.rl.sample import Sample
from atelier.rl.trainer import Trainer
from tests.moe.conftest import sample_with_cache, tiny_moe


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-moe")
    tiny_moe(seed=3).save_pretrained(path)
    return path


def samples_from_sampler(path, n: int = 3, routes: bool = True) -> list[Sample]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = []
    for i in range(n):
        prompt = list(range(20 + i, 36 + i))
        ids, logps, r = sample_with_cache(model, prompt, n_new=10, seed=i)
        mask = [0] * len(prompt) + [1] * 10
        mu = [0.0] * len(prompt) + logps
        out.append(Sample(ids, mask, mu, [0] * len(ids), advantage=1.0 - 0.75 * i, group_id="g", task_id=f"t{i}",
                          routes=pack_routes(r, 8) if routes else None))
    return out


@pytest.mark.slow   # test_train_moe_run.py checks the same through atelier train with the engine's routes
def test_trainer_replays_sampler_routes_and_trains_the_router(moe_dir):
    cfg = TrainerConfig(lr=1e-2, micro_batch=2, router_replay=True)
    trainer = Trainer(moe_dir, cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n.endswith("gate.weight")}
    m = trainer.train_step(samples_from_sampler(moe_dir))
    # step 1 trains on the sampler's own weights: with its routes, the recompute is the sampler's
    assert m["sampler_mismatch_max"] < 1e-4 and m["is_truncated_frac"] == 0.0
    assert sum(m["tokens_per_expert"]) == 2 * 2 * sum(26 for _ in range(3)) and m["expert_imbalance"] >= 1.0
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)


def test_trainer_in_nvfp4_forward_mxfp8_backward(moe_dir):
    trainer = Trainer(moe_dir, TrainerConfig(lr=1e-2, moe_precision="nvfp4_fwd_mxfp8_bwd"))
    m = trainer.train_step(samples_from_sampler(moe_dir, n=2, routes=False))
    # the quantised forward is a different policy than the fp32 sampler: a visible, bounded gap
    assert 1e-4 < m["sampler_mismatch"] < 1.0 and m["grad_norm"] > 0


def test_replay_without_routes_says_why(moe_dir):
    trainer = Trainer(moe_dir, TrainerConfig(router_replay=True))
    with pytest.raises(MissingRoutes, match="no routes"):
        trainer.train_step(samples_from_sampler(moe_dir, n=1, routes=False))
