"""One RL step on two real coding tasks: the real harness, sandboxes, grader and trainer."""

from __future__ import annotations

import pytest

from atelier.config import load_config
from atelier.rl.config import TrainConfig
from atelier.rl.ledger import Ledger
from atelier.rl.run import run_training
from tests.helpers import build_suite


@pytest.mark.slow   # venv build, sandboxes and two grades per task: over a minute on 2 busy cores
def test_one_step_on_real_tasks_through_harness_sandbox_and_grader(bwrap_ready, tiny_model_dir, tmp_path):
    suite = build_suite(tmp_path, source="mutation")
    config = load_config(TrainConfig, None, [
        f"model={tiny_model_dir}", "env.kind=tasks", f"env.tasks.suite={suite}",
        f"env.tasks.env_cache={tmp_path / 'envs'}", "env.tasks.agent={max_turns = 2, max_context_tokens = 4096}",
        "trainer.steps=1", "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.workers=4",
        "rollout.max_tokens=24", "rollout.min_valid=1", "trainer.lr=1e-4",
        # a random model's members tie (zero advantage), and with kl_beta = 0 such samples are not run;
        # the KL term trains them, so the step always runs real rollouts through the trainer
        "trainer.kl_beta=0.01"])
    summary = run_training(config, tmp_path / "run")
    assert summary.steps == 1
    ledger = Ledger.load(tmp_path / "run" / "ledger.jsonl")
    assert {g.task_id for g in ledger.groups.values()} == {"calc-add", "calc-mul"}
    trained = [s for s in ledger.slots.values() if s.state == "trained"]
    assert trained and all(s.step == 1 and s.reward is not None for s in trained)
    assert summary.ledger["queued"] == summary.ledger["running"] == 0
    row = summary.metrics[0]
    assert "correctness" in row["reward_parts"] and "fail_to_pass" in row["reward_parts"]
    assert row["train_tokens"] > 0
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    assert (ckpt / "model" / "config.json").exists() and (ckpt / "optimizer.pt").exists()
    traj = next((tmp_path / "run" / "rollouts").glob("*.json")).read_text()
    assert '"limits"' in traj and '"max_turns": 2' in traj
