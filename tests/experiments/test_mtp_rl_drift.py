"""experiments/mtp_rl_drift on a tiny run: heads measured on every policy of a run, on its rollouts."""

from __future__ import annotations

import json
import shutil

import torch

from atelier.harness.trajectory import Segment, Trajectory
from atelier.mtp.heads import MTPHeads
from atelier.mtp.store import save_mtp_heads
from tests.helpers import load_experiment

run = load_experiment("mtp_rl_drift")


def test_heads_are_measured_on_each_policy_of_a_run(tmp_path, tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    heads_dir = tmp_path / "with-heads"
    shutil.copytree(tiny_model_dir, heads_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    save_mtp_heads(heads_dir, MTPHeads(model, 2), num_hidden_layers=model.config.num_hidden_layers)
    demo = tmp_path / "demo"
    for policy, scale in (("sft/final", 1.0), ("rl/checkpoints/step-000002/model", 0.5)):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)   # a different policy at each point (the second: half the first's weights)
        model.save_pretrained(demo / policy)
        shutil.copy(tiny_model_dir / "tokenizer.json", demo / policy)
        shutil.copy(tiny_model_dir / "tokenizer_config.json", demo / policy)
    (demo / "rl" / "rollouts").mkdir(parents=True)
    ids = list(range(5, 45))
    Trajectory(task_id="t", reward=1.0, segments=[Segment(token_ids=ids, loss_mask=[0] * 10 + [1] * 30)]).save(
        demo / "rl" / "rollouts" / "t.json")

    run.main(["--heads", str(heads_dir), "--run", str(demo), "--out", str(tmp_path / "out"), "--smoke"])
    points = json.loads((tmp_path / "out" / "results.json").read_text())["points"]
    assert [p["trunk"] for p in points] == ["heads' model", "SFT", "RL step 2"]
    assert all(p["rollouts"]["tokens"] == 30 and 1.0 <= p["rollouts"]["mean_accepted_length"] <= 3.0 for p in points)
    assert (tmp_path / "out" / "RL-step-2" / "mtp.json").is_file() and (tmp_path / "out" / "mtp_rl_drift.png").is_file()
