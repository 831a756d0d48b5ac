"""The training loop: loss falls, resume repeats the uninterrupted run, phases, SFT, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from atelier.config import ConfigError, load_config
from atelier.pretrain.config import PhaseConfig, PretrainConfig, SourceConfig


def _config(model_dir, code_root, phases, **extra) -> PretrainConfig:
    more = code_root.parent / "more.jsonl"
    more.write_text("".join(json.dumps({"text": f"class C{i}:\n    value = {i}\n" * 8}) + "\n" for i in range(30)))
    return PretrainConfig(
        model=str(model_dir), device="cpu", threads=1, checkpoint_every=2,
        data={"sources": [SourceConfig(name="code", root=str(code_root)),
                          SourceConfig(name="more", kind="jsonl", path=str(more), weight=0.5)],
              "heldout_fraction": 0.25, "shard_tokens": 4096},
        phases=phases, **extra)


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if "loss" in json.loads(line)]


def test_tiny_model_loss_falls(tmp_path, tiny_model_dir, code_root) -> None:
    from atelier.pretrain.train import run_pretrain

    phase = PhaseConfig(name="cpt", steps=14, seq_len=64, micro_batch=4, lr=1e-2, warmup_steps=2)
    result = run_pretrain(_config(tiny_model_dir, code_root, [phase]), tmp_path / "run")
    first, last = result.losses[0], sum(result.losses[-3:]) / 3
    assert last < first - 1.0, result.losses
    assert (tmp_path / "run" / "loss.png").stat().st_size > 0
    assert (tmp_path / "run" / "final" / "tokenizer.json").exists()


def _sft_dir(tmp_path: Path, tokenizer) -> Path:
    from atelier.harness.trajectory import Segment, Trajectory

    out = tmp_path / "trajs"
    for i, reward in enumerate([1.0, 0.0, 1.0]):
        seg = Segment()
        seg.extend_prompt(tokenizer("<|im_start|>user\nfix it<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
        ids = tokenizer('<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>')["input_ids"]
        seg.extend_sampled(ids, [0.0] * len(ids), [0] * len(ids))
        Trajectory(task_id=f"t{i}", segments=[seg], reward=reward).save(out / f"t{i}.json")
    return out


def test_resume_after_stop_repeats_the_uninterrupted_run(tmp_path, tiny_model_dir, tiny_tokenizer, code_root) -> None:
    from atelier.pretrain.modeling import rope_theta
    from atelier.pretrain.train import run_pretrain

    trajs = _sft_dir(tmp_path, tiny_tokenizer)
    phases = [PhaseConfig(name="cpt", steps=3, seq_len=32, micro_batch=2, grad_accum=2, lr=3e-3, warmup_steps=1),
              PhaseConfig(name="long", steps=3, seq_len=64, lr=1e-3, rope_theta_scale=2.0),
              PhaseConfig(name="sft", kind="sft", steps=2, seq_len=64, lr=1e-3, trajectories=[str(trajs)])]
    whole = run_pretrain(_config(tiny_model_dir, code_root, phases), tmp_path / "whole")
    assert whole.global_step == 8 and not whole.stopped
    cut = run_pretrain(_config(tiny_model_dir, code_root, phases, stop_after=5), tmp_path / "cut")
    assert cut.stopped and cut.global_step == 5 and cut.final_model is None
    config = load_config(PretrainConfig, tmp_path / "cut" / "config.toml")  # what `--run-dir DIR` alone reads
    assert config.stop_after is None
    resumed = run_pretrain(config, tmp_path / "cut")
    assert resumed.global_step == 8
    assert len(resumed.losses) == 4  # from the checkpoint at step 4, not from the stop at 5
    assert _losses(tmp_path / "cut") == pytest.approx(_losses(tmp_path / "whole"), rel=1e-5, abs=1e-6)
    saved = json.loads((tmp_path / "cut" / "final" / "config.json").read_text())
    from transformers import AutoConfig

    assert rope_theta(AutoConfig.from_pretrained(tmp_path / "cut" / "final")) == 2 * rope_theta(
        AutoConfig.from_pretrained(tiny_model_dir)), saved


def test_rope_scaling_rebuilds_the_rotary_frequencies(tiny_model_dir) -> None:
    import torch

    from atelier.pretrain.modeling import load_model_and_tokenizer, rope_theta, scale_rope_theta

    model, _ = load_model_and_tokenizer(str(tiny_model_dir))
    before = model.model.rotary_emb.inv_freq.clone()
    base = rope_theta(model.config)
    assert scale_rope_theta(model, 4.0, 8192) == 4 * base
    dim = before.numel() * 2
    expected = 1.0 / ((4 * base) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    assert torch.allclose(model.model.rotary_emb.inv_freq, expected)
    assert not torch.allclose(before, expected)
    assert model.config.max_position_embeddings == 8192


def test_sft_on_trajectories_trains_only_successful_rollouts(tmp_path, tiny_model_dir, tiny_tokenizer) -> None:
    from atelier.harness.trajectory import Trajectory
    from atelier.pretrain.sft import sft_on_trajectories

    trajs = [Trajectory.load(p) for p in sorted(_sft_dir(tmp_path, tiny_tokenizer).glob("*.json"))]
    final = sft_on_trajectories(tiny_model_dir, trajs, tmp_path / "sft", steps=3, seq_len=64, lr=1e-2)
    assert (final / "config.json").exists() and len(list((tmp_path / "sft" / "trajectories").glob("*.json"))) == 3
    losses = _losses(tmp_path / "sft")
    assert losses[-1] < losses[0]


def test_bad_recipes_give_typed_errors(tmp_path, tiny_model_dir) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('model = "m"\n[[phases]]\nname = "sft"\nkind = "sft"\nsteps = 1\nseq_len = 8\n')
    with pytest.raises(ConfigError, match="sft phase needs"):
        load_config(PretrainConfig, recipe)
    with pytest.raises(ConfigError, match="unknown key 'phases\\[0\\].stpes'"):
        load_config(PretrainConfig, None, ["model=m", 'phases=[{name = "a", stpes = 1, seq_len = 8}]'])
    proc = subprocess.run([sys.executable, "-m", "atelier.cli.main", "pretrain", str(recipe)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


@pytest.mark.timeout(900)  # a hang guard only: a shared, loaded CPU slows the subprocess a lot
def test_pretrain_cli_end_to_end(tmp_path, tiny_model_dir) -> None:
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "pretrain-tiny.toml"
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "atelier.cli.main", "pretrain", str(recipe), "--set", f"model={tiny_model_dir}",
            "--set", "evals.max_repo_tokens=300", "--set", "evals.max_new_tokens=8", "--run-dir", str(run_dir),
            "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["final_model"] == str(run_dir / "final") and not summary["stopped"]
    assert summary["evals"]["perplexity"]["tokens"] > 0
    for name in ("loss.png", "evals.png", "evals.json", "metrics.jsonl", "config.toml"):
        assert (run_dir / name).stat().st_size > 0, name
    written = (run_dir / "final" / "model.safetensors").stat().st_mtime_ns
    same = subprocess.run(argv, capture_output=True, text=True, timeout=300)   # the run is finished: nothing runs
    assert same.returncode == 0, same.stderr[-2000:]
    assert json.loads(same.stdout.strip().splitlines()[-1])["evals"] == summary["evals"]
    assert (run_dir / "final" / "model.safetensors").stat().st_mtime_ns == written
    again = subprocess.run([sys.executable, "-m", "atelier.cli.main", "pretrain", str(recipe), "--set",
                            f"model={tiny_model_dir}", "--run-dir", str(run_dir)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "holds a run of a different config (evals.max_new_tokens" in again.stderr
