"""Documents, dedup, held-out split, token shards and SFT loss masks."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from atelier.pretrain.config import DataConfig, SourceConfig
from atelier.pretrain.packing import TokenStream, all_tokens, build_stream, encode_with
from atelier.pretrain.sft_data import chat_example, pack_examples, trajectory_examples
from atelier.pretrain.sources import DataError, list_documents

DOCS = [f"def f{i}(x):\n    return x * {i}  # {'pad ' * (i % 7)}\n" for i in range(40)]


def _expected(tokenizer) -> np.ndarray:
    encode = encode_with(tokenizer)
    return np.concatenate([np.asarray([*ids, tokenizer.eos_token_id]) for ids in encode(DOCS)])


def test_shards_hold_every_token_once_in_order(tmp_path, tiny_tokenizer) -> None:
    manifest = build_stream(tmp_path / "s", DOCS, encode_with(tiny_tokenizer), eos_id=tiny_tokenizer.eos_token_id,
                            vocab_size=len(tiny_tokenizer), shard_tokens=97, batch_docs=7)
    expected = _expected(tiny_tokenizer)
    assert len(manifest["shards"]) == -(-len(expected) // 97) > 3
    assert all(s["tokens"] == 97 for s in manifest["shards"][:-1])
    assert np.array_equal(all_tokens(tmp_path / "s"), expected)
    stream = TokenStream(tmp_path / "s")
    assert stream.rows(50) == len(expected) // 50
    rows = np.concatenate([stream.row(i, 50) for i in range(stream.rows(50))])  # rows span shard edges
    assert np.array_equal(rows, expected[: len(rows)])
    assert stream.shards[0].dtype == np.uint16


def test_interrupted_build_resumes_to_identical_shards(tmp_path, tiny_tokenizer) -> None:
    args = dict(eos_id=tiny_tokenizer.eos_token_id, vocab_size=len(tiny_tokenizer), shard_tokens=97, batch_docs=5)
    encode = encode_with(tiny_tokenizer)
    build_stream(tmp_path / "whole", DOCS, encode, **args)
    partial = build_stream(tmp_path / "cut", DOCS, encode, stop_after_shards=2, **args)
    assert not partial["complete"] and len(partial["shards"]) == 2
    calls = []
    counting = lambda texts: calls.append(len(texts)) or encode(texts)  # noqa: E731
    build_stream(tmp_path / "cut", DOCS, counting, **args)
    assert sum(calls) == len(DOCS) - partial["docs_done"]  # documents already in shards are not redone
    whole = sorted(p.name for p in (tmp_path / "whole").glob("shard-*"))
    assert whole == sorted(p.name for p in (tmp_path / "cut").glob("shard-*"))
    for name in whole:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes()
    assert not list((tmp_path / "cut").glob("carry-*"))


def test_dedup_and_heldout_split_by_repository(tmp_path, code_root) -> None:
    dup = (code_root / "repo0" / "mod0.py").read_text()
    (code_root / "repo3" / "copy.py").write_text(dup)
    config = DataConfig(sources=[SourceConfig(name="code", root=str(code_root))], heldout_fraction=0.3)
    docs, counts = list_documents(config)
    assert counts["duplicates"] == 1 and len(docs) == 12
    assert len({d.sha for d in docs}) == len(docs)
    splits = {}
    for doc in docs:
        splits.setdefault(doc.repo, set()).add(doc.split)
    assert all(len(s) == 1 for s in splits.values())  # a repository is never split
    assert {"train", "heldout"} == set().union(*splits.values())


def test_jsonl_source_and_bad_lines(tmp_path) -> None:
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps({"text": "x = 1\n", "repo": "r1"}) + "\n\n"
                    + json.dumps({"text": "y", "repo": "r2"}) + "\n")
    docs, _ = list_documents(DataConfig(sources=[SourceConfig(name="j", kind="jsonl", path=str(good),
                                                              repo_field="repo")], heldout_fraction=0.5))
    assert [d.repo for d in docs] == ["j/r1", "j/r2"]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"content": 1}\n')
    with pytest.raises(DataError, match="b.jsonl:1"):
        list_documents(DataConfig(sources=[SourceConfig(name="j", kind="jsonl", path=str(bad))]))
    # `datasets` missing, or present and the dataset nowhere to be found: a DataError either way
    with pytest.raises(DataError, match="not installed" if importlib.util.find_spec("datasets") is None else "'x/y'"):
        list_documents(DataConfig(sources=[SourceConfig(name="h", kind="hf", dataset="x/y")]))


def test_chat_loss_mask_covers_assistant_turns_only(tiny_tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                {"role": "assistant", "content": "6, of course"}]
    ex = chat_example(tiny_tokenizer, messages)
    assert len(ex.token_ids) == len(ex.loss_mask)
    full = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert tiny_tokenizer.decode(ex.token_ids) == full
    trained = tiny_tokenizer.decode([t for t, m in zip(ex.token_ids, ex.loss_mask) if m])
    assert trained == "4<|im_end|>\n6, of course<|im_end|>\n"


def test_trajectory_examples_keep_the_sampled_mask_and_reject_failures() -> None:
    from atelier.harness.trajectory import Segment, Trajectory

    seg = Segment()
    seg.extend_prompt([5, 6, 7])
    seg.extend_sampled([8, 9], [-0.1, -0.2], [0, 0])
    seg.extend_prompt([10])
    seg.extend_sampled([11], [-0.3], [1])
    won = Trajectory(task_id="t1", segments=[seg], reward=1.0)
    lost = Trajectory(task_id="t2", segments=[seg], reward=0.0)
    examples = trajectory_examples([won, lost, Trajectory(task_id="t3", segments=[seg])])
    assert len(examples) == 1
    assert examples[0].token_ids == [5, 6, 7, 8, 9, 10, 11]
    assert examples[0].loss_mask == [0, 0, 0, 1, 1, 0, 1]


def test_pack_examples_keeps_examples_whole() -> None:
    from atelier.pretrain.sft_data import Example

    exs = [Example([1, 2, 3], [0, 1, 1]), Example([4, 5, 6, 7], [0, 0, 1, 1]), Example([8, 9], [0, 1])]
    ids, mask = pack_examples(exs, seq_len=6, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]]
    assert mask.tolist() == [[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 1]]
