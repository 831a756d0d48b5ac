"""The self-distillation corpus: prompts from documented functions, the model's replies as chat
files, and an attach run whose sft phase distils on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atelier.harness.trajectory import Segment, Trajectory
from atelier.pretrain.mtp_corpus import CorpusError, CorpusSpec, conversations, in_split, prompts, stdlib_functions
from atelier.pretrain.sft_data import load_chat
from tests.mtp.test_mtp_cli import _main


def _library(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "shelf.py").write_text('def put(item, where):\n    """Store an item on the shelf named where."""\n\n'
                                   'def _hidden(x):\n    """A private helper that is left out."""\n\n'
                                   'def bare(x):\n    return x\n')
    (root / "pkg" / "maths.py").write_text('def mean(xs):\n    """Return the arithmetic mean of xs.\n\n    Long."""\n')
    (root / "tests" / "test_shelf.py").write_text('def test_put():\n    """Tests are not a library."""\n')
    return root


def test_prompts_come_from_documented_public_functions(tmp_path) -> None:
    found = stdlib_functions(_library(tmp_path))
    assert [(f.module, f.name, f.args, f.doc) for f in found] == [
        ("pkg.maths", "mean", "xs", "return the arithmetic mean of xs"),
        ("shelf", "put", "item, where", "store an item on the shelf named where")]
    chat = prompts("chat", 4, seed=0, functions=found)
    assert chat == prompts("chat", 4, seed=0, functions=found) and len({c[0]["content"] for c in chat}) == 4
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in chat)
    agent = prompts("agent", 2, seed=0, functions=found)
    assert [m["role"] for m in agent[0]] == ["system", "user"] and "<tool_call>" in agent[0][0]["content"]
    assert any("src/pkg/maths.py" in a[1]["content"] for a in agent)
    with pytest.raises(CorpusError, match="unknown prompt kind 'code'"):
        prompts("code", 1, functions=found)
    with pytest.raises(CorpusError, match="no documented"):
        prompts("chat", 1, functions=[])
    with pytest.raises(CorpusError, match="temperatures"):
        CorpusSpec(chat=1, agent=0, temperatures=(-1.0,))
    with pytest.raises(CorpusError, match="unknown split 'test'"):
        CorpusSpec(split="test")
    heldout = [f for f in stdlib_functions() if in_split(f, "heldout")]
    train_modules = {f.module.split(".")[0] for f in stdlib_functions() if in_split(f, "train")}
    assert heldout and not {f.module.split(".")[0] for f in heldout} & train_modules
    asked = list(conversations(CorpusSpec(chat=3, agent=1, split="heldout")))
    assert [(kind, t) for kind, t, _ in asked] == [("chat", 0.0), ("chat", 0.7), ("chat", 0.0), ("agent", 0.0)]


def test_generate_then_attach_on_the_replies(tmp_path, tiny_model_dir, capsys) -> None:
    replies = tmp_path / "replies.jsonl"
    code, out, err = _main(["mtp", "generate", "--model", str(tiny_model_dir), "--out", str(replies),
                            "--chat", "5", "--agent", "1", "--max-tokens", "12", "--max-batch", "4",
                            "--temperature", "0", "--temperature", "0.7", "--json"], capsys)
    assert code == 0, err
    summary = json.loads(out)
    lines = [json.loads(line) for line in replies.read_text().splitlines()]
    assert summary["replies"] == len(lines) == 6 and summary["reply_tokens"] > 0
    assert [r["kind"] for r in lines] == ["chat"] * 5 + ["agent"]
    assert [r["temperature"] for r in lines] == [0.0, 0.7, 0.0, 0.7, 0.0, 0.0]
    assert all(r["messages"][-1]["role"] == "assistant" for r in lines)

    from transformers import AutoTokenizer
    examples = load_chat([replies], AutoTokenizer.from_pretrained(tiny_model_dir))
    assert len(examples) == 6 and all(any(e.loss_mask) for e in examples)

    recipe = tmp_path / "attach.toml"
    recipe.write_text(f"""
model = "{tiny_model_dir}"
device = "cpu"
threads = 1
checkpoint_every = 100

[[phases]]
name = "attach"
kind = "sft"
chat = ["{replies}"]
steps = 3
seq_len = 128
micro_batch = 2
lr = 1e-2

[mtp]
heads = 2
trunk = "frozen"
""")
    code, out, err = _main(["mtp", "attach", str(recipe), "--out", str(tmp_path / "with-heads"),
                            "--run-dir", str(tmp_path / "run"), "--json"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "with-heads" / "mtp.json").read_text())["tokens_seen"] == 3 * 2 * 128

    # measured on the replies and on a rollout's sampled tokens, without any code
    rollouts = tmp_path / "rollouts"
    rollouts.mkdir()
    tokens = examples[0].token_ids
    Trajectory(task_id="t", reward=0.0, segments=[Segment(token_ids=tokens, loss_mask=[0] * 8 + [1] * (len(tokens) - 8),
                                                          logprobs=[0.0] * len(tokens))]).save(rollouts / "t.json")
    code, out, err = _main(["mtp", "eval", "--model", str(tmp_path / "with-heads"),
                            "--chat", str(replies), "--trajectories", str(rollouts), "--prompts", "0",
                            "--device", "cpu", "--json"], capsys)
    assert code == 0, err
    results = json.loads(out)
    assert results["chat"]["conversations"] == 6
    assert results["chat"]["tokens"] == sum(sum(e.loss_mask) for e in examples)
    assert results["rollouts"]["segments"] == 1 and results["rollouts"]["tokens"] == len(tokens) - 8
    assert results["rollouts"]["starts"] > 0 and results["text"] is None


def test_generate_refuses_bad_requests_before_loading_a_model(tmp_path, capsys) -> None:
    out = tmp_path / "x.jsonl"
    missing = str(tmp_path / "no-model")
    code, _, err = _main(["mtp", "generate", "--model", missing, "--out", str(out), "--chat", "0", "--agent", "0"],
                         capsys)
    assert code == 2 and "nothing to generate" in err
    code, _, err = _main(["mtp", "generate", "--model", missing, "--out", str(out), "--split", "test"], capsys)
    assert code == 2 and "unknown split 'test'" in err and "hint:" in err
    code, _, err = _main(["mtp", "generate", "--model", missing, "--out", str(out), "--temperature", "-1"], capsys)
    assert code == 2 and "temperatures" in err and not out.exists()
