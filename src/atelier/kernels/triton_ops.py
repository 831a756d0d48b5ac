"""Triton kernels: the quantisers of `atelier.kernels.quant` and grouped GEMMs that fuse them.

Legend: M = tokens sorted by expert (rows of a group are contiguous),
R = the reduction dimension, N = output columns, E = experts, K = the
second operand's columns in the weight-gradient GEMM.

Every format is encoded with integer bit operations that mirror
`atelier.kernels.formats` line for line, and every division is
`tl.math.div_rn` (IEEE, rounded once): Triton's plain `/` on float32 lowers to
an approximate division on NVIDIA GPUs, the shortcut the report found to make
training diverge after ~100 steps.

GEMMs quantise their operands as they load them (quantise-dequantise in
registers) and multiply the *block-level* values in float16, which holds
them exactly: an E2M1 value times an E4M3 scale has at most 6 significant
bits and lies in [2**-10, 2688]; an E4M3 value has 4 bits and lies in
[2**-9, 448]. The per-token FP32 scales (NVFP4) are applied in the epilogue
and the power-of-two E8M0 scales (MXFP8) per 32-element reduction block, as
block-scaled tensor cores do. Compared with the reference (dequantise in
float32, then one float32 matmul) only the accumulation order and the
epilogue's roundings differ; tests bound the difference by
`1e-5 * (|A'| @ |B'|)`. (bfloat16 would be exact too, but Triton's
interpreter multiplies bfloat16 tiles wrongly; float16 runs the same here
and on a GPU.)

On a CPU these run under `TRITON_INTERPRET=1` (set before Triton is first
imported) on CPU tensors; that is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atelier.kernels.quant import MXFP8Tensor, NVFP4Tensor, QuantShapeError

F32_EXP = 0x7F800000


@triton.jit
def _encode(x, MBITS: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr, SIGN_SHIFT: tl.constexpr):
    """float32 -> minifloat code (int32), nearest-even, saturating (see formats.encode)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    biased = mag >> 23
    frac = mag & 0x7FFFFF
    normal = biased > 0
    sig = tl.where(normal, frac | 0x800000, frac)
    e = tl.where(normal, biased - 127, -126)
    shift = tl.minimum(23 - MBITS + tl.maximum(EMIN - e, 0), 30)
    one = tl.full(shift.shape, 1, tl.int32)
    q = (sig + ((one << (shift - 1)) - 1) + ((sig >> shift) & 1)) >> shift
    e_target = tl.maximum(e - EMIN + 1, 1)
    code = tl.minimum(((e_target - 1) << MBITS) + q, MAX_CODE)
    return code | (sign << SIGN_SHIFT)


@triton.jit
def _decode(code, MBITS: tl.constexpr, BIAS: tl.constexpr, SIGN_SHIFT: tl.constexpr):
    """minifloat code (int32) -> float32 (the NaN code is the caller's business)."""
    sign = (code >> SIGN_SHIFT) & 1
    mag = code & ((1 << SIGN_SHIFT) - 1)
    e_field = mag >> MBITS
    m = mag & ((1 << MBITS) - 1)
    normal = (((e_field - BIAS + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
    # m * 2**(1 - BIAS - MBITS), built as float32 bits (exact; no float pow in a kernel)
    sub_unit = tl.full(m.shape, (127 + 1 - BIAS - MBITS) << 23, tl.int32).to(tl.float32, bitcast=True)
    subnormal = m.to(tl.float32) * sub_unit
    value = tl.where(e_field > 0, normal, subnormal)
    return tl.where(sign == 1, -value, value)


@triton.jit
def _nan_like(x):
    return tl.full(x.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _is_finite(x):
    return (x.to(tl.int32, bitcast=True) & F32_EXP) != F32_EXP


@triton.jit
def _e8m0_ceil_code(r):
    """E8M0 code of 2**ceil(log2 r), r >= 0 (see quant.e8m0_ceil_code)."""
    bits = r.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    normal = biased + (frac != 0).to(tl.int32)
    subnormal = (frac > (1 << 22)).to(tl.int32)
    return tl.minimum(tl.where(biased > 0, normal, subnormal), 254)


@triton.jit
def _e8m0_value(code):
    bits = tl.where(code > 0, code << 23, 1 << 22)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _token_scale(amax, any_nonfinite):
    s = tl.math.div_rn(amax, tl.full(amax.shape, 2688.0, tl.float32))
    s = tl.where(s == 0, 1.0, s)
    return tl.where(any_nonfinite, _nan_like(s), s)


@triton.jit
def _nvfp4_tile(x, s_t, BM: tl.constexpr, BR: tl.constexpr):
    """Quantise x [BM, BR] along axis 1 given token scales s_t [BM] (finite rows).

    Returns E2M1 codes [BM, BR], E4M3 block-scale codes [BM, BR // 16] and the
    block-level values value * s_b [BM, BR] (exact in float16)."""
    NB: tl.constexpr = BR // 16
    x3 = tl.reshape(x, (BM, NB, 16))
    ax3 = tl.where(_is_finite(x3), tl.abs(x3), 0.0)
    amax_b = tl.max(ax3, axis=2)
    sb_code = _encode(tl.math.div_rn(amax_b, (s_t * 6.0)[:, None]), 3, -6, 0x7E, 7)
    sb = _decode(sb_code, 3, 7, 7)
    d = sb * s_t[:, None]
    safe = tl.where(d == 0, 1.0, d)
    q = tl.math.div_rn(x3, safe[:, :, None])
    q = tl.where((d == 0)[:, :, None], 0.0, q)
    code3 = _encode(q, 1, 0, 7, 3)
    vsb3 = _decode(code3, 1, 1, 3) * sb[:, :, None]
    return tl.reshape(code3, (BM, BR)), sb_code, tl.reshape(vsb3, (BM, BR))


@triton.jit
def _mxfp8_tile(x, BM: tl.constexpr):
    """Quantise x [BM, 32] as one MXFP8 block per row: E4M3 codes, E8M0 code [BM], values, X [BM]."""
    finite = _is_finite(x)
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)
    block_finite = tl.min(finite.to(tl.int32), axis=1) == 1
    scale_code = _e8m0_ceil_code(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    X = _e8m0_value(scale_code)
    code = _encode(tl.math.div_rn(x, X[:, None]), 3, -6, 0x7E, 7)
    code = tl.where(block_finite[:, None], code, 0)
    scale_code = tl.where(block_finite, scale_code, 0xFF)
    X = tl.where(block_finite, X, _nan_like(X))
    return code, scale_code, _decode(code, 3, 7, 7), X


# --- standalone quantisers (their codes are compared with the reference bit for bit) -------
@triton.jit
def _nvfp4_quant_kernel(x_ptr, codes_ptr, sb_ptr, st_ptr, R, K, stride_r,
                        BM: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < R
    amax = tl.zeros((BM,), tl.float32)
    bad = tl.zeros((BM,), tl.int32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :], mask=row_ok[:, None], other=0.0)
        fin = _is_finite(x)
        amax = tl.maximum(amax, tl.max(tl.where(fin, tl.abs(x), 0.0), axis=1))
        bad = tl.maximum(bad, tl.max((fin == 0).to(tl.int32), axis=1))
    s_t = _token_scale(amax, bad > 0)
    tl.store(st_ptr + rows, s_t, mask=row_ok)
    s_use = tl.where(bad > 0, 1.0, s_t)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :], mask=row_ok[:, None], other=0.0)
        code, sb_code, _ = _nvfp4_tile(x, s_use, BM, BK)
        code = tl.where(bad[:, None] > 0, 0, code)
        sb_code = tl.where(bad[:, None] > 0, 0x7F, sb_code)
        tl.store(codes_ptr + rows[:, None] * K + cols[None, :], code.to(tl.uint8), mask=row_ok[:, None])
        bcols = k0 // 16 + tl.arange(0, BK // 16)
        tl.store(sb_ptr + rows[:, None] * (K // 16) + bcols[None, :], sb_code.to(tl.uint8), mask=row_ok[:, None])


@triton.jit
def _mxfp8_quant_kernel(x_ptr, codes_ptr, scales_ptr, R, K, stride_r, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < R
    for k0 in range(0, K, 32):
        cols = k0 + tl.arange(0, 32)
        x = tl.load(x_ptr + rows[:, None] * stride_r + cols[None, :], mask=row_ok[:, None], other=0.0)
        code, scale_code, _, _ = _mxfp8_tile(x, BM)
        tl.store(codes_ptr + rows[:, None] * K + cols[None, :], code.to(tl.uint8), mask=row_ok[:, None])
        tl.store(scales_ptr + rows * (K // 32) + k0 // 32, scale_code.to(tl.uint8), mask=row_ok)


def _check_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % block:
        raise QuantShapeError(f"expected [R, K] with K a multiple of {block}, got {tuple(x.shape)}")
    return x.float().contiguous()


def nvfp4_quantize_triton(x_RK: torch.Tensor, block_m: int = 16) -> NVFP4Tensor:
    x = _check_rows(x_RK, 16)
    R, K = x.shape
    bk = 32 if K % 32 == 0 else 16
    codes = torch.empty((R, K), dtype=torch.uint8, device=x.device)
    sb = torch.empty((R, K // 16), dtype=torch.uint8, device=x.device)
    st = torch.empty((R,), dtype=torch.float32, device=x.device)
    _nvfp4_quant_kernel[(triton.cdiv(R, block_m),)](x, codes, sb, st, R, K, x.stride(0), BM=block_m, BK=bk)
    return NVFP4Tensor(codes[:, 0::2] | (codes[:, 1::2] << 4), sb, st)


def mxfp8_quantize_triton(x_RK: torch.Tensor, block_m: int = 16) -> MXFP8Tensor:
    x = _check_rows(x_RK, 32)
    R, K = x.shape
    codes = torch.empty((R, K), dtype=torch.uint8, device=x.device)
    scales = torch.empty((R, K // 32), dtype=torch.uint8, device=x.device)
    _mxfp8_quant_kernel[(triton.cdiv(R, block_m),)](x, codes, scales, R, K, x.stride(0), BM=block_m)
    return MXFP8Tensor(codes, scales)


# --- grouped GEMMs ----------------------------------------------------------------------------
@triton.jit
def _grouped_mm_kernel(a_ptr, b_ptr, c_ptr, off_ptr, N, R,
                       s_am, s_ar, s_be, s_br, s_bn, s_cm, s_cn,
                       FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    """C[rows of g] = Q(A[rows of g]) @ Q(B[g]); A and B quantised along R. FMT 0: NVFP4, 1: MXFP8."""
    g = tl.program_id(0)
    start = tl.load(off_ptr + g)
    end = tl.load(off_ptr + g + 1)
    rows = start + tl.program_id(1) * BM + tl.arange(0, BM)
    if start + tl.program_id(1) * BM < end:
        cols = tl.program_id(2) * BN + tl.arange(0, BN)
        row_ok = rows < end
        col_ok = cols < N
        a_base = a_ptr + rows[:, None] * s_am
        b_base = b_ptr + g.to(tl.int64) * s_be + cols[None, :] * s_bn
        acc = tl.zeros((BM, BN), tl.float32)
        if FMT == 0:
            amax_a = tl.zeros((BM,), tl.float32)
            bad_a = tl.zeros((BM,), tl.int32)
            amax_b = tl.zeros((BN,), tl.float32)
            bad_b = tl.zeros((BN,), tl.int32)
            for r0 in range(0, R, BR):
                ks = r0 + tl.arange(0, BR)
                a = tl.load(a_base + ks[None, :] * s_ar, mask=row_ok[:, None], other=0.0).to(tl.float32)
                bt = tl.trans(tl.load(b_base + ks[:, None] * s_br, mask=col_ok[None, :], other=0.0).to(tl.float32))
                fa = _is_finite(a)
                fb = _is_finite(bt)
                amax_a = tl.maximum(amax_a, tl.max(tl.where(fa, tl.abs(a), 0.0), axis=1))
                amax_b = tl.maximum(amax_b, tl.max(tl.where(fb, tl.abs(bt), 0.0), axis=1))
                bad_a = tl.maximum(bad_a, tl.max((fa == 0).to(tl.int32), axis=1))
                bad_b = tl.maximum(bad_b, tl.max((fb == 0).to(tl.int32), axis=1))
            st_a = _token_scale(amax_a, bad_a > 0)
            st_b = _token_scale(amax_b, bad_b > 0)
            use_a = tl.where(bad_a > 0, 1.0, st_a)
            use_b = tl.where(bad_b > 0, 1.0, st_b)
            for r0 in range(0, R, BR):
                ks = r0 + tl.arange(0, BR)
                a = tl.load(a_base + ks[None, :] * s_ar, mask=row_ok[:, None], other=0.0).to(tl.float32)
                bt = tl.trans(tl.load(b_base + ks[:, None] * s_br, mask=col_ok[None, :], other=0.0).to(tl.float32))
                _, _, va = _nvfp4_tile(a, use_a, BM, BR)
                _, _, vb = _nvfp4_tile(bt, use_b, BN, BR)
                acc += tl.dot(va.to(tl.float16), tl.trans(vb.to(tl.float16)), out_dtype=tl.float32)
            acc = acc * st_a[:, None] * st_b[None, :]
        else:
            for r0 in range(0, R, 32):
                ks = r0 + tl.arange(0, 32)
                a = tl.load(a_base + ks[None, :] * s_ar, mask=row_ok[:, None], other=0.0).to(tl.float32)
                bt = tl.trans(tl.load(b_base + ks[:, None] * s_br, mask=col_ok[None, :], other=0.0).to(tl.float32))
                _, _, va, xa = _mxfp8_tile(a, BM)
                _, _, vb, xb = _mxfp8_tile(bt, BN)
                part = tl.dot(va.to(tl.float16), tl.trans(vb.to(tl.float16)), out_dtype=tl.float32)
                acc += part * xa[:, None] * xb[None, :]
        tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :] * s_cn, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(a_ptr, b_ptr, c_ptr, off_ptr, N, K,
                          s_am, s_an, s_bm, s_bk, s_ce, s_cn, s_ck,
                          BN: tl.constexpr, BK: tl.constexpr):
    """C[g] = Q(A[rows of g])^T @ Q(B[rows of g]), MXFP8 blocks of 32 rows from the group's start."""
    g = tl.program_id(0)
    start = tl.load(off_ptr + g)
    end = tl.load(off_ptr + g + 1)
    ns = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.program_id(2) * BK + tl.arange(0, BK)
    n_ok = ns < N
    k_ok = ks < K
    acc = tl.zeros((BN, BK), tl.float32)
    for m0 in range(start, end, 32):
        ms = m0 + tl.arange(0, 32)
        m_ok = ms < end
        at = tl.trans(tl.load(a_ptr + ms[:, None] * s_am + ns[None, :] * s_an,
                              mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32))
        bt = tl.trans(tl.load(b_ptr + ms[:, None] * s_bm + ks[None, :] * s_bk,
                              mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32))
        _, _, va, xa = _mxfp8_tile(at, BN)
        _, _, vb, xb = _mxfp8_tile(bt, BK)
        part = tl.dot(va.to(tl.float16), tl.trans(vb.to(tl.float16)), out_dtype=tl.float32)
        acc += part * xa[:, None] * xb[None, :]
    tl.store(c_ptr + g.to(tl.int64) * s_ce + ns[:, None] * s_cn + ks[None, :] * s_ck, acc,
             mask=n_ok[:, None] & k_ok[None, :])


FORMATS = {"nvfp4": 0, "mxfp8": 1}


def grouped_mm_triton(a_MR: torch.Tensor, b_ERN: torch.Tensor, offsets: torch.Tensor, fmt: str,
                      block_m: int = 32, block_n: int = 32) -> torch.Tensor:
    """C_MN: per group g, Q(A[offsets[g]:offsets[g+1]]) @ Q(B[g]), float32."""
    M, R = a_MR.shape
    E, R2, N = b_ERN.shape
    block = 16 if fmt == "nvfp4" else 32
    if R != R2 or R % block:
        raise QuantShapeError(f"reduction dims {R} and {R2} must agree and be multiples of {block}")
    c = torch.zeros((M, N), dtype=torch.float32, device=a_MR.device)
    counts = offsets[1:] - offsets[:-1]
    longest = int(counts.max()) if E else 0
    if longest == 0:
        return c
    off = offsets.to(torch.int32).contiguous()
    br = 32 if R % 32 == 0 else 16
    grid = (E, triton.cdiv(longest, block_m), triton.cdiv(N, block_n))
    _grouped_mm_kernel[grid](a_MR, b_ERN, c, off, N, R,
                             a_MR.stride(0), a_MR.stride(1), b_ERN.stride(0), b_ERN.stride(1), b_ERN.stride(2),
                             c.stride(0), c.stride(1),
                             FMT=FORMATS[fmt], BM=block_m, BN=block_n, BR=br)
    return c


def grouped_wgrad_triton(a_MN: torch.Tensor, b_MK: torch.Tensor, offsets: torch.Tensor,
                         block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """C_ENK: per group g, Q(A_g)^T @ Q(B_g) with MXFP8 blocks along the group's rows."""
    M, N = a_MN.shape
    _, K = b_MK.shape
    E = offsets.numel() - 1
    c = torch.zeros((E, N, K), dtype=torch.float32, device=a_MN.device)
    off = offsets.to(torch.int32).contiguous()
    grid = (E, triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    _grouped_wgrad_kernel[grid](a_MN, b_MK, c, off, N, K, a_MN.stride(0), a_MN.stride(1),
                                b_MK.stride(0), b_MK.stride(1), c.stride(0), c.stride(1), c.stride(2),
                                BN=block_n, BK=block_k)
    return c
