"""The reference quantisers against independent oracles, on random and adversarial inputs.

The oracles here use other arithmetic than the reference: torch's own
float8_e4m3fn cast (round-to-nearest-even) and a brute-force nearest-value
search in float64 with ties broken to the even code.
"""

from __future__ import annotations

import pytest
import torch

from atelier.kernels.formats import E2M1, E4M3, decode, e8m0_decode, encode
from atelier.kernels.quant import (
    MXFP8_BLOCK,
    NVFP4_BLOCK,
    QuantShapeError,
    fake_quant,
    mxfp8_dequantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)


def nearest_code(x: torch.Tensor, fmt) -> torch.Tensor:
    """Brute force: the nearest finite code, ties to the even code, saturating."""
    mags = torch.arange(fmt.max_code + 1, dtype=torch.uint8)
    values = decode(mags, fmt).double()
    ax = x.double().abs().clamp(max=float(values[-1]))
    dist = (ax[:, None] - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    # among equally near codes prefer the even one (the lower if both are even cannot happen)
    even = (mags % 2 == 0)[None, :]
    pick = torch.where((candidates & even).any(1, keepdim=True), candidates & even, candidates)
    code = pick.int().argmax(dim=1).to(torch.int32)
    return (code | ((x < 0) | ((x == 0) & (torch.signbit(x)))).int() << fmt.sign_shift).to(torch.uint8)


def magnitudes(n: int, lo: float, hi: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    exps = torch.empty(n).uniform_(lo, hi, generator=g)
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (signs * torch.exp2(exps)).float()


def test_e4m3_encode_matches_torch_cast_in_range():
    x = torch.cat([magnitudes(50_000, -14, 8.8), torch.linspace(-448, 448, 20_001)])
    x = x[x.abs() <= 448]
    ours = decode(encode(x, E4M3), E4M3)
    theirs = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("fmt", [E2M1, E4M3])
def test_encode_matches_brute_force_nearest_with_ties_to_even(fmt):
    top = 3.0 if fmt is E2M1 else 9.5
    x = magnitudes(20_000, -12, top, seed=1)
    # exact midpoints between neighbouring codes: the ties
    values = decode(torch.arange(fmt.max_code + 1, dtype=torch.uint8), fmt)
    mids = (values[:-1] + values[1:]) / 2
    x = torch.cat([x, mids, -mids, values, -values])
    assert torch.equal(encode(x, fmt), nearest_code(x, fmt))


@pytest.mark.parametrize("fmt", [E2M1, E4M3])
def test_every_code_round_trips(fmt):
    codes = torch.arange(1 << (fmt.sign_shift + 1), dtype=torch.uint8)
    values = decode(codes, fmt)
    finite = ~torch.isnan(values)
    assert torch.equal(encode(values[finite], fmt), codes[finite])


def test_encoder_saturates_large_and_infinite_values():
    x = torch.tensor([449.0, 464.0, 1e30, float("inf"), -float("inf"), -1e6])
    assert encode(x, E4M3).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
    assert encode(torch.tensor([6.5, 7.0, 1e9, -100.0]), E2M1).tolist() == [7, 7, 7, 15]


def test_float32_denormals_round_to_zero():
    tiny = torch.tensor([1e-45, 1e-40, -1e-39, 2.0**-127])
    assert encode(tiny, E4M3).tolist() == [0, 0, 0x80, 0]
    assert e8m0_decode(torch.tensor([0, 127, 254], dtype=torch.uint8)).tolist() == [2.0**-127, 1.0, 2.0**127]


def nvfp4_oracle(x_RK: torch.Tensor):
    """The NVFP4 variant from its definition, using torch's FP8 cast and brute-force FP4."""
    R, K = x_RK.shape
    amax_R = x_RK.abs().amax(1)
    s_R = amax_R / 2688.0
    s_R = torch.where(s_R == 0, torch.ones_like(s_R), s_R)
    blocks = x_RK.reshape(R, -1, NVFP4_BLOCK)
    sb = (blocks.abs().amax(2) / (s_R * 6.0)[:, None]).clamp(max=448.0)
    sb = sb.to(torch.float8_e4m3fn).float()
    d = sb * s_R[:, None]
    q = torch.where(d[:, :, None] == 0, torch.zeros_like(blocks), blocks / d[:, :, None])
    return nearest_code(q.flatten(), E2M1).reshape(R, K), sb, s_R


def test_nvfp4_matches_oracle_on_random_rows():
    x = torch.randn(64, 128) * torch.exp2(torch.randint(-20, 20, (64, 1)).float())
    x[3, 5] = 300.0                        # one outlier per row in some rows
    x[7, :16] = 0.0                        # a zero block
    t = nvfp4_quantize(x)
    codes, sb, s_R = nvfp4_oracle(x)
    assert torch.equal(t.codes(), codes)
    assert torch.equal(decode(t.block_scales_RB, E4M3), sb)
    assert torch.equal(t.token_scales_R, s_R)


def test_nvfp4_error_is_bounded_by_half_a_step():
    x = torch.randn(32, 64)
    t = nvfp4_quantize(x)
    d = decode(t.block_scales_RB, E4M3) * t.token_scales_R[:, None]
    err = (nvfp4_dequantize(t) - x).abs().reshape(32, -1, NVFP4_BLOCK)
    # the widest E2M1 step is 2 (between 4 and 6); the block scale may round down and saturate
    # the largest element by at most 6 * (1 - 1 / (1 + 2**-4))
    assert bool((err <= d[:, :, None] * 1.0 + 1e-7).all())


def test_nvfp4_adversarial_rows():
    x = torch.zeros(6, 32)
    x[1] = 1e-40                             # float32 denormals
    x[2, 0] = 1e30                           # one huge value: the rest of its row flushes to 0
    x[2, 1:] = 1.0
    x[3] = torch.linspace(-6, 6, 32)          # exactly representable after scaling
    x[4, 7] = float("nan")
    x[5, 3] = -float("inf")
    t = nvfp4_quantize(x)
    out = nvfp4_dequantize(t)
    assert torch.equal(out[0], torch.zeros(32))
    assert torch.isfinite(out[1]).all() and (out[1].abs() <= 1.1e-40).all()   # denormal scales: coarse, finite
    assert out[2, 0] == pytest.approx(1e30, rel=0.07) and torch.equal(out[2, 1:], torch.zeros(31))
    assert torch.isnan(out[4]).all() and torch.isnan(out[5]).all()
    assert t.block_scales_RB[4].tolist() == [0x7F, 0x7F] and int(t.codes()[5].max()) == 0
    assert torch.isfinite(out[:4]).all()


def test_nvfp4_saturates_when_the_block_scale_rounds_down():
    # amax/(6 s_t) = 448 * 2688 / 2688 rounded; choose a block whose scale rounds down in E4M3
    x = torch.full((1, 32), 0.01)
    x[0, 0] = 6.0                           # token amax: block scale 448 exactly
    x[0, 16] = 6.0 * 0.95                   # second block: scale 425.6 -> 416 (rounded down)
    t = nvfp4_quantize(x)
    assert t.codes()[0, 16].item() == 7    # 6 * 0.95 / (416/448) > 6: saturated to 6
    assert nvfp4_dequantize(t)[0, 16].item() == pytest.approx(6.0 * 416 / 448, rel=1e-6)


def test_nvfp4_token_scale_is_batch_invariant_and_tensor_scale_is_not():
    x = torch.randn(8, 64)
    x[5] *= 100
    alone = nvfp4_dequantize(nvfp4_quantize(x[:1]))
    together = nvfp4_dequantize(nvfp4_quantize(x))[:1]
    assert torch.equal(alone, together)
    alone_t = nvfp4_dequantize(nvfp4_quantize(x[:1], scale="tensor"))
    together_t = nvfp4_dequantize(nvfp4_quantize(x, scale="tensor"))[:1]
    assert not torch.equal(alone_t, together_t)


def test_reciprocal_division_changes_some_codes_of_bf16_values():
    # bf16 activations have 8 significant bits, so x/d often lands near an E2M1 midpoint, where
    # the second rounding of x * (1/d) can fall on the other side (random float32 data: none do)
    torch.manual_seed(0)
    x = torch.randn(512, 256).bfloat16().float()
    exact = nvfp4_quantize(x).codes()
    recip = nvfp4_quantize(x, division="reciprocal").codes()
    differ = int((exact != recip).sum())
    assert 0 < differ < exact.numel() // 100


def mxfp8_oracle(x_RK: torch.Tensor):
    R, K = x_RK.shape
    blocks = x_RK.reshape(R, -1, MXFP8_BLOCK).double()
    amax = blocks.abs().amax(2)
    exp = torch.ceil(torch.log2((amax.float() / 448.0).double())).clamp(-127, 127)
    exp = torch.where(amax == 0, torch.full_like(exp, -127), exp)
    X = torch.exp2(exp)
    q = (blocks / X[:, :, None]).float()
    return nearest_code(q.flatten(), E4M3).reshape(R, K), X.float()


def test_mxfp8_matches_oracle():
    x = torch.randn(32, 128) * torch.exp2(torch.randint(-30, 30, (32, 1)).float())
    x[0, :32] = 0
    x[1, 0] = 448.0 * 2**-5                 # amax / 448 an exact power of two
    x[2, 0] = 1e-38                         # subnormal-range scales
    x[2, 1:32] = 0
    t = mxfp8_quantize(x)
    codes, X = mxfp8_oracle(x)
    assert torch.equal(t.codes_RK, codes)
    assert torch.equal(e8m0_decode(t.scales_RB), X)


def test_mxfp8_nan_inf_policy_poisons_only_the_block():
    x = torch.randn(2, 64)
    x[0, 40] = float("inf")
    x[1, 3] = float("nan")
    t = mxfp8_quantize(x)
    out = mxfp8_dequantize(t)
    assert torch.isnan(out[0, 32:]).all() and torch.isfinite(out[0, :32]).all()
    assert torch.isnan(out[1, :32]).all() and torch.isfinite(out[1, 32:]).all()
    assert t.scales_RB[0, 1].item() == 0xFF


def test_mxfp8_relative_error_of_e4m3():
    x = torch.randn(16, 256)
    err = (mxfp8_dequantize(mxfp8_quantize(x)) - x).abs()
    assert bool((err <= x.abs() * 2**-4 + 2**-9 * x.abs().max()).all())


def test_fake_quant_along_dim0_and_shape_errors():
    x = torch.randn(64, 48)
    assert torch.equal(fake_quant(x, "mxfp8", dim=0), fake_quant(x.t(), "mxfp8").t())
    with pytest.raises(QuantShapeError):
        nvfp4_quantize(torch.randn(2, 24))
    with pytest.raises(ValueError):
        fake_quant(x, "fp3")
