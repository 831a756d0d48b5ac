"""`atelier mtp attach` and `atelier mtp eval` on a tiny model, and the errors they print."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from atelier.cli import main as cli
from tests.pretrain.conftest import write_repos


def _recipe(tmp_path: Path, model_dir: Path, trunk: str = "frozen") -> Path:
    code = write_repos(tmp_path / "code", n_repos=5)
    recipe = tmp_path / "attach.toml"
    recipe.write_text(f"""
model = "{model_dir}"
device = "cpu"
threads = 1
checkpoint_every = 100

[data]
heldout_fraction = 0.2
shard_tokens = 4096

[[data.sources]]
name = "code"
root = "{code}"

[[phases]]
name = "attach"
steps = 6
seq_len = 64
micro_batch = 2
lr = 1e-2

[mtp]
heads = 2
trunk = "{trunk}"
eval_every = 3
""")
    return recipe


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        cli.main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_attach_then_eval(tmp_path, tiny_model_dir, capsys) -> None:
    out_dir = tmp_path / "with-heads"
    code, out, err = _main(["mtp", "attach", str(_recipe(tmp_path, tiny_model_dir)), "--out", str(out_dir),
                            "--run-dir", str(tmp_path / "run"), "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["out"] == str(out_dir) and summary["acceptance"]["heads"] == 2
    assert (out_dir / "config.json").is_symlink() and (out_dir / "config.json").resolve().parent == tiny_model_dir
    assert not (out_dir / "mtp.json").is_symlink() and (out_dir / "model.safetensors.index.json").is_file()
    history = json.loads((tmp_path / "run" / "mtp-acceptance.json").read_text())["history"]
    assert [h["step"] for h in history] == [3, 6]

    result_file = tmp_path / "eval.json"
    code, out, err = _main(["mtp", "eval", "--model", str(out_dir), "--tokens", "256", "--seq-len", "64",
                            "--prompts", "2", "--prompt-len", "16", "--new-tokens", "8", "--device", "cpu",
                            "--out", str(result_file), "--json"], capsys)
    assert code == 0, err
    results = json.loads(out)
    assert results == json.loads(result_file.read_text())
    assert results["heads"] == 2 and results["tokens_seen"] == 6 * 2 * 64
    assert results["repos"] == json.loads((out_dir / "mtp.json").read_text())["training"]["heldout_repos"]
    for measure in ("text", "greedy"):
        stats = results[measure]
        assert len(stats["per_head"]) == 2 and 1.0 <= stats["mean_accepted_length"] <= 3.0
    # a step starts at the last prompt token or later, with every draft inside the generated text
    assert results["greedy"]["starts"] == 2 * (8 - 2)

    code, out, _ = _main(["mtp", "eval", "--model", str(out_dir), "--tokens", "128", "--seq-len", "64",
                          "--prompts", "0", "--device", "cpu"], capsys)
    assert code == 0 and "mean accepted length" in out and "2 heads" in out


def test_attach_refuses_a_joint_trunk(tmp_path, tiny_model_dir, capsys) -> None:
    code, _, err = _main(["mtp", "attach", str(_recipe(tmp_path, tiny_model_dir, trunk="joint")),
                          "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "mtp.trunk = 'joint'" in err and "hint:" in err
    code, _, err = _main(["mtp", "attach", str(_recipe(tmp_path, tiny_model_dir)), "--out", str(tmp_path / "x"),
                          "--set", "mtp.heads=0"], capsys)
    assert code == 2 and "no heads to attach" in err


def test_eval_errors_are_typed(tmp_path, tiny_model_dir, capsys) -> None:
    code, _, err = _main(["mtp", "eval", "--model", str(tiny_model_dir), "--device", "cpu"], capsys)
    assert code == 2 and "has no MTP heads" in err and "atelier mtp attach" in err
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    (bad / "mtp.json").write_text(json.dumps({"heads": 2, "model_type": "qwen2", "hidden_size": 64,
                                              "vocab_size": 512, "tokens_seen": 0}))
    (bad / "mtp.safetensors").write_bytes(b"")
    code, _, err = _main(["mtp", "eval", "--model", str(bad), "--device", "cpu"], capsys)
    assert code == 2 and "model_type = 'qwen2'" in err


def test_attach_never_replaces_a_directory_it_did_not_write(tmp_path, tiny_model_dir, capsys) -> None:
    from atelier.pretrain.mtp_phase import link_model_with_heads

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(Exception, match="not replacing it"):
        link_model_with_heads(tiny_model_dir, tiny_model_dir, taken)
    assert (taken / "notes.txt").read_text() == "mine"
