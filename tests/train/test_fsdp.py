"""On one rank, `compute_weights` does what FSDP2's bf16 policy does on many."""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from atelier.train.fsdp import compute_weights
from atelier.train.head import PolicyHead
from atelier.train.ranks import ONE_CPU_RANK


def test_one_rank_bf16_computes_with_bf16_copies_and_accumulates_fp32_master_grads(tiny_model_dir):
    """What FSDP2's MixedPrecisionPolicy(bf16, reduce fp32) does on N ranks, on one: the same
    gradients as the bf16-cast model, summed over micro-batches in fp32 into the fp32 masters."""
    head = PolicyHead(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    want_head = copy.deepcopy(head)
    for p in want_head.parameters():   # parameters only: buffers (rotary frequencies) stay fp32, as in FSDP
        p.data = p.data.to(torch.bfloat16)
    masters = dict(head.named_parameters())
    g = torch.Generator().manual_seed(0)
    micro = [torch.randint(0, head.lm.config.vocab_size, (2, 11), generator=g) for _ in range(2)]
    want = {n: torch.zeros_like(p) for n, p in masters.items()}
    for ids in micro:
        want_head(ids, torch.ones_like(ids))[0].sum().backward()
        for n, p in want_head.named_parameters():
            want[n] += p.grad.float()
        want_head.zero_grad()
    with compute_weights([head], ONE_CPU_RANK, "bf16"):
        assert all(p.dtype == torch.bfloat16 for p in head.parameters())
        assert head.lm.get_output_embeddings().weight is head.lm.get_input_embeddings().weight  # still tied
        for ids in micro:
            logp, _ = head(ids, torch.ones_like(ids))
            logp.sum().backward()
    assert dict(head.named_parameters()) == masters   # the fp32 masters are back, the same objects
    for n, p in masters.items():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, want[n], rtol=1e-3, atol=1e-5, msg=n)
    with compute_weights([head], ONE_CPU_RANK, "fp32"):   # fp32: untouched
        assert all(p.dtype == torch.float32 for p in head.parameters())
