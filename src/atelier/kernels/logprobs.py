"""Token logprobs and entropy from final hidden states: chunked over tokens, with a written-out backward.

Legend: N = tokens (all sequences of a micro-batch, flattened), C = tokens in
one chunk, V = vocabulary, H = hidden.

`chunked_logprobs(h_NH, weight_VH, bias_V, targets_N, temperature, chunk)`
returns log_softmax(h @ W.T + b)[n, targets[n]] / temperature for every n
(and, on request, the entropy of each row's distribution) without ever
holding more than one [C, V] block of logits, in the forward or the backward.

Why a hand-written backward rather than autograd over `log_softmax` under
activation checkpointing (what the trainer did before): that path spent
most of its time outside its matrix multiplies, in many passes over fp32
[C, V] blocks (cast, divide, logsumexp's max/subtract/exp/sum, the gather's
scatter into a zero block, logsumexp's backward, the cast back), each a fresh
allocation (docs/log/2026-12-03-figures-from-the-code.md).
Here the vocabulary-wide work is done by row-wise fused kernels: forward,
one matmul, one cast, one `log_softmax` (plus an `exp` and a dot for the
entropy); backward, the same matmul again, one `softmax`, one scale, one
scatter-add, one cast and the two gradient matmuls. The backward skips the
tokens whose logprob gets no gradient (prompt tokens, padding: their rows
contribute exactly zero). Only the hidden states are saved, so the function
is its own checkpoint.

Numerics: the logits leave the matmul in the compute dtype (bf16 under bf16
compute, as `F.linear` gives them); everything vocabulary-wide (log-softmax,
softmax, entropy, the logits' gradient) is fp32; the logits' gradient is
rounded to the compute dtype only to enter the two backward matmuls, and the
weight's gradient is summed over chunks in fp32 and rounded once.
`reference_logprobs` is the plain autograd definition that the tests hold
this function to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_logprobs(h_NH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                       targets_N: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: one whole fp32 [N, V] log-softmax (what `chunked_logprobs` never holds)."""
    logp_NV = torch.log_softmax(F.linear(h_NH, weight_VH, bias_V).float() / temperature, -1)
    picked_N = logp_NV.gather(-1, targets_N[:, None]).squeeze(-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return picked_N, entropy_N.detach()


def _scaled_logits(h_CH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                   inv_temp: float) -> torch.Tensor:
    z_CV = F.linear(h_CH, weight_VH, bias_V)
    z_CV = z_CV.float() if z_CV.dtype != torch.float32 else z_CV   # a fresh fp32 block either way
    if inv_temp != 1.0:
        z_CV.mul_(inv_temp)
    return z_CV


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NH, weight_VH, bias_V, targets_N, inv_temp: float, chunk: int, want_entropy: bool):
        N = h_NH.shape[0]
        logp_N = torch.empty(N, dtype=torch.float32, device=h_NH.device)
        ent_N = torch.zeros(N, dtype=torch.float32, device=h_NH.device)
        for s in range(0, N, chunk):
            lsm_CV = torch.log_softmax(_scaled_logits(h_NH[s:s + chunk], weight_VH, bias_V, inv_temp), -1)
            logp_N[s:s + chunk] = lsm_CV.gather(-1, targets_N[s:s + chunk, None]).squeeze(-1)
            if want_entropy:   # -sum_v p_v log p_v, as one batched dot per row
                p_CV = lsm_CV.exp()
                ent_N[s:s + chunk] = -torch.bmm(p_CV[:, None, :], lsm_CV[:, :, None]).view(-1)
        ctx.save_for_backward(h_NH, weight_VH, bias_V, targets_N)
        ctx.inv_temp, ctx.chunk = inv_temp, chunk
        ctx.mark_non_differentiable(ent_N)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, g_logp_N, _g_ent_N):
        h_NH, weight_VH, bias_V, targets_N = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # d logp_n / d logits_n = (onehot(target_n) - softmax_n) / temperature
        g_N = g_logp_N.float() * ctx.inv_temp
        rows_R = g_N.nonzero().squeeze(1)   # tokens whose logprob reaches the loss
        h_RH, t_R, g_R = h_NH.index_select(0, rows_R), targets_N.index_select(0, rows_R), g_N.index_select(0, rows_R)
        grad_h_RH = torch.empty_like(h_RH) if need_h else None
        grad_w_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if need_w else None
        grad_b_V = torch.zeros(weight_VH.shape[0], dtype=torch.float32, device=weight_VH.device) if need_b else None
        for s in range(0, h_RH.shape[0], ctx.chunk):
            h_CH, g_C = h_RH[s:s + ctx.chunk], g_R[s:s + ctx.chunk]
            gz_CV = torch.softmax(_scaled_logits(h_CH, weight_VH, bias_V, ctx.inv_temp), -1)
            gz_CV.mul_(-g_C[:, None]).scatter_add_(-1, t_R[s:s + ctx.chunk, None], g_C[:, None])
            gz_CV = gz_CV.to(weight_VH.dtype)
            if need_h:
                torch.mm(gz_CV, weight_VH, out=grad_h_RH[s:s + ctx.chunk])
            if need_w:
                if gz_CV.dtype == torch.float32:
                    grad_w_VH.addmm_(gz_CV.t(), h_CH)
                else:
                    grad_w_VH.add_(gz_CV.t() @ h_CH)
            if need_b:
                grad_b_V.add_(gz_CV.sum(0, dtype=torch.float32))
        grad_h_NH = None
        if need_h:
            grad_h_NH = torch.zeros_like(h_NH).index_copy_(0, rows_R, grad_h_RH)
        return (grad_h_NH, grad_w_VH.to(weight_VH.dtype) if need_w else None,
                grad_b_V.to(bias_V.dtype) if need_b else None, None, None, None, None)


def chunked_logprobs(h_NH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                     targets_N: torch.Tensor, temperature: float, chunk: int,
                     want_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp32 logprobs of `targets_N` (differentiable) and entropies (zeros unless asked)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    return _ChunkedLogprobs.apply(h_NH, weight_VH, bias_V, targets_N, 1.0 / temperature, chunk, want_entropy)
