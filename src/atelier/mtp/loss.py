"""Self-distillation of the heads: KL(main at i+k || head k at i), chunked, the teacher detached.

Legend: B = sequences, T = tokens, N = B*T positions (flattened), K = heads, C = positions in one
chunk, V = vocabulary, H = hidden.

Every head is laid out on the teacher's positions: head k's row at teacher position j = i + k is
its output at i (rows j < k are empty, weight 0). Then one chunk of C teacher positions serves
all K heads: the teacher's log-softmax is computed once per chunk and compared with each head's.
For each position j and head k,

    KL_kj = sum_v p_j(v) (log p_j(v) - log q_kj(v)) = sum_v p_j log p_j - sum_v p_j log q_kj

with p the main head's distribution (temperature 1) and q head k's. Both are projections of
normed hidden states by the shared lm_head W: p from the trunk's (always detached: the teacher
gets no gradient from this loss, whether the trunk trains or not), q from the head's.

Why the gradient is computed in the forward (as Liger-Kernel's fused linear losses do) rather
than recomputed in a backward: the loss is a weighted sum, so d loss / d z_kj = w_kj (q_kj - p_j)
is known in the forward, while the [C, V] blocks are in hand; the head's hidden-state gradient
(and the lm_head's, when it trains) is then one or two products per chunk, and the backward only
scales what was kept by the upstream gradient. Nothing of size V outlives its chunk; what is kept
is [K, N, H] (and [V, H] when W trains), the size of the inputs. The vocabulary-wide work is
fp32 (log-softmax, softmax, dots), the products in the weights' dtype, as in
atelier.kernels.logprobs. Beside the loss the forward returns what costs nothing more: each
head's KL and greedy agreement per position, and the teacher's logprob of the next token (the
main loss of a frozen trunk, which needs no other pass over the vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DistillOutput:
    """One call of `distill_kl`; rows are teacher positions."""

    loss: torch.Tensor               # scalar: sum over heads and positions of weight * KL (differentiable)
    kl_KN: torch.Tensor              # per-position KL of each head (no gradient; 0 where a chunk has no weight)
    match_KN: torch.Tensor           # bool: head k's argmax equals the teacher's at that position
    teacher_logp_N: torch.Tensor     # log p_j(targets_N[j]) (no gradient)


def reference_kl(teacher_NH: torch.Tensor, student_KNH: torch.Tensor, weight_VH: torch.Tensor,
                 bias_V: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
    """The definition, with whole [K, N, V] blocks: KL(p || q_k) per head and position (over the
    first `vocab` ids, both renormalised there, when given)."""
    vocab = vocab or weight_VH.shape[0]
    weight_VH, bias_V = weight_VH[:vocab], bias_V[:vocab] if bias_V is not None else None
    logp_NV = torch.log_softmax(F.linear(teacher_NH, weight_VH, bias_V).float(), -1)
    logq_KNV = torch.log_softmax(F.linear(student_KNH, weight_VH, bias_V).float(), -1)
    return (logp_NV.exp() * (logp_NV - logq_KNV)).sum(-1)


def _logits(h_CH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None) -> torch.Tensor:
    z_CV = F.linear(h_CH, weight_VH, bias_V)
    return z_CV.float() if z_CV.dtype != torch.float32 else z_CV


def _teacher_chunk(t_CH, weight_VH, bias_V, targets_C, vocab: int):
    """The teacher's distribution over the first `vocab` ids, its negative entropy, its argmax over
    the whole vocabulary (what a verifier's greedy choice is) and the whole-vocabulary logprob of
    each target."""
    z_CV = _logits(t_CH, weight_VH, bias_V)
    best_C = z_CV.argmax(-1)
    lse_C = torch.logsumexp(z_CV, -1)
    logp_target_C = z_CV.gather(-1, targets_C[:, None]).squeeze(-1) - lse_C
    logp_CS = z_CV.sub_(lse_C[:, None]) if vocab == z_CV.shape[1] else torch.log_softmax(z_CV[:, :vocab], -1)
    p_CS = logp_CS.exp()
    neg_entropy_C = torch.bmm(p_CS[:, None, :], logp_CS[:, :, None]).view(-1)
    return p_CS, neg_entropy_C, best_C, logp_target_C


class _DistillKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, teacher_NH, student_KNH, weight_VH, bias_V, weights_KN, targets_N, chunk: int, vocab: int,
                need_student: bool, need_weight: bool):
        K, N, H = student_KNH.shape
        dev = teacher_NH.device
        w_SH, b_S = weight_VH[:vocab], bias_V[:vocab] if bias_V is not None else None
        kl_KN = torch.zeros(K, N, dtype=torch.float32, device=dev)
        match_KN = torch.zeros(K, N, dtype=torch.bool, device=dev)
        teacher_logp_N = torch.empty(N, dtype=torch.float32, device=dev)
        grad_s_KNH = torch.zeros_like(student_KNH) if need_student else None
        grad_w_VH = torch.zeros(weight_VH.shape, dtype=torch.float32, device=dev) if need_weight else None
        grad_b_V = torch.zeros(weight_VH.shape[0], dtype=torch.float32, device=dev) \
            if need_weight and bias_V is not None else None
        for s in range(0, N, chunk):
            e = min(s + chunk, N)
            p_CS, neg_entropy_C, best_C, teacher_logp_N[s:e] = _teacher_chunk(
                teacher_NH[s:e], weight_VH, bias_V, targets_N[s:e], vocab)
            for k in range(K):
                w_C = weights_KN[k, s:e]
                if not bool(w_C.any()):
                    continue   # e.g. the first k positions of every chunk that starts a sequence
                h_CH = student_KNH[k, s:e]
                logq_CS = torch.log_softmax(_logits(h_CH, w_SH, b_S), -1)
                kl_KN[k, s:e] = neg_entropy_C - torch.bmm(p_CS[:, None, :], logq_CS[:, :, None]).view(-1)
                match_KN[k, s:e] = logq_CS.argmax(-1) == best_C
                if not (need_student or need_weight):
                    continue
                # d (w * KL) / d z = w * (q - p), in place over log q's block
                g_CS = logq_CS.exp_().sub_(p_CS).mul_(w_C[:, None].float()).to(weight_VH.dtype)
                if need_student:
                    torch.mm(g_CS, w_SH, out=grad_s_KNH[k, s:e])
                if need_weight:
                    if g_CS.dtype == torch.float32:
                        grad_w_VH[:vocab].addmm_(g_CS.t(), h_CH)
                    else:   # the product in the compute dtype, summed over chunks in fp32
                        grad_w_VH[:vocab].add_(g_CS.t() @ h_CH)
                    if grad_b_V is not None:
                        grad_b_V[:vocab].add_(g_CS.sum(0, dtype=torch.float32))
        loss = (kl_KN * weights_KN.float()).sum()
        ctx.save_for_backward(*(t for t in (grad_s_KNH, grad_w_VH, grad_b_V) if t is not None))
        ctx.kept = (grad_s_KNH is not None, grad_w_VH is not None, grad_b_V is not None)
        ctx.dtypes = (weight_VH.dtype, bias_V.dtype if bias_V is not None else None)
        ctx.mark_non_differentiable(kl_KN, match_KN, teacher_logp_N)
        return loss, kl_KN, match_KN, teacher_logp_N

    @staticmethod
    def backward(ctx, g_loss, _g_kl, _g_match, _g_logp):
        saved = iter(ctx.saved_tensors)
        grad_s, grad_w, grad_b = (next(saved) if kept else None for kept in ctx.kept)
        return (None,
                grad_s * g_loss.to(grad_s.dtype) if grad_s is not None else None,
                (grad_w * g_loss).to(ctx.dtypes[0]) if grad_w is not None else None,
                (grad_b * g_loss).to(ctx.dtypes[1]) if grad_b is not None else None,
                None, None, None, None, None, None)


def distill_kl(teacher_NH: torch.Tensor, student_KNH: torch.Tensor, weight_VH: torch.Tensor,
               bias_V: torch.Tensor | None, weights_KN: torch.Tensor, targets_N: torch.Tensor | None = None,
               chunk: int = 256, vocab: int | None = None) -> DistillOutput:
    """sum_k sum_j weights[k, j] * KL(p_j || q_kj), with p from `teacher_NH` (normed trunk states,
    detached here) and q_k from `student_KNH` (normed head states on the teacher's positions),
    both through the lm_head `weight_VH` (+ `bias_V`). Gradients reach the students and, when it
    requires them, the lm_head; never the teacher. `targets_N`: ids whose teacher logprob to return.

    `vocab`: p and q are the distributions over the first `vocab` token ids only, each renormalised
    there (a drafter that proposes only those ids needs nothing else, and its vocabulary work is
    `vocab / V` of the whole); the match is still against the teacher's argmax over the whole
    vocabulary, the token a greedy verifier keeps. None: the whole vocabulary."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    V = weight_VH.shape[0]
    vocab = V if vocab is None else vocab
    if not 1 <= vocab <= V:
        raise ValueError(f"vocab must be in 1..{V}, got {vocab}")
    if targets_N is None:
        targets_N = torch.zeros(teacher_NH.shape[0], dtype=torch.long, device=teacher_NH.device)
    grad_on = torch.is_grad_enabled()
    need_student = grad_on and student_KNH.requires_grad
    need_weight = grad_on and weight_VH.requires_grad
    loss, kl_KN, match_KN, logp_N = _DistillKL.apply(teacher_NH.detach(), student_KNH, weight_VH, bias_V,
                                                      weights_KN, targets_N, chunk, vocab, need_student,
                                                      need_weight)
    return DistillOutput(loss, kl_KN, match_KN, logp_N)


def align_to_teacher(h_BTkH: torch.Tensor, k: int) -> torch.Tensor:
    """Head k's [B, T-k, *] rows moved to the teacher's positions: [B, T, *], row j = i + k holds i."""
    return F.pad(h_BTkH, (0, 0, k, 0))


def head_weights(mask_BT: torch.Tensor, heads: int) -> torch.Tensor:
    """[K, B, T] weights on teacher positions: head k at j = i + k counts when position j's target
    (token j + 1) is a training target (mask 1) and the head has a row there (j >= k)."""
    B, T = mask_BT.shape
    target_BT = torch.zeros_like(mask_BT, dtype=torch.float32)
    target_BT[:, :-1] = mask_BT[:, 1:].float()
    weights = target_BT[None].repeat(heads, 1, 1)
    for k in range(1, heads + 1):
        weights[k - 1, :, :k] = 0
    return weights
