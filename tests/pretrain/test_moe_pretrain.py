"""Pretrain and SFT on the tiny MoE: low-precision experts and the routers' load balance per step."""

from __future__ import annotations

import json

import pytest

from atelier.pretrain.config import PhaseConfig, PretrainConfig, SourceConfig


def _steps(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def test_tiny_moe_pretrains_and_fine_tunes_in_low_precision_with_load_balance(tmp_path, code_root,
                                                                              tiny_tokenizer) -> None:
    from atelier.harness.trajectory import Segment, Trajectory
    from atelier.pretrain.sft import sft_on_trajectories
    from atelier.pretrain.train import run_pretrain

    config = PretrainConfig(model="tiny-moe", device="cpu", threads=1, moe_precision="nvfp4_fwd_mxfp8_bwd",
                            data={"sources": [SourceConfig(name="code", root=str(code_root))],
                                  "heldout_fraction": 0.25, "shard_tokens": 4096},
                            phases=[PhaseConfig(name="cpt", steps=3, seq_len=64, micro_batch=2, lr=1e-2)])
    result = run_pretrain(config, tmp_path / "cpt")
    steps = _steps(tmp_path / "cpt")
    assert (tmp_path / "cpt" / "base-model" / "config.json").exists() and len(steps) == 3
    for m in steps:   # 2 rows x 64 positions x 2 layers x top-2 per step
        assert len(m["tokens_per_expert"]) == 8 and sum(m["tokens_per_expert"]) == 2 * 64 * 2 * 2
        assert m["expert_imbalance"] >= 1.0 and m["grad_norm"] > 0
    seg = Segment()
    seg.extend_prompt(tiny_tokenizer("<|im_start|>user\nfix it<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    ids = tiny_tokenizer("<tool_call>\n{}\n</tool_call><|im_end|>")["input_ids"]
    seg.extend_sampled(ids, [0.0] * len(ids), [0] * len(ids))
    final = sft_on_trajectories(result.final_model, [Trajectory(task_id="t", segments=[seg], reward=1.0)],
                                tmp_path / "sft", steps=2, seq_len=64, lr=1e-2, moe_precision="mxfp8")
    assert (final / "config.json").exists()
    assert all(sum(m["tokens_per_expert"]) > 0 for m in _steps(tmp_path / "sft"))


def test_low_precision_experts_on_a_dense_model_say_why(tmp_path, tiny_model_dir, code_root) -> None:
    from atelier.moe.precision import UnsupportedMoeModel
    from atelier.pretrain.train import run_pretrain

    config = PretrainConfig(model=str(tiny_model_dir), device="cpu", threads=1, moe_precision="mxfp8",
                            data={"sources": [SourceConfig(name="code", root=str(code_root))],
                                  "heldout_fraction": 0.25, "shard_tokens": 4096},
                            phases=[PhaseConfig(name="cpt", steps=1, seq_len=64, micro_batch=2)])
    with pytest.raises(UnsupportedMoeModel, match="no fused experts"):
        run_pretrain(config, tmp_path / "run")
