"""Heads in a model directory: saved and loaded whole, a model without heads unaffected, bad files refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from atelier.mtp.heads import MTPError, MTPHeads
from atelier.mtp.store import MODEL_INDEX, has_mtp_heads, load_mtp_heads, read_mtp_meta, save_mtp_heads


def _model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture
def with_heads(tmp_path, tiny_model_dir) -> Path:
    out = tmp_path / "with-heads"
    shutil.copytree(tiny_model_dir, out)
    model = _model(out)
    torch.manual_seed(0)
    heads = MTPHeads(model, 2)
    heads.tokens_seen = 1234
    heads.info = {"trunk": "frozen", "heldout_repos": ["/src/x"]}
    save_mtp_heads(out, heads, num_hidden_layers=model.config.num_hidden_layers)
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_heads_round_trip(with_heads) -> None:
    model = _model(with_heads)
    heads = load_mtp_heads(with_heads, model)
    assert heads is not None and len(heads) == 2
    assert heads.tokens_seen == 1234 and heads.info["heldout_repos"] == ["/src/x"]
    torch.manual_seed(0)
    fresh = MTPHeads(model, 2)   # the same draw as the saved ones
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in heads.state_dict().items())
    meta = read_mtp_meta(with_heads)
    assert meta["model_type"] == "llama" and meta["hidden_size"] == model.config.hidden_size
    assert meta["dtype"] == "float32" and meta["block"] == "LlamaDecoderLayer" and meta["num_hidden_layers"] == 2


def test_a_model_with_heads_loads_and_computes_as_without(with_heads, tiny_model_dir) -> None:
    ids = torch.arange(12)[None]
    plain, loaded = _model(tiny_model_dir), _model(with_heads)
    assert torch.equal(_logits(plain, ids), _logits(loaded, ids))
    load_mtp_heads(with_heads, loaded)   # attaching heads changes nothing in the base model
    assert torch.equal(_logits(plain, ids), _logits(loaded, ids))
    assert load_mtp_heads(tiny_model_dir, plain) is None and not has_mtp_heads(tiny_model_dir)


def test_the_weights_index_names_only_the_models_file(with_heads) -> None:
    from safetensors import safe_open

    index = json.loads((with_heads / MODEL_INDEX).read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    with safe_open(str(with_heads / "model.safetensors"), framework="pt") as f:
        assert set(index["weight_map"]) == set(f.keys())


def test_heads_for_another_model_are_refused(with_heads) -> None:
    meta = json.loads((with_heads / "mtp.json").read_text())
    (with_heads / "mtp.json").write_text(json.dumps({**meta, "hidden_size": 999}))
    with pytest.raises(MTPError, match="hidden_size = 999") as err:
        load_mtp_heads(with_heads, _model(with_heads))
    assert "atelier mtp attach" in err.value.hint


@pytest.mark.parametrize("damage", ["no-weights", "no-meta", "bad-json", "missing-key", "more-heads", "zero"])
def test_damaged_heads_give_typed_errors(with_heads, damage) -> None:
    meta_path = with_heads / "mtp.json"
    meta = json.loads(meta_path.read_text())
    if damage == "no-weights":
        (with_heads / "mtp.safetensors").unlink()
    elif damage == "no-meta":
        meta_path.unlink()
    elif damage == "bad-json":
        meta_path.write_text("{heads: 2")
    elif damage == "missing-key":
        meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "tokens_seen"}))
    elif damage == "more-heads":
        meta_path.write_text(json.dumps({**meta, "heads": 3}))
    else:
        meta_path.write_text(json.dumps({**meta, "heads": 0}))
    with pytest.raises(MTPError) as err:
        load_mtp_heads(with_heads, _model(with_heads))
    assert err.value.hint
