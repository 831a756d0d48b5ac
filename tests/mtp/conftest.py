"""Shared helpers: a tiny Llama built from a config, and one whose heads can copy the teacher."""

from __future__ import annotations

import torch


def tiny_lm(seed: int = 0, attn: str = "sdpa", vocab: int = 97, layers: int = 2):
    """A tiny random Llama (fp32, eval mode) with logits spread enough to have clear argmaxes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, tie_word_embeddings=True, attn_implementation=attn)
    return LlamaForCausalLM(config).eval()


def silence_residual_branches(layer) -> None:
    """A decoder layer whose attention and MLP add nothing: it passes its input through."""
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


def copying_model_and_heads(heads: int, copy: str = "embedding"):
    """A trunk whose last hidden state at p is embed(t_p) (every layer passes its input through),
    and heads whose projection keeps one half of their input: "embedding" (the embedding of
    t_{i+k}, so head k at i reproduces the teacher at i+k), or "hidden" (h^{k-1}_i, the teacher one
    position too early)."""
    from atelier.mtp.heads import MTPHeads

    model = tiny_lm()
    for layer in model.model.layers:
        silence_residual_branches(layer)
    mtp = MTPHeads(model, heads)
    H = model.config.hidden_size
    with torch.no_grad():
        for head in mtp.heads:
            silence_residual_branches(head.block)
            keep = torch.zeros(H, 2 * H)
            offset = H if copy == "embedding" else 0
            keep[:, offset:offset + H] = torch.eye(H)
            head.proj.weight.copy_(keep)
    return model, mtp
