"""RL with rollouts on vLLM: the tiny model learns the toy task, and a `kill -9` of the vLLM server
mid-run costs retried rollouts, never the job. Slow: a vLLM server start and a restart."""

from __future__ import annotations

import os
import signal

import pytest

from atelier.config import load_config
from atelier.inference.vllm_server import VLLMConfig, VLLMUnavailable, find_vllm_python
from atelier.rl.config import TrainConfig
from atelier.rl.ledger import Ledger
from atelier.rl.run import run_training

VLLM = ["inference.engine=vllm", "inference.vllm.enforce_eager=true", "inference.vllm.chunk_tokens=8",
        "inference.vllm.dtype=float32", "inference.vllm.max_model_len=512"]
LEARN = ["trainer.steps=14", "trainer.lr=1e-2", "trainer.norm_tokens=128", "rollout.group_size=8",
         "rollout.groups_per_step=2", "rollout.max_tokens=16", "rollout.workers=8", "rollout.max_staleness=1",
         "env.toy.tasks=64"]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a server start and a restart, each minutes on a loaded 2-core machine
def test_tiny_model_learns_on_vllm_and_survives_kill_9_of_the_server(tmp_path):
    try:
        find_vllm_python(VLLMConfig())
    except VLLMUnavailable as exc:
        pytest.skip(f"the vLLM environment is absent ({exc.message}); `make vllm-env` builds it")
    run_dir = tmp_path / "run"
    config = load_config(TrainConfig, None, ["model=tiny", *LEARN, *VLLM])  # tiny: built in vLLM's shape
    killed = []

    def on_step(record):
        if record["step"] == 4:
            pid = int((run_dir / "vllm" / "vllm-server.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    summary = run_training(config, run_dir, on_step=on_step)
    assert killed
    rewards = [m["reward_mean"] for m in summary.metrics]
    assert summary.steps == 14 and len(rewards) == 14
    assert sum(rewards[-3:]) / 3 > sum(rewards[:2]) / 2 + 0.15, rewards  # chance level is ~0.25
    assert int((run_dir / "vllm" / "vllm-server.pid").read_text()) != killed[0]  # a new server ran the rest
    counts = Ledger.load(run_dir / "ledger.jsonl").counts()
    assert counts["trained"] == 14 * 2 * 8 and counts["dropped"] == 0
    assert all(m["staleness_max"] <= 1 for m in summary.metrics)
