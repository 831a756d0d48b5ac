"""Heads in `atelier pretrain`: trained in every phase, saved with each checkpoint, resumed bit for bit,
a frozen trunk left as it was, a starting model's heads carried."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atelier.mtp.config import MTPConfig
from atelier.mtp.heads import MTPError
from atelier.pretrain.config import PhaseConfig, PretrainConfig, SourceConfig
from tests.pretrain.conftest import write_repos


def _config(model_dir, code_root, phases, mtp: dict, **extra) -> PretrainConfig:
    return PretrainConfig(model=str(model_dir), device="cpu", threads=1, checkpoint_every=2,
                          data={"sources": [SourceConfig(name="code", root=str(code_root))],
                                "heldout_fraction": 0.25, "shard_tokens": 4096},
                          phases=phases, mtp=MTPConfig(**mtp), **extra)


def _records(run_dir: Path, key: str) -> list:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in lines if key in r]


def _sft(tmp_path: Path) -> Path:
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"add {i} and 2"},
                                                     {"role": "assistant", "content": f"return {i} + 2"}]}) + "\n"
                            for i in range(8)))
    return chat


def test_joint_heads_train_through_every_phase_and_resume_bit_for_bit(tmp_path, tiny_model_dir) -> None:
    from atelier.pretrain.train import run_pretrain

    code = write_repos(tmp_path / "code")
    phases = [PhaseConfig(name="cpt", steps=3, seq_len=32, micro_batch=2, grad_accum=2, lr=3e-3),
              PhaseConfig(name="long", steps=2, seq_len=64, lr=1e-3, rope_theta_scale=2.0),
              PhaseConfig(name="sft", kind="sft", steps=2, seq_len=64, lr=1e-3, chat=[str(_sft(tmp_path))])]
    mtp = {"heads": 2, "trunk": "joint", "eval_every": 2, "lr_scale": 2.0}
    whole = run_pretrain(_config(tiny_model_dir, code, phases, mtp), tmp_path / "whole")
    final = tmp_path / "whole" / "final"
    meta = json.loads((final / "mtp.json").read_text())
    assert meta["heads"] == 2 and meta["tokens_seen"] == 3 * 4 * 32 + 2 * 64 + 2 * 64
    assert meta["training"]["trunk"] == "joint" and meta["training"]["heldout_repos"]
    assert len(_records(tmp_path / "whole", "mtp_kl")) == 7
    history = json.loads((tmp_path / "whole" / "mtp-acceptance.json").read_text())["history"]
    # every 2 steps and at each phase's end (on held-out code, in the SFT phase too)
    assert [h["step"] for h in history] == [2, 3, 4, 5, 6, 7]
    assert 1.0 <= history[-1]["mtp_acceptance"]["mean_accepted_length"] <= 3.0

    cut = run_pretrain(_config(tiny_model_dir, code, phases, mtp, stop_after=5), tmp_path / "cut")
    assert cut.stopped
    resumed = run_pretrain(_config(tiny_model_dir, code, phases, mtp), tmp_path / "cut")
    assert resumed.global_step == whole.global_step
    assert _records(tmp_path / "cut", "loss") == pytest.approx(_records(tmp_path / "whole", "loss"), abs=1e-6)
    a, b = load_file(final / "mtp.safetensors"), load_file(tmp_path / "cut" / "final" / "mtp.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert json.loads((tmp_path / "cut" / "final" / "mtp.json").read_text())["tokens_seen"] == meta["tokens_seen"]


def test_a_frozen_trunk_keeps_the_base_weights_and_trains_the_heads(tmp_path, tiny_model_dir) -> None:
    from atelier.pretrain.train import run_pretrain

    code = write_repos(tmp_path / "code")
    phases = [PhaseConfig(name="attach", steps=12, seq_len=64, micro_batch=2, lr=1e-2, weight_decay=0.0)]
    run_pretrain(_config(tiny_model_dir, code, phases, {"heads": 2, "trunk": "frozen"}), tmp_path / "run")
    base, final = load_file(tiny_model_dir / "model.safetensors"), load_file(tmp_path / "run/final/model.safetensors")
    assert set(base) == set(final) and all(torch.equal(base[k], final[k]) for k in base)
    kl = _records(tmp_path / "run", "mtp_kl")
    assert sum(kl[-1]) < 0.7 * sum(kl[0]), kl


def test_heads_of_a_starting_model_are_carried_or_continued(tmp_path, tiny_model_dir) -> None:
    from atelier.pretrain.train import run_pretrain

    code = write_repos(tmp_path / "code")
    phases = [PhaseConfig(name="cpt", steps=2, seq_len=32, lr=1e-3)]
    run_pretrain(_config(tiny_model_dir, code, phases, {"heads": 2, "trunk": "frozen"}), tmp_path / "first")
    start = tmp_path / "first" / "final"
    saved = load_file(start / "mtp.safetensors")
    run_pretrain(_config(start, code, phases, {}), tmp_path / "carried")
    carried = tmp_path / "carried" / "final"
    again = load_file(carried / "mtp.safetensors")
    assert all(torch.equal(saved[k], again[k]) for k in saved)
    assert json.loads((carried / "mtp.json").read_text())["tokens_seen"] == 2 * 32
    run_pretrain(_config(start, code, phases, {"heads": 2}), tmp_path / "continued")
    assert json.loads((tmp_path / "continued/final/mtp.json").read_text())["tokens_seen"] == 2 * 2 * 32
    with pytest.raises(MTPError, match="holds 2 MTP heads"):
        run_pretrain(_config(start, code, phases, {"heads": 3}), tmp_path / "mismatch")


def test_a_model_without_heads_trains_as_before(tmp_path, tiny_model_dir) -> None:
    from atelier.pretrain.train import run_pretrain

    code = write_repos(tmp_path / "code")
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    run_pretrain(_config(copy, code, [PhaseConfig(name="cpt", steps=2, seq_len=32, lr=1e-3)], {}), tmp_path / "run")
    assert not (tmp_path / "run" / "final" / "mtp.json").exists()
    assert not _records(tmp_path / "run", "mtp_kl")
