"""The minifloat element and scale formats, encoded with integer bit operations.

Legend: codes are uint8 tensors holding one element each (an FP4 code uses
the low 4 bits); `x` is float32.

| format | layout (sign, exponent, mantissa) | bias | largest finite | smallest subnormal | NaN | Inf |
|---|---|---|---|---|---|---|
| E2M1 (FP4) | 1, 2, 1 | 1 | 6.0 (0x7) | 0.5 (0x1) | none | none |
| E4M3 (FP8, OCP "E4M3FN") | 1, 4, 3 | 7 | 448.0 (0x7E) | 2^-9 (0x01) | 0x7F, 0xFF | none |
| E8M0 (scale, OCP MX) | 0, 8, 0 | 127 | 2^127 (0xFE) | 2^-127 (0x00) | 0xFF | none |

Encoding rounds to nearest, ties to even, and saturates: a finite value
beyond the largest code becomes the largest code (with its sign). The
encoder works on the float32 bit pattern with integer shifts only, so that
the PyTorch reference and the Triton kernels (`atelier.kernels.triton_ops`)
compute the same codes by construction, and Triton's interpreter cannot
differ: storing through a `tl.float8e4nv` cast in the interpreter returned
unrounded values, integer operations have no such trap. Callers decide what
non-finite inputs become (see `atelier.kernels.quant`); the encoder itself
saturates them.

How the encoder rounds (one formula for every format): split the float32
into sign, unbiased exponent e and 24-bit significand `sig`; if e is below
the format's smallest normal exponent `emin`, the significand is shifted
right by the difference as well (the subnormal range). The kept bits are
`sig >> shift`, rounded to nearest-even with the usual
`sig + (half - 1) + lsb` trick; a carry out of the mantissa moves into the
exponent field by itself, because the code is `((E_t - 1) << mbits) + q`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Minifloat:
    """A sign-exponent-mantissa format of at most 8 bits."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_code: int              # the largest finite magnitude code
    nan_code: int | None       # magnitude code that means NaN, if any

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def sign_shift(self) -> int:
        return self.ebits + self.mbits

    @property
    def max_value(self) -> float:
        return float(decode(torch.tensor([self.max_code], dtype=torch.uint8), self)[0])


E2M1 = Minifloat("e2m1", ebits=2, mbits=1, bias=1, max_code=0x7, nan_code=None)
E4M3 = Minifloat("e4m3", ebits=4, mbits=3, bias=7, max_code=0x7E, nan_code=0x7F)
E8M0_NAN = 0xFF
F32_EXP_MASK = 0x7F800000


def encode(x: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """Round float32 `x` to `fmt` (nearest-even, saturating); uint8 codes."""
    if x.dtype != torch.float32:
        raise TypeError(f"encode expects float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    biased = mag >> 23
    frac = mag & 0x7FFFFF
    normal = biased > 0
    sig = torch.where(normal, frac | 0x800000, frac)
    e = torch.where(normal, biased - 127, torch.full_like(biased, -126))
    shift = (23 - fmt.mbits + (fmt.emin - e).clamp(min=0)).clamp(max=30)
    half_minus_one = (torch.ones_like(shift) << (shift - 1)) - 1
    q = (sig + half_minus_one + ((sig >> shift) & 1)) >> shift
    e_target = (e - fmt.emin + 1).clamp(min=1)
    code = (((e_target - 1) << fmt.mbits) + q).clamp(max=fmt.max_code)
    return (code | (sign << fmt.sign_shift)).to(torch.uint8)


def decode(codes: torch.Tensor, fmt: Minifloat) -> torch.Tensor:
    """float32 values of `fmt` codes (NaN for the NaN code)."""
    c = codes.to(torch.int32)
    sign = (c >> fmt.sign_shift) & 1
    mag = c & ((1 << fmt.sign_shift) - 1)
    e_field = mag >> fmt.mbits
    m = mag & ((1 << fmt.mbits) - 1)
    normal_bits = ((e_field - fmt.bias + 127) << 23) | (m << (23 - fmt.mbits))
    normal = normal_bits.view(torch.float32)
    subnormal = m.to(torch.float32) * 2.0 ** (fmt.emin - fmt.mbits)
    value = torch.where(e_field > 0, normal, subnormal)
    value = torch.where(sign == 1, -value, value)
    if fmt.nan_code is not None:
        value = torch.where(mag == fmt.nan_code, torch.full_like(value, float("nan")), value)
    return value


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """2**(code - 127) as float32 (code 0 is the float32 subnormal 2**-127); 0xFF is NaN."""
    c = codes.to(torch.int32)
    bits = torch.where(c > 0, c << 23, torch.full_like(c, 1 << 22))
    value = bits.view(torch.float32)
    return torch.where(c == E8M0_NAN, torch.full_like(value, float("nan")), value)


def biased_exponent(x: torch.Tensor) -> torch.Tensor:
    """The 8-bit biased exponent field of float32 `x` (0 for zero and subnormals), int32."""
    return (x.contiguous().view(torch.int32) >> 23) & 0xFF
