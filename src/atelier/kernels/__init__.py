"""Low-precision formats for mixture-of-experts matmuls, and the kernels that use them.

- `formats`: E2M1, E4M3 and E8M0 encoded with integer bit operations.
- `quant`: the plain-PyTorch reference quantisers (NVFP4 variant with a
  per-token FP32 scale; MXFP8), the oracle for everything else. The formats,
  rounding and NaN/Inf policy are specified in its docstring.
- `grouped`: grouped GEMMs over experts with the quantisation applied to
  their operands, and `grouped_linear`, the autograd function that runs the
  forward in one recipe and both backward GEMMs in MXFP8.
- `triton_ops`: the same quantisers and grouped GEMMs as Triton kernels,
  checked against `quant`/`grouped` (under `TRITON_INTERPRET=1` on a CPU).

This package imports no trainer and no model: `atelier.moe` applies it to a
Hugging Face model from outside.
"""
