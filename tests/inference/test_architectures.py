"""Architectures the batched forward supports match Hugging Face; others are refused by name."""

from __future__ import annotations

import pytest
import torch

from atelier.inference.engine import LocalEngine
from atelier.inference.forward import UnsupportedModel
from atelier.inference.types import SamplingParams


def _save(model, tokenizer, out):
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_qwen2_with_attention_bias_matches_hf_greedy(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from atelier.inference.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # make the q/k/v biases matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.normal_(0, 0.5)
            layer.self_attn.k_proj.bias.normal_(0, 0.5)
    path = _save(model, tok, tmp_path / "qwen2")
    ids = tok.encode("def main():\n    return")
    with LocalEngine(path, dtype="float32") as engine:
        got = engine.generate(ids, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(-1,)))
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.token_ids == ref[0, len(ids):].tolist()


def test_unsupported_architecture_is_refused_with_a_way_out(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from atelier.inference.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    path = _save(model, tok, tmp_path / "gpt2")
    with pytest.raises(UnsupportedModel, match="gpt2") as info:
        LocalEngine(path)
    assert "OpenAI-compatible" in info.value.hint


def test_tiny_moe_matches_hf_greedy(tmp_path):
    from transformers import AutoModelForCausalLM

    from atelier.inference.tiny import build_tiny_model, build_tiny_tokenizer

    path = build_tiny_model(tmp_path / "tiny-moe", moe=True, initializer_range=0.2)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = build_tiny_tokenizer().encode("def main():\n    return")
    with LocalEngine(path) as engine:
        got = engine.generate(ids, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(-1,)))
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got.token_ids == ref[0, len(ids):].tolist()
    assert len(set(got.token_ids)) > 3     # not one token repeated: the comparison has teeth
