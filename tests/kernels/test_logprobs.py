"""The chunked logprob function against its plain autograd definition (values, entropy, gradients)."""

from __future__ import annotations

import pytest
import torch

from atelier.kernels.logprobs import chunked_logprobs, reference_logprobs


def operands(dtype: torch.dtype, bias: bool, N: int = 37, V: int = 301, H: int = 24):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(N, H, generator=g) * 2).to(dtype).requires_grad_()
    w = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    weight = torch.rand(N, generator=g)
    weight[::3] = 0.0   # tokens outside the loss: the backward skips them, their gradient is zero
    return h, w, b, t, weight


def grads(logp, weight, tensors):
    return torch.autograd.grad((logp * weight).sum(), [x for x in tensors if x is not None])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_the_whole_log_softmax_in_fp32(temperature, bias):
    h, w, b, t, weight = operands(torch.float32, bias)
    want, want_ent = reference_logprobs(h, w, b, t, temperature)
    want_grads = grads(want, weight, (h, w, b))
    for chunk in (1, 5, 37, 100):
        got, ent = chunked_logprobs(h, w, b, t, temperature, chunk, want_entropy=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
        for got_g, want_g in zip(grads(got, weight, (h, w, b)), want_grads):
            torch.testing.assert_close(got_g, want_g, rtol=1e-5, atol=1e-5)
        assert not ent.requires_grad


def test_bf16_matches_the_reference_computed_from_the_same_bf16_logits():
    """Both round the logits to bf16 in the matmul; everything after is fp32 in both, so the
    values agree to fp32 precision and the gradients to bf16's (they are rounded once to enter
    the backward matmuls here, while autograd rounds the reference's to bf16 after each op)."""
    h, w, b, t, weight = operands(torch.bfloat16, True)
    want, want_ent = reference_logprobs(h, w, b, t, 1.0)
    got, ent = chunked_logprobs(h, w, b, t, 1.0, 8, want_entropy=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    h32, w32, b32 = (x.detach().float().requires_grad_() for x in (h, w, b))
    exact = grads(reference_logprobs(h32, w32, b32, t, 1.0)[0], weight, (h32, w32, b32))
    for got_g, want_g, x in zip(grads(got, weight, (h, w, b)), exact, (h, w, b)):
        assert got_g.dtype == x.dtype == torch.bfloat16
        scale = want_g.abs().max()
        assert (got_g.float() - want_g).abs().max() <= 0.02 * scale


def test_no_gradient_needed_and_zero_tokens():
    h, w, b, t, _ = operands(torch.float32, False)
    with torch.no_grad():
        got, ent = chunked_logprobs(h, w, None, t, 1.0, 4)
    torch.testing.assert_close(got, reference_logprobs(h, w, None, t, 1.0)[0])
    assert not got.requires_grad and not ent.any()   # entropy only on request
    empty, _ = chunked_logprobs(h[:0], w, None, t[:0], 1.0, 4)
    assert empty.shape == (0,)
    with pytest.raises(ValueError):
        chunked_logprobs(h, w, None, t, 1.0, 0)
