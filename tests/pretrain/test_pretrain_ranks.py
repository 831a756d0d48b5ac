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
from tests.helpers import rank_env
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
    run_pretrain(config, tmp_path / "one")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(dump_config(config))
    cut = _pretrain(str(recipe), "--run-dir", str(tmp_path / "two"), "--set", "ranks=2", "--set", "stop_after=3")
    assert cut["stopped"] and cut["global_step"] == 3
    assert (tmp_path / "two" / "checkpoints" / "step-000002" / "sharded" / ".metadata").exists()
    done = _pretrain("--run-dir", str(tmp_path / "two"))   # continues with the config it began with
    assert done["global_step"] == 5 and not done["stopped"]
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert {r["ranks"] for r in lines if "loss" in r} == {2}
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("one", "two"))
    for k, v in a.items():
        assert float((v - b[k]).norm() / v.norm()) < 1e-5, k
    base = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(v, w) for v, w in zip(a.values(), base.values()))


LEFT_PROBE = """
import json, sys
from pathlib import Path
import torch.distributed as dist
from atelier.train.ranks import exit_rank
from atelier.pretrain.config import PretrainConfig
from atelier.pretrain.train import run_pretrain

run_pretrain(PretrainConfig.model_validate_json(Path(sys.argv[1]).read_text()), sys.argv[2])
print(json.dumps({"still_joined": dist.is_initialized()}))
exit_rank(0)   # as every rank process ends: see exit_rank
"""


def test_each_rank_leaves_the_group_when_its_run_returns(tmp_path, tiny_model_dir, code_root):
    """PyTorch asks each rank to leave its process group once its collectives are done:
    `run_pretrain` on 2 ranks returns with the group left, on both ranks."""
    from atelier.train.launch import launch

    phases = [PhaseConfig(name="cpt", steps=1, seq_len=32, micro_batch=2, lr=1e-3)]
    config = _config(tiny_model_dir, code_root, phases).model_copy(update={"ranks": 2})
    (tmp_path / "config.json").write_text(config.model_dump_json())
    done = launch(["-c", LEFT_PROBE, str(tmp_path / "config.json"), str(tmp_path / "run")], 2, env=rank_env(),
                  log_dir=tmp_path / "logs")
    for rank in (0, 1):
        out = (done.logs[rank] / "stdout.log").read_text()
        assert json.loads(out.strip().splitlines()[-1]) == {"still_joined": False}


def _run(*args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ATELIER_CRASH_AT"}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    if crash_at:
        env["ATELIER_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "atelier.cli.main", "pretrain", *args, "--json"],
                          capture_output=True, text=True, timeout=900, env=env)


MEASURED = {"tokens_per_s", "step_s"}
"""Fields of a metrics line that measure time; every other one must repeat exactly."""


@pytest.fixture(scope="module")
def two_rank_recipe(tmp_path_factory, tiny_model_dir, tiny_tokenizer) -> tuple[Path, Path]:
    """A CPT + SFT recipe on 2 ranks, and its uninterrupted run."""
    from tests.pretrain.conftest import write_repos

    root = tmp_path_factory.mktemp("two-rank-recipe")
    trajs = _sft_dir(root, tiny_tokenizer)
    phases = [PhaseConfig(name="cpt", steps=3, seq_len=32, micro_batch=2, grad_accum=2, lr=3e-3, warmup_steps=1),
              PhaseConfig(name="sft", kind="sft", steps=2, seq_len=64, micro_batch=2, lr=1e-3,
                          trajectories=[str(trajs)])]
    config = _config(tiny_model_dir, write_repos(root / "code"), phases).model_copy(update={"ranks": 2})
    recipe = root / "recipe.toml"
    recipe.write_text(dump_config(config))
    done = _run(str(recipe), "--run-dir", str(root / "whole"))
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe, root / "whole"


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang guard only: two runs of two ranks on a loaded 2-core machine
@pytest.mark.parametrize("point, victim, resumes_from", [
    ("pretrain.after_backward:5", 1, 4),   # mid-step in SFT: resumes mid-phase, sharded optimizer loaded
    ("pretrain.before_commit:2", 0, 2),    # step 3's checkpoint written but for state.json: not committed
])
def test_a_rank_killed_mid_run_resumes_to_the_uninterrupted_weights(tmp_path, two_rank_recipe, point, victim,
                                                                    resumes_from):
    """kill -9 of one rank stops the job with a message naming it; the same command again restarts both ranks from
    the last committed checkpoint and ends with the uninterrupted 2-rank run's metrics (timings aside)
    and final weights, bit for bit."""
    import torch
    from safetensors.torch import load_file

    recipe, whole = two_rank_recipe
    run = tmp_path / "run"
    crashed = _run(str(recipe), "--run-dir", str(run), crash_at=f"{point}@{victim}")
    assert crashed.returncode == 2, crashed.stderr[-3000:]
    assert f"rank {victim} of 2 was killed by SIGKILL" in crashed.stderr
    assert not (run / "final").exists()
    from atelier.pretrain.checkpoint import latest_checkpoint

    assert json.loads((latest_checkpoint(run) / "state.json").read_text())["global_step"] == resumes_from

    resumed = _run(str(recipe), "--run-dir", str(run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["global_step"] == 5 and not summary["stopped"]

    def rows(r: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if k not in MEASURED}
                for x in (r / "metrics.jsonl").read_text().splitlines()]
    assert rows(run) == rows(whole)
    got, want = (load_file(r / "final" / "model.safetensors") for r in (run, whole))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by up to {(got[k] - want[k]).abs().max()}"
