"""Keys and values of token prefixes the engine has already computed, reused by later requests.

An agent's next turn is its previous turn's tokens plus the model's reply
plus a tool's output (token in, token out: nothing before is re-tokenized),
and concurrent rollouts of one task share their whole system prompt. Without
this cache every turn prefills its whole context again, which on a CPU is
most of an episode's time.

The cache holds *blocks* of `block` consecutive tokens. A block is named by
a digest of its tokens and its parent's digest (the block before it), so a
block stands for the whole prefix that ends with it, and two prompts share
exactly the blocks of their longest common prefix that ends on a block
boundary (vLLM's automatic prefix caching works the same way). Each block
holds its keys and values for every layer: `[L, Hkv, block, D]`, copied out
of the engine's slot cache, so cached blocks never alias a running request.

Bounds and eviction: at most `budget_tokens // block` blocks, least recently
used first. Every lookup and insert touches a chain from its deepest block
back to its first, so a block is always at least as recent as any block that
extends it: eviction removes ends of chains before their beginnings and never
leaves a reachable block without its parent.

What the engine guarantees around it (see `engine.py`): blocks are inserted
only from requests whose KV was computed entirely by the current weights, and
the whole cache is dropped when a weight update lands, so a hit never mixes
policy versions. A match stops at least one token short of the prompt, since
the engine needs the logits of the last prompt token.

Digests are BLAKE2b-128 of the parent digest and the block's token ids:
a false match would need a hash collision.

Shape legend: L layers, Hkv key/value heads, n tokens, D head dim.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

KVReader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Block:
    k_LHnD: torch.Tensor
    v_LHnD: torch.Tensor


def block_keys(tokens: list[int], n_blocks: int, block: int) -> list[bytes]:
    """The chained digests of the first `n_blocks` full blocks of `tokens`."""
    keys, parent = [], b""
    for j in range(n_blocks):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(array("q", tokens[j * block:(j + 1) * block]).tobytes())
        parent = digest.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """An LRU store of KV blocks keyed by token prefix; see the module docstring.

    `PrefixCache(budget_tokens, block=32)`; `budget_tokens=0` disables it.
    Only the engine's scheduler thread uses it: it is not locked.
    """

    def __init__(self, budget_tokens: int, block: int = 32) -> None:
        if budget_tokens < 0 or block < 1:
            raise ValueError("budget_tokens must be >= 0 and block >= 1")
        self.block = block
        self.max_blocks = budget_tokens // block
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_blocks > 0

    @property
    def tokens(self) -> int:
        """Tokens held now."""
        return len(self._blocks) * self.block

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def keys_for(self, prompt: list[int]) -> list[bytes]:
        """Digests of the blocks a prompt could reuse: full blocks, leaving at least one token to run."""
        if not self.enabled:
            return []
        return block_keys(prompt, (len(prompt) - 1) // self.block, self.block)

    def match(self, keys: list[bytes]) -> list[Block]:
        """The cached blocks of the longest cached prefix of `keys` (touched as recently used)."""
        found = []
        for key in keys:
            entry = self._blocks.get(key)
            if entry is None:
                break
            found.append(key)
        self._touch(found)
        return [self._blocks[k] for k in found]

    def insert(self, tokens: list[int], length: int, read: KVReader) -> int:
        """Cache the full blocks of `tokens[:length]`; `read(start, end)` copies their (k, v) out.

        Returns the number of blocks added. At most `max_blocks` of the chain are kept.
        """
        n = min(length // self.block, self.max_blocks)
        if n == 0:
            return 0
        keys = block_keys(tokens, n, self.block)
        added = 0
        for j, key in enumerate(keys):
            if key not in self._blocks:
                k, v = read(j * self.block, (j + 1) * self.block)
                self._blocks[key] = Block(k, v)
                added += 1
        self._touch(keys)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
        return added

    def clear(self) -> None:
        self._blocks.clear()

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the first block ends up most recent: chains lose their ends first
            self._blocks.move_to_end(key)
