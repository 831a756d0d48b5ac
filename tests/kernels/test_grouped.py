"""The low-precision expert matmul as an autograd function.

Stated tolerances (relative Frobenius error against float32 autograd of the
plain grouped matmul, on unit-variance data): MXFP8 outputs and gradients
within 6%, the NVFP4 forward within 20% (E2M1 keeps 2 significant bits);
bfloat16 autograd, the everyday reference, is within 1%. Finite differences
check the plumbing (grouping, transposes, both gradients) with the
quantisers off, in float64: a quantiser's exact derivative is zero almost
everywhere, which is why its gradient is taken straight through.
"""

from __future__ import annotations

import pytest
import torch

from atelier.kernels.grouped import grouped_linear, grouped_mm_reference, grouped_wgrad_reference
from atelier.kernels.quant import fake_quant

SIZES = [9, 0, 40, 15]


def problem(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    off = torch.tensor([0] + SIZES).cumsum(0)
    x = torch.randn(sum(SIZES), 64, generator=g, dtype=dtype).requires_grad_(True)
    w = (torch.randn(len(SIZES), 32, 64, generator=g, dtype=dtype) / 8).requires_grad_(True)
    return x, w, off


def plain(x, w, off):
    return torch.cat([x[int(off[g]):int(off[g + 1])] @ w[g].t() for g in range(w.shape[0])])


def rel(a, b):
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


def test_finite_differences_without_quantisation():
    g = torch.Generator().manual_seed(0)
    off = torch.tensor([0, 3, 3, 7, 9])
    x = torch.randn(9, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(4, 5, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, w: grouped_linear(x, w, off, "none", "reference"), (x, w))


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4_fwd_mxfp8_bwd"])
def test_quantised_gradients_are_the_stated_formulas(recipe):
    x, w, off = problem()
    dy = torch.randn(x.shape[0], 32)
    y = grouped_linear(x, w, off, recipe, "reference")
    y.backward(dy)
    fwd = "nvfp4" if recipe.startswith("nvfp4") else "mxfp8"
    assert torch.equal(y, grouped_mm_reference(x.detach(), w.detach().transpose(1, 2), off, fwd))
    expect_dx = torch.cat([fake_quant(dy[int(off[g]):int(off[g + 1])], "mxfp8")
                           @ fake_quant(w.detach()[g], "mxfp8", dim=0) for g in range(4)])
    assert torch.equal(x.grad, expect_dx)
    assert torch.equal(w.grad, grouped_wgrad_reference(dy, x.detach(), off, "mxfp8"))


@pytest.mark.parametrize("recipe,fwd_tol", [("mxfp8", 0.06), ("nvfp4_fwd_mxfp8_bwd", 0.2)])
def test_quantised_gradients_are_near_float32_and_bf16(recipe, fwd_tol):
    x, w, off = problem()
    dy = torch.randn(x.shape[0], 32)
    y = grouped_linear(x, w, off, recipe, "reference")
    y.backward(dy)
    x32, w32 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y32 = plain(x32, w32, off)
    y32.backward(dy)
    xb, wb = x.detach().bfloat16().requires_grad_(True), w.detach().bfloat16().requires_grad_(True)
    yb = plain(xb, wb, off)
    yb.backward(dy.bfloat16())
    assert rel(yb.float(), y32) < 0.01 and rel(xb.grad.float(), x32.grad) < 0.01
    assert rel(y, y32) < fwd_tol
    assert rel(x.grad, x32.grad) < 0.06 and rel(w.grad, w32.grad) < 0.06
    assert rel(x.grad, xb.grad.float()) < 0.06 and rel(w.grad, wb.grad.float()) < 0.06


def test_triton_backend_matches_reference_through_autograd():
    pytest.importorskip("triton")
    x, w, off = problem(seed=3)
    dy = torch.randn(x.shape[0], 32)
    outs = []
    for backend in ("reference", "triton"):
        xi, wi = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
        y = grouped_linear(xi, wi, off, "nvfp4_fwd_mxfp8_bwd", backend)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, wi.grad))
    for got, ref in zip(outs[1], outs[0]):
        assert rel(got, ref) < 1e-5


def test_unknown_recipe():
    x, w, off = problem()
    with pytest.raises(KeyError, match="known"):
        grouped_linear(x, w, off, "fp2")
