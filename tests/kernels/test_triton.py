"""Triton kernels against the reference: quantisers bit for bit, GEMMs within a stated tolerance.

Tolerance of a GEMM: |C - C_ref| <= 1e-5 * (|A'| @ |B'|) + 1e-30, where A', B'
are the dequantised operands: the kernels multiply exactly representable
block-level values and differ from the reference only in float32
accumulation order and in where the scales are applied.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from atelier.kernels.grouped import grouped_mm_reference, grouped_wgrad_reference  # noqa: E402
from atelier.kernels.quant import fake_quant, mxfp8_quantize, nvfp4_quantize  # noqa: E402
from atelier.kernels.triton_ops import (  # noqa: E402
    grouped_mm_triton,
    grouped_wgrad_triton,
    mxfp8_quantize_triton,
    nvfp4_quantize_triton,
)


def adversarial(R: int, K: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g) * torch.exp2(torch.randint(-25, 25, (R, 1), generator=g).float())
    x[0] = 0.0
    x[1] = 1e-40                              # float32 denormals
    x[2, 0] = 3e38                            # one huge value in a row
    x[3, 5] = float("nan")
    x[4, 17] = float("inf")
    x[5, :16] = -0.0
    x[6] = x[6].bfloat16().float()            # few significant bits: ties on E2M1 midpoints
    x[7, 3] = 448.0 * 2**-3                   # amax / 448 an exact power of two
    # token scale exactly 1 and block scale 448: every E2M1 midpoint is an exact tie
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[8, :16] = 448.0 * torch.cat([mids, -mids])
    x[8, 16:32] = 2688.0
    return x


@pytest.mark.parametrize("shape", [(19, 64), pytest.param((128, 256), marks=pytest.mark.slow)])
def test_nvfp4_quantise_kernel_is_bit_exact(shape):
    # the second case: bf16-valued rows, where x * (1/d) and x / d give different codes (~1 in 3000)
    x = adversarial(*shape) if shape[0] < 64 else torch.randn(shape).bfloat16().float()
    ref, got = nvfp4_quantize(x), nvfp4_quantize_triton(x)
    assert torch.equal(got.packed_RH, ref.packed_RH)
    assert torch.equal(got.block_scales_RB, ref.block_scales_RB)
    assert torch.equal(got.token_scales_R, ref.token_scales_R, ) or torch.equal(
        torch.nan_to_num(got.token_scales_R, nan=-1.0), torch.nan_to_num(ref.token_scales_R, nan=-1.0))


def test_mxfp8_quantise_kernel_is_bit_exact():
    x = adversarial(19, 96, seed=1)
    ref, got = mxfp8_quantize(x), mxfp8_quantize_triton(x)
    assert torch.equal(got.codes_RK, ref.codes_RK)
    assert torch.equal(got.scales_RB, ref.scales_RB)


def groups(sizes: list[int]) -> torch.Tensor:
    return torch.tensor([0] + sizes).cumsum(0)


def assert_close_gemm(got, ref, bound):
    assert got.shape == ref.shape
    assert bool(((got - ref).abs() <= 1e-5 * bound + 1e-30).all()), float((got - ref).abs().max())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_grouped_mm_matches_reference(fmt):
    torch.manual_seed(0)
    sizes = [5, 0, 37, 12]                   # an empty expert, a group longer than one tile
    off = groups(sizes)
    M, R, N = sum(sizes), 64, 48
    a = torch.randn(M, R)
    a[3] *= 1e4                               # one loud token
    w_ENR = torch.randn(len(sizes), N, R) * 0.1
    b = w_ENR.transpose(1, 2)                 # the forward's strided view, as the autograd function passes it
    got = grouped_mm_triton(a, b, off, fmt)
    ref = grouped_mm_reference(a, b, off, fmt)
    aq = fake_quant(a, fmt).abs()
    bound = torch.zeros_like(ref)
    for g in range(len(sizes)):
        s, e = int(off[g]), int(off[g + 1])
        bound[s:e] = aq[s:e] @ fake_quant(b[g], fmt, dim=0).abs()
    assert_close_gemm(got, ref, bound)


def test_grouped_wgrad_matches_reference():
    torch.manual_seed(1)
    sizes = [33, 7, 0, 64]
    off = groups(sizes)
    M, N, K = sum(sizes), 40, 24
    dy, x = torch.randn(M, N), torch.randn(M, K)
    got = grouped_wgrad_triton(dy, x, off)
    ref = grouped_wgrad_reference(dy, x, off, "mxfp8")
    bound = grouped_wgrad_reference(dy.abs(), x.abs(), off, "mxfp8")   # |Q(a)| = Q(|a|): sign-symmetric
    assert_close_gemm(got, ref, bound)
