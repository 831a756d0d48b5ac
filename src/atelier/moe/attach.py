"""What a trainer calls to make a Hugging Face MoE model train the way the config says.

`attach(model, precision, router_replay)` applies the expert-matmul recipe
and returns the trainer's one hook into the routers, a `RouterHook`. On a
model with top-k routers it installs a `RouterReplay`, which only observes
unless a micro-batch is replayed; on a dense model the hook does nothing and
reports nothing. The trainer calls it around each micro-batch:

    with hook.micro_batch([sample.routes ...], T):   # replay the sampler's experts (router_replay)
        forward
    backward
    rows, matches = hook.observe(attn_BT)          # tokens per expert; agreement with the sampler
    ...
    metrics = hook.step_metrics(rows, matches)     # load balance since the last step, agreement

`batch_routes(samples_routes, T)` lays the samples' packed routes out as the
flattened [B * T, L, k] rows a padded batch's routers see, with -1 (route
freely) for padding.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from atelier.errors import AtelierError
from atelier.moe.metrics import expert_counts, load_balance
from atelier.moe.precision import apply_moe_precision
from atelier.moe.replay import RouterReplay, unpack_routes


class MissingRoutes(AtelierError):
    """Router replay is on, but the samples carry no routes."""


def has_routers(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.endswith("TopKRouter") for m in model.modules())


def attach(model: torch.nn.Module, precision: str, router_replay: bool) -> RouterHook:
    apply_moe_precision(model, precision)
    if router_replay and not has_routers(model):
        raise MissingRoutes(f"trainer.router_replay is on, but {type(model).__name__} has no MoE routers",
                            hint="use a mixture-of-experts model (model = \"tiny-moe\"), or router_replay = false")
    return RouterHook(RouterReplay(model) if has_routers(model) else None, router_replay)


class RouterHook:
    """The trainer's hook into a model's routers: router replay per micro-batch, tokens per
    expert, and how often the trainer's routing agrees with the sampler's. `routing` is None
    for a dense model, where every call does nothing."""

    def __init__(self, routing: RouterReplay | None, router_replay: bool) -> None:
        self.routing, self.replay_on = routing, router_replay
        self.expert_tokens: torch.Tensor | None = None
        self._routes_NLk: torch.Tensor | None = None

    @property
    def routed(self) -> bool:
        """Whether the model has routers (a dense model has none)."""
        return self.routing is not None

    @contextmanager
    def micro_batch(self, routes: Sequence[np.ndarray | None], T: int) -> Iterator[None]:
        """The forwards of one micro-batch of samples carrying `routes` (the sampler's experts,
        packed), padded to `T` tokens: replayed with `router_replay` (samples without routes then
        raise `MissingRoutes`); without it, the routes are only compared with the trainer's."""
        self._routes_NLk = self._batch_routes(routes, T)
        if self._routes_NLk is None or not self.replay_on:
            yield
            return
        with self.routing.replay(self._routes_NLk):
            yield

    def _batch_routes(self, routes: Sequence[np.ndarray | None], T: int) -> torch.Tensor | None:
        if self.routing is None or not routes:
            return None
        if not self.replay_on and any(r is None for r in routes):
            return None
        return batch_routes(routes, T, self.routing.num_layers, self.routing.top_k)

    def observe(self, attn_BT: torch.Tensor) -> tuple[int, int]:
        """After the micro-batch's forwards: add its real tokens per expert to the step's counts,
        and return (token x layer rows the sampler recorded, rows where the last forward used
        exactly its set of experts). With replay every row matches; without, 1 - matches/rows is
        the routing flip rate between sampler and trainer."""
        if self.routing is None:
            return 0, 0
        self.count_experts(attn_BT)
        routes_NLk = self._routes_NLk
        if routes_NLk is None:
            return 0, 0
        used_NLk = self.routing.used().cpu()
        real_NL = ((routes_NLk >= 0).all(-1) & attn_BT.reshape(-1, 1).bool().cpu())
        same_NL = (used_NLk.sort(-1).values == routes_NLk.sort(-1).values).all(-1)
        return int(real_NL.sum()), int((same_NL & real_NL).sum())

    def count_experts(self, attn_BT: torch.Tensor | None = None) -> None:
        """Tokens per expert (all MoE layers and k slots) over the last forward's real tokens
        (every token without `attn_BT`)."""
        if self.routing is None:
            return
        used_NLk = self.routing.used()
        if attn_BT is not None:
            used_NLk = used_NLk[attn_BT.reshape(-1).bool().to(used_NLk.device)]
        counts = expert_counts(used_NLk, self.routing.num_experts)
        self.expert_tokens = counts if self.expert_tokens is None else self.expert_tokens + counts

    def load_balance(self) -> dict[str, Any]:
        """Router load balance over the tokens counted since the last call (empty for dense models)."""
        if self.expert_tokens is None:
            return {}
        counts, self.expert_tokens = self.expert_tokens, None
        return load_balance(counts)

    def step_metrics(self, rows: float, matches: float) -> dict[str, Any]:
        """A step's routing metrics: load balance, and agreement with the sampler's routes over
        the `rows` (summed over ranks) it recorded."""
        agreement = {"routes_match_frac": matches / rows, "routes_recorded": int(rows)} if rows else {}
        return {**self.load_balance(), **agreement}


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
