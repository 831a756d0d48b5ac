"""Reference quantise/dequantise in plain PyTorch: the oracle for every kernel.

Legend: `x_RK` is float32 with R rows (tokens, or output channels of a
weight) and K elements per row, quantised along K in blocks of `BLOCK`.

**NVFP4 variant** (the expert-matmul forward), blocks of 16 along K::

    a_t  = max |x| over the row                      (per token)
    s_t  = a_t / 2688   (2688 = 6 * 448), 1.0 when that is 0      FP32 token scale
    s_b  = E4M3( a_b / (s_t * 6) )   a_b = max |x| over the block  E4M3 block scale
    d    = s_b * s_t                                               FP32, one rounding
    q    = E2M1( x / d )  (0 where d == 0)                         FP4 values
    x'   = value(q) * d

The token scale makes a token's quantisation depend on that token alone: with
one scale per tensor (`scale="tensor"`, kept for comparison) a token's values
change with whatever else is in the batch, so training is batch-variant and
tokens leak into each other. Divisions are IEEE float32 divisions, rounded
once (`division="exact"`); `division="reciprocal"` computes `x * (1 / d)`,
two roundings, the shortcut a fast-math kernel takes, kept to measure how
many codes it changes.

**MXFP8** (the backward), OCP Microscaling layout, blocks of 32 along K::

    a_b = max |x| over the block
    X   = 2 ** ceil(log2(a_b / 448))  an E8M0 code, clamped to [2**-127, 2**127]
    q   = E4M3( x / X )   (saturating)
    x'  = value(q) * X

The scale is rounded up, as NVIDIA's MXFP8 training recipe does, so the
block's largest element lands at or below 448; the OCP v1.0 rule
(2 ** (floor(log2 a_b) - 8)) saturates every element above 448 * X, up to
an eighth of the block's range. X is a power of two, so only a_b / 448 is
a division that can round.

**NaN/Inf policy**: a token (NVFP4) or block (MXFP8) holding a NaN or an
infinity dequantises to all NaN: its scale is stored as NaN (token scale NaN
and block scale code 0x7F; E8M0 code 0xFF) and its value codes are 0.
Infinities are not clamped to the largest finite value: a non-finite
activation is a bug upstream to surface, not to hide. All other inputs are
finite after the round trip (values beyond the range saturate).

Every rounding is round-to-nearest-even (see `atelier.kernels.formats`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from atelier.kernels.formats import E2M1, E4M3, E8M0_NAN, decode, e8m0_decode, encode

NVFP4_BLOCK = 16
MXFP8_BLOCK = 32
NVFP4_TOKEN_DIVISOR = 2688.0      # E2M1 max (6) times E4M3 max (448)
E4M3_MAX = 448.0

Division = Literal["exact", "reciprocal"]
ScaleGranularity = Literal["token", "tensor"]


class QuantShapeError(ValueError):
    """A tensor whose quantised dimension is not a multiple of the block size."""


@dataclass
class NVFP4Tensor:
    """x_RK in the NVFP4 variant: two E2M1 codes a byte (element 2i in the low nibble)."""

    packed_RH: torch.Tensor         # uint8, H = K / 2
    block_scales_RB: torch.Tensor   # uint8 E4M3 codes, B = K / 16
    token_scales_R: torch.Tensor    # float32 (one value when scale="tensor", broadcast over rows)

    def codes(self) -> torch.Tensor:
        """The unpacked E2M1 codes, uint8 [R, K]."""
        low = self.packed_RH & 0xF
        high = self.packed_RH >> 4
        return torch.stack([low, high], dim=-1).flatten(-2)


@dataclass
class MXFP8Tensor:
    """x_RK in MXFP8: one E4M3 code a byte and one E8M0 scale per 32 elements."""

    codes_RK: torch.Tensor          # uint8 E4M3 codes
    scales_RB: torch.Tensor         # uint8 E8M0 codes, B = K / 32


def _blocks(x_RK: torch.Tensor, block: int) -> torch.Tensor:
    if x_RK.dim() != 2:
        raise QuantShapeError(f"expected a 2-D tensor, got shape {tuple(x_RK.shape)}")
    if x_RK.shape[1] % block:
        raise QuantShapeError(f"the quantised dimension ({x_RK.shape[1]}) must be a multiple of {block}")
    return x_RK.float().reshape(x_RK.shape[0], x_RK.shape[1] // block, block)


def _divide(x: torch.Tensor, d: torch.Tensor, division: Division) -> torch.Tensor:
    return x / d if division == "exact" else x * (1.0 / d)


def nvfp4_quantize(x_RK: torch.Tensor, *, scale: ScaleGranularity = "token",
                   division: Division = "exact") -> NVFP4Tensor:
    """Quantise rows of `x_RK` to the NVFP4 variant; see the module docstring."""
    x_RBG = _blocks(x_RK, NVFP4_BLOCK)
    finite_RBG = torch.isfinite(x_RBG)
    ax_RBG = torch.where(finite_RBG, x_RBG.abs(), torch.zeros_like(x_RBG))
    if scale == "token":
        finite_R = finite_RBG.flatten(1).all(dim=1)
        amax_R = ax_RBG.flatten(1).amax(dim=1)
    else:
        finite_R = finite_RBG.all().expand(x_RBG.shape[0])
        amax_R = ax_RBG.amax().expand(x_RBG.shape[0])
    s_R = amax_R / NVFP4_TOKEN_DIVISOR
    s_R = torch.where(s_R == 0, torch.ones_like(s_R), s_R)
    amax_RB = ax_RBG.amax(dim=2)
    sb_codes_RB = encode(_divide(amax_RB, (s_R * 6.0)[:, None], division), E4M3)
    d_RB = decode(sb_codes_RB, E4M3) * s_R[:, None]
    safe_d_RB = torch.where(d_RB == 0, torch.ones_like(d_RB), d_RB)
    q_RBG = _divide(x_RBG, safe_d_RB[:, :, None], division)
    q_RBG = torch.where((d_RB == 0)[:, :, None], torch.zeros_like(q_RBG), q_RBG)
    codes_RK = encode(q_RBG.flatten(1), E2M1)
    codes_RK = torch.where(finite_R[:, None], codes_RK, torch.zeros_like(codes_RK))
    sb_codes_RB = torch.where(finite_R[:, None], sb_codes_RB, torch.full_like(sb_codes_RB, E4M3.nan_code))
    s_R = torch.where(finite_R, s_R, torch.full_like(s_R, float("nan")))
    packed = codes_RK[:, 0::2] | (codes_RK[:, 1::2] << 4)
    return NVFP4Tensor(packed, sb_codes_RB, s_R)


def nvfp4_dequantize(t: NVFP4Tensor) -> torch.Tensor:
    """float32 x'_RK = value(q) * (s_b * s_t)."""
    values_RK = decode(t.codes(), E2M1)
    R = values_RK.shape[0]
    d_RB = decode(t.block_scales_RB, E4M3) * t.token_scales_R[:, None]
    return (values_RK.reshape(R, d_RB.shape[1], NVFP4_BLOCK) * d_RB[:, :, None]).reshape(values_RK.shape)


def e8m0_ceil_code(r: torch.Tensor) -> torch.Tensor:
    """The E8M0 code of 2 ** ceil(log2 r) for float32 r >= 0, clamped to [0, 254] (int32)."""
    bits = r.contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    normal = biased + (frac != 0).to(torch.int32)
    subnormal = (frac > (1 << 22)).to(torch.int32)   # r in (2**-127, 2**-126) rounds up to 2**-126
    return torch.where(biased > 0, normal, subnormal).clamp(max=254)


def mxfp8_quantize(x_RK: torch.Tensor, *, division: Division = "exact") -> MXFP8Tensor:
    """Quantise rows of `x_RK` to MXFP8; see the module docstring."""
    x_RBG = _blocks(x_RK, MXFP8_BLOCK)
    finite_RB = torch.isfinite(x_RBG).all(dim=2)
    ax_RBG = torch.where(torch.isfinite(x_RBG), x_RBG.abs(), torch.zeros_like(x_RBG))
    amax_RB = ax_RBG.amax(dim=2)
    scale_codes_RB = e8m0_ceil_code(_divide(amax_RB, torch.full_like(amax_RB, E4M3_MAX), division))
    X_RB = e8m0_decode(scale_codes_RB)
    codes_RBG = encode(x_RBG / X_RB[:, :, None], E4M3)
    codes_RBG = torch.where(finite_RB[:, :, None], codes_RBG, torch.zeros_like(codes_RBG))
    scale_codes_RB = torch.where(finite_RB, scale_codes_RB, torch.full_like(scale_codes_RB, E8M0_NAN))
    return MXFP8Tensor(codes_RBG.flatten(1), scale_codes_RB.to(torch.uint8))


def mxfp8_dequantize(t: MXFP8Tensor) -> torch.Tensor:
    """float32 x'_RK = value(q) * X."""
    R = t.codes_RK.shape[0]
    values_RBG = decode(t.codes_RK, E4M3).reshape(R, t.scales_RB.shape[1], MXFP8_BLOCK)
    return (values_RBG * e8m0_decode(t.scales_RB)[:, :, None]).reshape(t.codes_RK.shape)


def fake_quant(x: torch.Tensor, fmt: str, dim: int = -1, **options) -> torch.Tensor:
    """dequantize(quantize(x)) along `dim` of a 2-D tensor, float32.

    `fmt`: "nvfp4", "mxfp8", "bf16" (rounded to bfloat16) or "none" (x as float32); `options`:
    `division` (both), `scale` (nvfp4). The layout is kept."""
    if fmt == "none":
        return x if x.dtype == torch.float64 else x.float()   # float64 for gradient checks
    if fmt == "bf16":
        return x.bfloat16().float()                            # what a bf16 tensor core multiplies
    moved = x.transpose(0, 1) if dim in (0, -2) else x
    if fmt == "nvfp4":
        out = nvfp4_dequantize(nvfp4_quantize(moved, **options))
    elif fmt == "mxfp8":
        out = mxfp8_dequantize(mxfp8_quantize(moved, division=options.get("division", "exact")))
    else:
        raise ValueError(f"unknown format {fmt!r} (nvfp4, mxfp8, none)")
    return out.transpose(0, 1) if dim in (0, -2) else out
