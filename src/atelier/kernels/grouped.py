"""Grouped GEMMs over experts in low precision, and the autograd function that uses them.

Legend: M = (token, expert) pairs sorted by expert, so the rows of one expert
are contiguous and `offsets` [E + 1] marks where each starts; K = input
features, N = output features, E = experts; `w_ENK` is a stack of expert
weights in the Hugging Face layout (y = x @ w[e]^T).

`grouped_linear(x_MK, w_ENK, offsets, recipe)` computes y_MN and, on
backward, the two gradient GEMMs:

    forward   y[g]  = Q_f(x[g]) @ Q_f(w[g])^T     quantised along K
    dgrad     dx[g] = Q_b(dy[g]) @ Q_b(w[g])      quantised along N
    wgrad     dw[g] = Q_b(dy[g])^T @ Q_b(x[g])    quantised along the group's rows

Every operand is quantised along the dimension the GEMM reduces over, as
block-scaled tensor cores require; the high-precision x and w are saved for
backward and quantised again there (the straight-through estimator: the
gradient of the quantiser is taken as the identity). Q_f and Q_b come from
the recipe: "nvfp4_fwd_mxfp8_bwd" (the report's), "mxfp8" (both), the
per-tensor-scale variant of the first (kept to show its batch variance),
the first with reciprocal-multiply division (kept to count what exact
division changes), "bf16_operands" (operands rounded to bfloat16, float32
accumulation: the baseline of the precision experiment) and "none" (no
quantisation, float32: what the gradient checks run through).

`backend="reference"` runs `atelier.kernels.quant` in PyTorch (any device);
"triton" runs `atelier.kernels.triton_ops`; "auto" takes Triton for CUDA
tensors when it is installed and the reference otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from atelier.kernels.quant import Division, ScaleGranularity, fake_quant

Backend = Literal["auto", "reference", "triton"]


@dataclass(frozen=True)
class Recipe:
    """Formats of the forward GEMM and of both backward GEMMs."""

    name: str
    forward: Literal["nvfp4", "mxfp8", "bf16", "none"]
    backward: Literal["mxfp8", "bf16", "none"]
    scale: ScaleGranularity = "token"
    division: Division = "exact"
    options: dict = field(default_factory=dict, compare=False, repr=False)

    def fwd_options(self) -> dict:
        return {"scale": self.scale, "division": self.division} if self.forward == "nvfp4" else \
            ({"division": self.division} if self.forward == "mxfp8" else {})

    def bwd_options(self) -> dict:
        return {"division": self.division} if self.backward == "mxfp8" else {}


RECIPES: dict[str, Recipe] = {
    "none": Recipe("none", "none", "none"),
    "bf16_operands": Recipe("bf16_operands", "bf16", "bf16"),
    "mxfp8": Recipe("mxfp8", "mxfp8", "mxfp8"),
    "nvfp4_fwd_mxfp8_bwd": Recipe("nvfp4_fwd_mxfp8_bwd", "nvfp4", "mxfp8"),
    "nvfp4_tensor_fwd_mxfp8_bwd": Recipe("nvfp4_tensor_fwd_mxfp8_bwd", "nvfp4", "mxfp8", scale="tensor"),
    "nvfp4_fwd_mxfp8_bwd_reciprocal": Recipe("nvfp4_fwd_mxfp8_bwd_reciprocal", "nvfp4", "mxfp8",
                                             division="reciprocal"),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise KeyError(f"unknown low-precision recipe {name!r}; known: {', '.join(RECIPES)}")
    return RECIPES[name]


def _use_triton(t: torch.Tensor, backend: Backend) -> bool:
    if backend == "triton":
        return True
    if backend == "reference" or not t.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def grouped_mm_reference(a_MR: torch.Tensor, b_ERN: torch.Tensor, offsets: torch.Tensor, fmt: str,
                         **options) -> torch.Tensor:
    """C_MN, per group g: Q(A[g]) @ Q(B[g]), both quantised along R; float32.

    Each operand is quantised in one call (per-token and per-block scales do
    not cross rows, so this equals quantising group by group); with
    `scale="tensor"` (NVFP4) one scale covers all of A, and one all of B."""
    E, R, N = b_ERN.shape
    a_q = fake_quant(a_MR, fmt, **options)
    b_q = fake_quant(b_ERN.transpose(1, 2).reshape(E * N, R), fmt, **options).reshape(E, N, R).transpose(1, 2)
    c = a_MR.new_zeros((a_MR.shape[0], N), dtype=a_q.dtype)
    for g in range(E):
        s, e = int(offsets[g]), int(offsets[g + 1])
        if e > s:
            c[s:e] = a_q[s:e] @ b_q[g]
    return c


def _padded_rows(offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, list[int]]:
    """Where each row goes when every group is padded to a multiple of `block` rows, and the
    padded groups' starts (E + 1 entries)."""
    counts = (offsets[1:] - offsets[:-1]).tolist()
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + -(-n // block) * block)
    dest = torch.cat([torch.arange(n) + starts[g] for g, n in enumerate(counts)]) if counts else torch.empty(0)
    return dest.long(), starts


def grouped_wgrad_reference(a_MN: torch.Tensor, b_MK: torch.Tensor, offsets: torch.Tensor, fmt: str,
                            **options) -> torch.Tensor:
    """C_ENK, per group g: Q(A[g])^T @ Q(B[g]), quantised along the rows of the group in blocks
    that start at the group's first row (the last block zero-padded); float32."""
    E = offsets.numel() - 1
    work = torch.float64 if fmt == "none" and a_MN.dtype == torch.float64 else torch.float32
    block = 32 if fmt == "mxfp8" else 16   # padding rows are zeros: harmless for every format
    dest, starts = _padded_rows(offsets.cpu(), block)
    dest = dest.to(a_MN.device)
    a_pad = a_MN.new_zeros((starts[-1], a_MN.shape[1]), dtype=work).index_copy_(0, dest, a_MN.to(work))
    b_pad = b_MK.new_zeros((starts[-1], b_MK.shape[1]), dtype=work).index_copy_(0, dest, b_MK.to(work))
    a_q = fake_quant(a_pad, fmt, dim=0, **options)
    b_q = fake_quant(b_pad, fmt, dim=0, **options)
    c = a_MN.new_zeros((E, a_MN.shape[1], b_MK.shape[1]), dtype=a_q.dtype)
    for g in range(E):
        if starts[g + 1] > starts[g]:
            c[g] = a_q[starts[g]:starts[g + 1]].t() @ b_q[starts[g]:starts[g + 1]]
    return c


def grouped_mm(a_MR, b_ERN, offsets, fmt: str, backend: Backend = "auto", **options) -> torch.Tensor:
    if fmt in ("none", "bf16"):
        return grouped_mm_reference(a_MR, b_ERN, offsets, fmt)
    if _use_triton(a_MR, backend) and options.get("scale", "token") == "token" \
            and options.get("division", "exact") == "exact":
        from atelier.kernels.triton_ops import grouped_mm_triton

        return grouped_mm_triton(a_MR, b_ERN, offsets, fmt)
    return grouped_mm_reference(a_MR, b_ERN, offsets, fmt, **options)


def grouped_wgrad(a_MN, b_MK, offsets, fmt: str, backend: Backend = "auto", **options) -> torch.Tensor:
    if fmt == "mxfp8" and _use_triton(a_MN, backend) and options.get("division", "exact") == "exact":
        from atelier.kernels.triton_ops import grouped_wgrad_triton

        return grouped_wgrad_triton(a_MN, b_MK, offsets)
    return grouped_wgrad_reference(a_MN, b_MK, offsets, fmt, **options)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_ENK, offsets, recipe: Recipe, backend: Backend):
        ctx.save_for_backward(x_MK, w_ENK, offsets)
        ctx.recipe, ctx.backend = recipe, backend
        y = grouped_mm(x_MK, w_ENK.transpose(1, 2), offsets, recipe.forward, backend, **recipe.fwd_options())
        return y.to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_ENK, offsets = ctx.saved_tensors
        recipe, backend = ctx.recipe, ctx.backend
        opts = recipe.bwd_options()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm(dy_MN, w_ENK, offsets, recipe.backward, backend, **opts).to(x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = grouped_wgrad(dy_MN, x_MK, offsets, recipe.backward, backend, **opts).to(w_ENK.dtype)
        return dx, dw, None, None, None


def grouped_linear(x_MK: torch.Tensor, w_ENK: torch.Tensor, offsets: torch.Tensor,
                   recipe: Recipe | str = "nvfp4_fwd_mxfp8_bwd", backend: Backend = "auto") -> torch.Tensor:
    """y_MN = x[g] @ w[g]^T per expert group, in the recipe's precision; differentiable in x and w."""
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    return _GroupedLinear.apply(x_MK, w_ENK, offsets, r, backend)
