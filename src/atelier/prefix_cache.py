"""A key/value cache that a forward reads and never grows, so running the forward again
(activation checkpointing's recompute) sees exactly what the first run saw.

Transformers' `DynamicCache.update` appends each layer's new keys and values to the
cache; recomputing a checkpointed layer in the backward would append them a second
time, and the recomputed attention would read the prefix, the continuation and the
continuation again. `PrefixCache.update` instead returns the fixed keys and values it
was built with followed by the new ones and stores nothing in its layers, so a layer
may be recomputed any number of times (transformers keeps such a cache under
checkpointing when the layer says `_can_checkpoint_with_cache`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class PrefixCache(DynamicCache):
    """Reads `prefix` (one (keys, values) pair per layer, or none for a forward from position
    0); with `keep`, records each layer's returned keys and values in `kept` (what a prefix's
    own forward produces, for continuations to read)."""

    def __init__(self, config, prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 keep: bool = False) -> None:
        if prefix:
            super().__init__(ddp_cache_data=prefix, config=config)
        else:
            super().__init__(config=config)
        self.keep = keep
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if layer is not None and layer.is_initialized:
            key_states = torch.cat([layer.keys, key_states], dim=-2)
            value_states = torch.cat([layer.values, value_states], dim=-2)
        if self.keep:
            self.kept[layer_idx] = (key_states, value_states)
        return key_states, value_states

    def kept_keys_and_values(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.kept[i] for i in sorted(self.kept)]
