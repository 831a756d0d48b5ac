"""What a trainer calls to make a Hugging Face MoE model train the way the config says.

`attach(model, precision, router_replay)` applies the expert-matmul recipe
and, on any model with top-k routers, installs a `RouterReplay` (it only
observes unless a batch is replayed: the trainer logs tokens per expert from
it). `batch_routes(samples_routes, T)` lays the samples' packed routes out
as the flattened [B * T, L, k] rows a padded batch's routers see, with -1
(route freely) for padding.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from atelier.errors import AtelierError
from atelier.moe.precision import apply_moe_precision
from atelier.moe.replay import RouterReplay, unpack_routes


class MissingRoutes(AtelierError):
    """Router replay is on, but the samples carry no routes."""


def has_routers(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.endswith("TopKRouter") for m in model.modules())


def attach(model: torch.nn.Module, precision: str, router_replay: bool) -> RouterReplay | None:
    apply_moe_precision(model, precision)
    if router_replay and not has_routers(model):
        raise MissingRoutes(f"trainer.router_replay is on, but {type(model).__name__} has no MoE routers",
                            hint="use a mixture-of-experts model (model = \"tiny-moe\"), or router_replay = false")
    return RouterReplay(model) if has_routers(model) else None


def batch_routes(routes: Sequence[np.ndarray | None], T: int, layers: int, k: int) -> torch.Tensor:
    """[B * T, L, k] int64 ids for a right-padded batch; raises `MissingRoutes` if a sample has none."""
    if any(r is None for r in routes):
        raise MissingRoutes("trainer.router_replay is on, but some samples carry no routes",
                            hint="the sampler must return the experts it chose per token (Sample.routes); "
                                 "the built-in engine does not record them yet: set router_replay = false")
    out = torch.full((len(routes), T, layers, k), -1, dtype=torch.long)
    for b, r in enumerate(routes):
        ids = unpack_routes(r)
        out[b, : ids.shape[0]] = ids
    return out.reshape(len(routes) * T, layers, k)
