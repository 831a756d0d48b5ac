"""Chunked logprobs equal the unchunked log-softmax: values, entropy and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from atelier.train.head import token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_the_whole_log_softmax(tiny_model_dir, temperature):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 23), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 17:] = 0
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / temperature
    whole = torch.log_softmax(logits[:, :-1], -1)
    want = torch.cat([torch.zeros(3, 1), whole.gather(-1, ids[:, 1:, None]).squeeze(-1)], 1)
    want_ent = torch.cat([torch.zeros(3, 1), -(whole.exp() * whole).sum(-1)], 1)
    (want * attn).sum().backward()
    want_grad = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for chunk in (1, 5, 22, 512):
        got, ent = token_logprobs(model, ids, attn, temperature, want_entropy=True, chunk=chunk)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
        (got * attn).sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want_grad[n], rtol=1e-4, atol=1e-5)
        model.zero_grad()
