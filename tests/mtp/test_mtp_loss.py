"""The distillation loss against its definition, the layout of heads on teacher positions, and
acceptance counted by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atelier.mtp.acceptance import Acceptance
from atelier.mtp.loss import align_to_teacher, distill_kl, head_weights, reference_kl


def _tensors(seed: int = 0, K: int = 3, N: int = 11, H: int = 8, V: int = 29, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(N, H, generator=g)
    student = torch.randn(K, N, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    b = torch.randn(V, generator=g) if bias else None
    weights = torch.rand(K, N, generator=g)
    weights[0, :2] = 0
    return teacher, student, weight, b, weights


def _direct(teacher, student, weight, b, weights):
    """KL(p || q) written out with F.kl_div, the teacher's logits detached."""
    logp = torch.log_softmax(F.linear(teacher, weight.detach(), None if b is None else b.detach()), -1)
    total = 0.0
    for k in range(student.shape[0]):
        logq = torch.log_softmax(F.linear(student[k], weight, b), -1)
        kl = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
        total = total + (kl * weights[k]).sum()
    return total


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_a_direct_computation(chunk, bias) -> None:
    teacher, student, weight, b, weights = _tensors(bias=bias)
    s1, w1 = student.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    b1 = b.clone().requires_grad_(True) if bias else None
    out = distill_kl(teacher, s1, w1, b1, weights, chunk=chunk)
    s2, w2 = student.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    b2 = b.clone().requires_grad_(True) if bias else None
    expected = _direct(teacher, s2, w2, b2, weights)
    assert float(out.loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    counted = weights > 0   # a chunk none of whose rows count is skipped
    assert torch.allclose(out.kl_KN[counted], reference_kl(teacher, student, weight, b)[counted], atol=1e-5)
    (3.0 * out.loss).backward()
    (3.0 * expected).backward()
    assert torch.allclose(s1.grad, s2.grad, atol=1e-5)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-5)   # the student's side only: the teacher is detached
    if bias:
        assert torch.allclose(b1.grad, b2.grad, atol=1e-5)


def test_the_teacher_gets_no_gradient_and_side_outputs_are_exact() -> None:
    teacher, student, weight, _, weights = _tensors()
    teacher.requires_grad_(True)
    student.requires_grad_(True)
    targets = torch.arange(teacher.shape[0]) % weight.shape[0]
    out = distill_kl(teacher, student, weight, None, weights, targets, chunk=5)
    out.loss.backward()
    assert teacher.grad is None
    logp = torch.log_softmax(teacher.detach() @ weight.T, -1)
    assert torch.allclose(out.teacher_logp_N, logp.gather(-1, targets[:, None]).squeeze(-1), atol=1e-6)
    best = (student.detach() @ weight.T).argmax(-1) == logp.argmax(-1)
    assert torch.equal(out.match_KN[weights > 0], best[weights > 0])


def test_a_student_equal_to_its_teacher_has_zero_loss() -> None:
    teacher, _, weight, _, weights = _tensors()
    out = distill_kl(teacher, teacher[None].repeat(3, 1, 1), weight, None, weights, chunk=4)
    assert float(out.loss) == pytest.approx(0.0, abs=1e-5)
    assert bool(out.match_KN[weights > 0].all())


def test_bf16_follows_the_fp32_definition() -> None:
    teacher, student, weight, _, weights = _tensors(V=301, H=32)
    s = student.to(torch.bfloat16).requires_grad_(True)
    out = distill_kl(teacher.bfloat16(), s, weight.bfloat16(), None, weights, chunk=4)
    expected = (reference_kl(teacher, student, weight) * weights).sum()
    assert float(out.loss.detach()) == pytest.approx(float(expected), rel=3e-2)
    out.loss.backward()
    assert s.grad.dtype == torch.bfloat16 and bool(s.grad.abs().sum() > 0)


def test_no_grad_computes_no_gradient() -> None:
    teacher, student, weight, _, weights = _tensors()
    student.requires_grad_(True)
    with torch.no_grad():
        out = distill_kl(teacher, student, weight, None, weights)
    assert not out.loss.requires_grad


def test_heads_are_laid_out_on_the_teacher_positions() -> None:
    h = torch.arange(2 * 3 * 1, dtype=torch.float32).view(2, 3, 1) + 1   # head 2 of T = 5: rows i = 0..2
    aligned = align_to_teacher(h, 2)
    assert aligned.shape == (2, 5, 1)
    assert aligned[:, :2].abs().sum() == 0 and torch.equal(aligned[:, 2:], h)
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    w = head_weights(mask, 2)
    # head k at j counts when token j + 1 is a target and j >= k
    assert w[0].tolist() == [[0, 1, 0, 1, 0]]
    assert w[1].tolist() == [[0, 0, 0, 1, 0]]


def test_acceptance_counts_chains_by_hand() -> None:
    # heads K = 2 over T = 5 (start positions i = 0..2); match[k-1, b, i + k] is head k's draft from i
    match = torch.zeros(2, 1, 5, dtype=torch.bool)
    first = [True, True, False]    # head 1 from starts 0, 1, 2
    second = [True, False, True]   # head 2 from the same starts
    for i in range(3):
        match[0, 0, i + 1] = first[i]
        match[1, 0, i + 2] = second[i]
    weights = torch.ones(2, 1, 5)
    acc = Acceptance(2)
    acc.add(match, weights)
    stats = acc.to_dict()
    assert acc.starts == 3 and acc.chain == [2, 1] and acc.matched == [2, 2]
    assert stats["per_head"][0]["rate"] == pytest.approx(2 / 3)
    assert stats["per_head"][1]["rate"] == pytest.approx(1 / 2)   # start 2's head 2 matched after a miss
    assert stats["mean_accepted_length"] == pytest.approx(1 + (2 + 1) / 3)
    other = Acceptance(2)
    other.add(match, weights)
    acc.merge(other)
    assert acc.to_dict()["mean_accepted_length"] == pytest.approx(stats["mean_accepted_length"])
    assert acc.starts == 6


def test_a_draft_vocabulary_distils_on_its_ids_and_matches_the_whole_vocabularys_argmax() -> None:
    teacher, student, weight, b, weights = _tensors(V=40, bias=True)
    s1 = student.clone().requires_grad_(True)
    w1 = weight.clone().requires_grad_(True)
    out = distill_kl(teacher, s1, w1, b, weights, chunk=3, vocab=25)
    s2 = student.clone().requires_grad_(True)
    w2 = weight.clone().requires_grad_(True)
    expected = _direct(teacher, s2[:, :, :], w2[:25], b[:25], weights)
    assert float(out.loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    out.loss.backward()
    expected.backward()
    assert torch.allclose(s1.grad, s2.grad, atol=1e-5)
    assert torch.allclose(w1.grad[:25], w2.grad[:25], atol=1e-5) and w1.grad[25:].abs().sum() == 0
    teacher_best = (teacher @ weight.T + b).argmax(-1)
    student_best = (student @ weight[:25].T + b[:25]).argmax(-1)
    counted = weights > 0
    assert torch.equal(out.match_KN[counted], (student_best == teacher_best)[counted])
    full_logp = torch.log_softmax(teacher @ weight.T + b, -1)[:, 0]
    assert torch.allclose(out.teacher_logp_N, full_logp, atol=1e-6)   # targets default to id 0
    with pytest.raises(ValueError):
        distill_kl(teacher, student, weight, b, weights, vocab=41)
