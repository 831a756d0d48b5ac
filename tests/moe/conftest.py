"""Shared helpers: a tiny MoE model from a config, and a reference sampler that records routes."""

from __future__ import annotations

import torch

from atelier.inference.tiny import tiny_moe_config
from atelier.moe.replay import RouterReplay


def tiny_moe(seed: int = 0, dtype=torch.float32, arch: str = "mixtral"):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_experts=8,
                                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, norm_topk_prob=True)
    else:
        config = tiny_moe_config(512)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def sample_with_cache(model, prompt: list[int], n_new: int, seed: int = 0):
    """A sampler as an engine runs it: prefill, then one token per step through the KV cache.
    Returns the sequence, the sampled tokens' logprobs and the routes recorded for every fed token."""
    g = torch.Generator().manual_seed(seed)
    replay = RouterReplay(model)
    ids = list(prompt)
    logps = []
    with torch.no_grad(), replay.record():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(n_new):
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=g))
            ids.append(tok)
            logps.append(float(logp[tok]))
            out = model(input_ids=torch.tensor([[tok]]), cache=out.past_key_values, use_cache=True)
    routes = replay.recorded()[:-1]                  # the last step fed the final token: keep T - 1 rows
    routes = torch.cat([routes, torch.full_like(routes[:1], -1)])   # the final token: no record
    replay.remove()
    return ids, logps, routes


def trainer_logprobs(model, ids: list[int], n_new: int):
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logp[-n_new:]
