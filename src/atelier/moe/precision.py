"""Low-precision expert matmuls for a Hugging Face MoE model, applied from outside.

`apply_moe_precision(model, "nvfp4_fwd_mxfp8_bwd")` replaces the forward of
every fused experts module with one that sorts (token, expert) pairs by
expert and runs both expert GEMMs through `atelier.kernels.grouped_linear`:
the NVFP4-variant forward and MXFP8 backward of the report ("mxfp8" for
both). "bf16" leaves the model alone (its matmuls run in the dtype the model
was loaded in). Legend: S = tokens, k = experts per token, M = S * k pairs,
H = hidden, I = expert intermediate size, E = experts.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from atelier.errors import AtelierError
from atelier.kernels.grouped import Backend, get_recipe, grouped_linear

MoePrecision = Literal["bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd"]


class UnsupportedMoeModel(AtelierError):
    """A model whose experts modules do not have the fused layout the kernels need."""


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Fused experts modules: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] parameters."""
    found = []
    for m in model.modules():
        gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gu, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gu.dim() == 3:
            found.append(m)
    return found


def _check(m: torch.nn.Module) -> None:
    layout = (getattr(m, "has_gate", True), getattr(m, "has_bias", False),
              getattr(m, "is_transposed", False), getattr(m, "is_concatenated", True))
    if layout != (True, False, False, True):
        raise UnsupportedMoeModel(f"{type(m).__name__}: expert layout (gate, bias, transposed, concatenated) = "
                                  f"{layout}; the low-precision path supports (True, False, False, True)",
                                  hint='use trainer.moe_precision = "bf16" for this model')
    E, two_i, H = m.gate_up_proj.shape
    if H % 32 or (two_i // 2) % 32:
        raise UnsupportedMoeModel(f"{type(m).__name__}: hidden size {H} and expert size {two_i // 2} must be "
                                  "multiples of 32 (the MXFP8 block)", hint='use trainer.moe_precision = "bf16"')


def lowp_experts_forward(self, hidden_SH: torch.Tensor, top_k_index_Sk: torch.Tensor,
                         top_k_weights_Sk: torch.Tensor, *, recipe: str, backend: Backend) -> torch.Tensor:
    """The experts module's forward with both GEMMs in `recipe` (same contract as HF's)."""
    E = self.gate_up_proj.shape[0]
    k = top_k_index_Sk.shape[-1]
    expert_M = top_k_index_Sk.reshape(-1)
    order_M = torch.sort(expert_M, stable=True).indices
    token_M = order_M // k
    counts_E = torch.bincount(expert_M, minlength=E)
    offsets = torch.cat([counts_E.new_zeros(1), counts_E.cumsum(0)])
    x_MH = hidden_SH[token_M]
    h_M2I = grouped_linear(x_MH, self.gate_up_proj, offsets, recipe, backend)
    h_MI = self._apply_gate(h_M2I)
    y_MH = grouped_linear(h_MI, self.down_proj, offsets, recipe, backend)
    y_MH = y_MH * top_k_weights_Sk.reshape(-1)[order_M, None].to(y_MH.dtype)
    return torch.zeros_like(hidden_SH).index_add_(0, token_M, y_MH.to(hidden_SH.dtype))


def apply_moe_precision(model: torch.nn.Module, precision: str, backend: Backend = "auto") -> int:
    """Swap every experts module's forward for the `precision` recipe; returns how many.

    "bf16" changes nothing and returns 0. Raises `UnsupportedMoeModel` for
    layouts the kernels do not cover, before changing anything."""
    if precision == "bf16":
        return 0
    get_recipe(precision)
    modules = experts_modules(model)
    if not modules:
        raise UnsupportedMoeModel(f"{type(model).__name__} has no fused experts modules",
                                  hint=f'moe_precision = "{precision}" needs a mixture-of-experts model '
                                       '(e.g. model = "tiny-moe"); use "bf16" for dense models')
    for m in modules:
        _check(m)
    for m in modules:
        m.forward = functools.partial(lowp_experts_forward, m, recipe=precision, backend=backend)
    return len(modules)
