"""The trainer's recomputed logprobs are the engine's; the CLI's user errors."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from atelier.cli import main as cli
from atelier.errors import AtelierError
from atelier.inference.engine import LocalEngine
from atelier.inference.types import SamplingParams
from atelier.rl.config import TrainerConfig
from atelier.rl.sample import Sample
from atelier.rl.trainer import Trainer, token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_match_the_sampler_so_on_policy_ratios_are_one(tiny_model_dir, temperature):
    prompt = [5, 17, 99, 3, 250]
    with LocalEngine(tiny_model_dir, dtype="float32") as engine:
        gen = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=temperature, seed=3))
    trainer = Trainer(tiny_model_dir, TrainerConfig(norm_tokens=1.0), temperature=temperature)
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logp, _ = token_logprobs(trainer.model, ids, torch.ones_like(ids), temperature)
    recomputed = logp[0, len(prompt):]
    assert torch.allclose(recomputed, torch.tensor(gen.logprobs), atol=1e-4)
    sample = Sample(prompt + gen.token_ids, [0] * len(prompt) + [1] * len(gen.token_ids),
                    [0.0] * len(prompt) + gen.logprobs, [-1] * len(prompt) + gen.versions, 1.0, "g", "t")
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_step([sample])
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["staleness_hist"] == {"0": len(gen.token_ids)}
    assert trainer.step == 1
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_train_cli_user_errors(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli.app, ["train"])
    assert isinstance(result.exception, AtelierError)
    assert "no recipe" in str(result.exception)
    result = runner.invoke(cli.app, ["train", "--resume", str(tmp_path)])
    assert isinstance(result.exception, AtelierError) and "cannot resume" in str(result.exception)
    bad = tmp_path / "r.toml"
    bad.write_text("[rollout]\ngroup_sise = 4\n")
    result = runner.invoke(cli.app, ["train", str(bad)])
    assert isinstance(result.exception, AtelierError) and "group_size" in str(result.exception)   # the typo is named with a suggestion


def test_asking_for_a_logger_that_is_not_installed_is_a_user_error(tmp_path, monkeypatch):
    import sys

    from atelier.rl.metrics import MissingLogger, flat_scalars, make_loggers

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingLogger) as info:
        make_loggers(["wandb"], tmp_path, {})
    assert "pip install wandb" in info.value.hint
    assert flat_scalars({"step": 3, "reward_parts": {"length": -0.5}, "mode": "async", "ok": True}) == {
        "step": 3.0, "reward_parts/length": -0.5}
