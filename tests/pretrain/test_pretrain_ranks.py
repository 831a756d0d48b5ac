"""`atelier pretrain --set ranks=2`: CPT and SFT on 2 ranks (FSDP2, gloo) give the one-rank losses,
and a 2-rank run stopped mid-run resumes exactly (losses and final weights of the uninterrupted run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atelier.config import dump_config
from atelier.pretrain.config import PhaseConfig
from tests.pretrain.test_train import _config, _losses, _sft_dir

ROOT = Path(__file__).parents[2]


def _pretrain(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "atelier.cli.main", "pretrain", *args, "--json"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard only
def test_two_ranks_stopped_and_resumed_repeat_the_one_rank_run(tmp_path, tiny_model_dir, tiny_tokenizer, code_root):
    import torch
    from safetensors.torch import load_file

    from atelier.pretrain.train import run_pretrain

    trajs = _sft_dir(tmp_path, tiny_tokenizer)
    phases = [PhaseConfig(name="cpt", steps=3, seq_len=32, micro_batch=2, grad_accum=2, lr=3e-3, warmup_steps=1),
              PhaseConfig(name="sft", kind="sft", steps=2, seq_len=64, micro_batch=2, lr=1e-3,
                          trajectories=[str(trajs)])]
    config = _config(tiny_model_dir, code_root, phases)
    one = run_pretrain(config, tmp_path / "one")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(dump_config(config))
    cut = _pretrain(str(recipe), "--run-dir", str(tmp_path / "two"), "--set", "ranks=2", "--set", "stop_after=3")
    assert cut["stopped"] and cut["global_step"] == 3
    assert (tmp_path / "two" / "checkpoints" / "step-000002" / "sharded" / ".metadata").exists()
    done = _pretrain("--resume", str(tmp_path / "two"))
    assert done["global_step"] == 5 and not done["stopped"]
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert {r["ranks"] for r in lines if "loss" in r} == {2}
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("one", "two"))
    for k, v in a.items():
        assert float((v - b[k]).norm() / v.norm()) < 1e-5, k
    assert any(not torch.equal(v, w) for v, w in zip(a.values(), load_file(tiny_model_dir / "model.safetensors").values()))
