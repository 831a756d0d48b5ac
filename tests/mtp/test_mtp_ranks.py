"""Heads on 2 ranks (FSDP2, gloo): the one-rank losses, KL and head weights, frozen and joint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atelier.config import dump_config
from atelier.pretrain.config import PhaseConfig
from tests.mtp.test_mtp_pretrain import _config, _records
from tests.pretrain.conftest import write_repos

ROOT = Path(__file__).parents[2]


def _flat(values: list) -> list[float]:
    return [x for v in values for x in (v if isinstance(v, list) else [v])]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard only
@pytest.mark.parametrize("trunk", ["joint", "frozen"])
def test_two_ranks_train_the_heads_as_one_does(tmp_path, tiny_model_dir, trunk) -> None:
    import torch
    from safetensors.torch import load_file

    from atelier.pretrain.train import run_pretrain

    code = write_repos(tmp_path / "code")
    phases = [PhaseConfig(name="cpt", steps=3, seq_len=32, micro_batch=2, grad_accum=2, lr=3e-3)]
    config = _config(tiny_model_dir, code, phases, {"heads": 2, "trunk": trunk, "eval_every": 2})
    run_pretrain(config, tmp_path / "one")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(dump_config(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "atelier.cli.main", "pretrain", str(recipe), "--run-dir",
                           str(tmp_path / "two"), "--set", "ranks=2", "--json"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for key in ("loss", "mtp_kl", "mtp_accept"):   # per step; the heads' figures a list per step
        two, one = (_flat(_records(tmp_path / d, key)) for d in ("two", "one"))
        assert two == pytest.approx(one, rel=1e-4, abs=1e-6), key
    a, b = (load_file(tmp_path / d / "final" / "mtp.safetensors") for d in ("one", "two"))
    assert set(a) == set(b)
    for k, v in a.items():
        assert float((v - b[k]).norm() / v.norm()) < 1e-4, k
    one, two = (json.loads((tmp_path / d / "mtp-acceptance.json").read_text()) for d in ("one", "two"))
    assert [h["step"] for h in one["history"]] == [h["step"] for h in two["history"]] == [2, 3]
    assert torch.is_tensor(next(iter(a.values())))
