"""Router replay: the trainer routes every token to the experts the sampler chose.

Why: routing recomputed in the trainer differs from the sampler's on many
tokens (numerics, bf16 against fp32, weights a step apart), and a token sent
to other experts has another probability, so importance ratios explode
(docs/pitfalls.md). With replay the trainer takes the sampler's top-k expert ids and
recomputes only the gate values, softmax(router logits) at those ids (then
renormalised, as the router does), under the current weights: the router
still gets gradients through the gates it would have produced for the
chosen experts.

How, from outside the model: a forward hook on every `*TopKRouter` module
(Qwen3-MoE, OLMoE, Mixtral in transformers 5: they return
(logits, scores, indices) for the flattened tokens of the call). Recording
appends each call's indices; replaying swaps in given indices and the
gates recomputed for them. Legend: N = tokens of one forward call
(batch x time, flattened as the router sees them), L = MoE layers in module
order, k = experts per token.

Storage is compact: `pack_routes` keeps ids as uint8 (up to 255 experts) or
uint16, with the type's largest value (`NO_ROUTE`) for tokens that have no
record (padding, the last sampled token, which is never fed back); such
tokens route freely in a replayed forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

from atelier.errors import AtelierError


class RouterReplayError(AtelierError):
    """Routes that do not fit the model or the batch being replayed."""


def _is_router(m: torch.nn.Module) -> bool:
    return type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "weight")


def routes_dtype(num_experts: int) -> np.dtype:
    if num_experts < 255:
        return np.dtype(np.uint8)
    if num_experts < 65535:
        return np.dtype(np.uint16)
    raise RouterReplayError(f"{num_experts} experts do not fit uint16 route ids")


def pack_routes(ids_NLk: torch.Tensor, num_experts: int) -> np.ndarray:
    """int ids (negative: no record) -> compact uint8/uint16 array [N, L, k]."""
    dt = routes_dtype(num_experts)
    no_route = np.iinfo(dt).max
    arr = ids_NLk.detach().cpu().numpy()
    return np.where(arr < 0, no_route, arr).astype(dt)


def unpack_routes(packed_NLk: np.ndarray) -> torch.Tensor:
    """compact array -> int64 ids with -1 where there is no record."""
    no_route = np.iinfo(packed_NLk.dtype).max
    ids = torch.from_numpy(packed_NLk.astype(np.int64))
    return torch.where(ids == int(no_route), torch.full_like(ids, -1), ids)


class RouterReplay:
    """Hooks on a model's routers that record or replay top-k expert ids (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if _is_router(m)]
        if not self.routers:
            raise RouterReplayError(f"{type(model).__name__} has no top-k router modules",
                                    hint="router replay needs a mixture-of-experts model (e.g. tiny-moe)")
        self.num_experts = int(self.routers[0].weight.shape[0])
        self.top_k = int(self.routers[0].top_k)
        self._records: list[list[torch.Tensor]] | None = None
        self._forced_NLk: torch.Tensor | None = None
        self.last_used: list[torch.Tensor] = [torch.empty(0)] * len(self.routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits_NE, scores_Nk, idx_Nk = output
            if self._forced_NLk is not None:
                forced_Nk = self._forced_NLk[:, layer, :].to(idx_Nk.device)
                if forced_Nk.shape != idx_Nk.shape:
                    raise RouterReplayError(f"replayed routes cover {forced_Nk.shape[0]} tokens, the forward has "
                                            f"{idx_Nk.shape[0]}", hint="pass one route row per token of the batch")
                has = (forced_Nk >= 0).all(dim=-1, keepdim=True)
                idx_Nk = torch.where(has, forced_Nk, idx_Nk)
                probs_NE = torch.softmax(logits_NE.float(), dim=-1)
                gates_Nk = probs_NE.gather(-1, idx_Nk)
                if getattr(module, "norm_topk_prob", True):
                    gates_Nk = gates_Nk / gates_Nk.sum(dim=-1, keepdim=True)
                scores_Nk = gates_Nk.to(scores_Nk.dtype)
            self.last_used[layer] = idx_Nk.detach()
            if self._records is not None:
                self._records[layer].append(idx_Nk.detach().cpu())
            return logits_NE, scores_Nk, idx_Nk
        return hook

    @contextmanager
    def record(self) -> Iterator["RouterReplay"]:
        """Record the ids of every forward call inside; `recorded()` concatenates them."""
        self._records = [[] for _ in self.routers]
        try:
            yield self
        finally:
            self._finished = self._records
            self._records = None

    def recorded(self) -> torch.Tensor:
        """int64 [N, L, k]: every token the recorded calls routed, in call order."""
        records = getattr(self, "_finished", None) or self._records
        if not records or not records[0]:
            return torch.empty((0, self.num_layers, self.top_k), dtype=torch.long)
        return torch.stack([torch.cat(per_layer) for per_layer in records], dim=1)

    @contextmanager
    def replay(self, routes_NLk: torch.Tensor | np.ndarray) -> Iterator["RouterReplay"]:
        """Forward calls inside route token n of the (flattened) batch to routes[n]; rows with
        a negative id (or NO_ROUTE when packed) route freely."""
        ids = unpack_routes(routes_NLk) if isinstance(routes_NLk, np.ndarray) else routes_NLk.long()
        if ids.dim() != 3 or ids.shape[1:] != (self.num_layers, self.top_k):
            raise RouterReplayError(f"routes of shape {tuple(ids.shape)}; this model needs "
                                    f"[tokens, {self.num_layers}, {self.top_k}]")
        if bool((ids >= self.num_experts).any()):
            raise RouterReplayError(f"route ids beyond the model's {self.num_experts} experts")
        self._forced_NLk = ids
        try:
            yield self
        finally:
            self._forced_NLk = None

    def used(self) -> torch.Tensor:
        """int64 [N, L, k]: the ids the last forward call actually used, per layer."""
        return torch.stack(self.last_used, dim=1)
