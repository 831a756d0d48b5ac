"""The engine's KV blocks: a fixed pool, allocated per sequence, with a prefix cache over it.

Memory is set by one budget, `kv_cache_tokens`: the pool holds
`kv_cache_tokens // block` blocks of `block` token positions (keys and values
of every layer) and never grows. A sequence owns the blocks its positions fill,
taken as it grows and returned when it finishes, is cancelled or is preempted;
a request that finds no free block waits (see `engine.py`). So 32 sequences of
mixed length cost what their tokens cost, not 32 times the longest one.

Prefix caching lives in the same pool, so it costs no memory of its own. A
*full* block can be registered under a digest of its tokens and its parent's
digest (the block before it): the digest stands for the whole prefix that ends
with that block, and two prompts share exactly the blocks of their longest
common prefix that ends on a block boundary (vLLM's automatic prefix caching
works the same way). A new request whose prompt starts with registered blocks
takes them by reference (no copy) and computes only the rest; it never writes
into them, because a match ends on a block boundary and the request's own
positions start after it. A registered block that no sequence uses any more
stays in the pool as *idle* and is reused until a new allocation needs its
memory (least recently used first).

Bounds and eviction: at most `cache_blocks` blocks are registered at once
(`prefix_cache_tokens // block`, 0 turns prefix caching off); past that the
least recently used is unregistered (and freed if idle). Every lookup and
registration touches a chain from its deepest block back to its first, so a
block is always at least as recent as any block that extends it: eviction
removes ends of chains before their beginnings.

What the engine guarantees around it: blocks are registered only from
requests whose KV was computed entirely by the current weights, and `clear()`
unregisters everything when a weight update lands, so a hit never mixes policy
versions. A match stops at least one token short of the prompt, since the
engine needs the logits of the last prompt token.

Digests are BLAKE2b-128 of the parent digest and the block's token ids: a false
match would need a hash collision. Only the engine's scheduler thread uses a
pool: it is not locked.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import OrderedDict


def block_keys(tokens: list[int], n_blocks: int, block: int) -> list[bytes]:
    """The chained digests of the first `n_blocks` full blocks of `tokens`."""
    keys, parent = [], b""
    for j in range(n_blocks):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(array("q", tokens[j * block:(j + 1) * block]).tobytes())
        parent = digest.digest()
        keys.append(parent)
    return keys


class BlockPool:
    """`num_blocks` KV blocks of `block` positions: allocation, reference counts, prefix index.

    `BlockPool(num_blocks, block=32, cache_blocks=num_blocks)`. Block ids index
    the engine's KV tensors. A block is *free* (in no sequence, not registered),
    *used* (held by one or more sequences) or *idle* (registered, held by none).
    `allocate` takes free blocks first, then evicts idle ones.

    Placement: the engine's attention reads a sequence's keys in place when its blocks are
    consecutive (`forward.py`), so `allocate(n, after=b)` continues right after block `b` while
    those blocks are free, and otherwise starts in the middle of the longest free stretch, or at
    its start when it begins the pool (a new sequence leaves room to grow both to whatever
    sequence ends just before the stretch and to itself). Any free block is still used when
    memory is tight: placement only decides which, never whether.
    """

    def __init__(self, num_blocks: int, block: int = 32, cache_blocks: int | None = None) -> None:
        if num_blocks < 1 or block < 1:
            raise ValueError("num_blocks and block must be >= 1")
        self.block = block
        self.num_blocks = num_blocks
        self.max_blocks = num_blocks if cache_blocks is None else max(0, min(cache_blocks, num_blocks))
        self._is_free = bytearray(b"\x01") * num_blocks
        self._nfree = num_blocks
        self._refs = [0] * num_blocks
        self._by_key: OrderedDict[bytes, int] = OrderedDict()  # registered blocks, least recent first
        self._key_of: dict[int, bytes] = {}
        self.peak_used = 0

    # -- accounting -----------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        """Whether prefix caching is on."""
        return self.max_blocks > 0

    @property
    def tokens(self) -> int:
        """Token positions registered for reuse now (in use or idle)."""
        return len(self._by_key) * self.block

    @property
    def used(self) -> int:
        """Blocks held by at least one sequence."""
        return sum(1 for r in self._refs if r > 0)

    @property
    def available(self) -> int:
        """Blocks an allocation could get now: free ones plus idle registered ones."""
        return self._nfree + sum(1 for b in self._by_key.values() if self._refs[b] == 0)

    # -- allocation -----------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """`n` blocks for one sequence (reference count 1), consecutive where possible and right
        after block `after` when that is free, or None, taking nothing, if the pool cannot supply
        them."""
        if n <= 0:
            return []
        if n > self.available:
            return None
        out: list[int] = []
        at = None if after is None else after + 1
        while len(out) < n:
            if at is None or at >= self.num_blocks or not self._is_free[at]:
                if not self._nfree:
                    self._evict_idle()
                at = self._place(n - len(out))
            self._is_free[at] = 0
            self._nfree -= 1
            self._refs[at] = 1
            out.append(at)
            at += 1
        self._note_peak()
        return out

    def _place(self, n: int) -> int:
        """Where a new run of `n` blocks starts: see the class docstring."""
        start, length = max(((m.start(), m.end() - m.start()) for m in re.finditer(b"\x01+", self._is_free)),
                            key=lambda run: run[1])
        return start if start == 0 or length <= n else start + (length - n) // 2

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced unregistered blocks become free."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0 and b not in self._key_of:
                self._mark_free(b)

    # -- prefix cache ---------------------------------------------------------------
    def keys_for(self, prompt: list[int]) -> list[bytes]:
        """Digests of the blocks a prompt could reuse: full blocks, leaving at least one token to run."""
        if not self.enabled:
            return []
        return block_keys(prompt, (len(prompt) - 1) // self.block, self.block)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def cached_prefix(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, are registered."""
        n = 0
        while n < len(keys) and keys[n] in self._by_key:
            n += 1
        return n

    def match(self, keys: list[bytes]) -> list[int]:
        """The registered blocks of the longest registered prefix of `keys`, each with one more
        reference (the caller's sequence now holds them; give them back with `release`)."""
        found = [self._by_key[k] for k in keys[:self.cached_prefix(keys)]]
        self._touch(keys[:len(found)])
        for b in found:
            self._refs[b] += 1
        self._note_peak()
        return found

    def register(self, tokens: list[int], blocks: list[int], length: int) -> int:
        """Register the full blocks among the first `length` positions of `tokens`, held in
        `blocks` (the sequence's block table). Returns the number of blocks newly registered."""
        n = min(length // self.block, len(blocks))
        if not self.enabled or n == 0:
            return 0
        keys = block_keys(tokens, n, self.block)
        added = 0
        for key, b in zip(keys, blocks):
            if key in self._by_key or b in self._key_of:
                continue  # another block already holds this prefix; this one stays private
            self._by_key[key] = b
            self._key_of[b] = key
            added += 1
        self._touch([k for k in keys if k in self._by_key])
        while len(self._by_key) > self.max_blocks:
            self._unregister(next(iter(self._by_key)))
        return added

    def clear(self) -> None:
        """Unregister every block (a weight update landed): idle ones become free."""
        for key in list(self._by_key):
            self._unregister(key)

    # -- internals --------------------------------------------------------------------
    def _unregister(self, key: bytes) -> None:
        b = self._by_key.pop(key)
        del self._key_of[b]
        if self._refs[b] == 0:
            self._mark_free(b)

    def _mark_free(self, b: int) -> None:
        self._is_free[b] = 1
        self._nfree += 1

    def _evict_idle(self) -> None:
        for key, b in self._by_key.items():  # least recently used first
            if self._refs[b] == 0:
                self._unregister(key)
                return
        raise RuntimeError("no idle block to evict")  # `available` said there was one

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the first block ends up most recent: chains lose their ends first
            self._by_key.move_to_end(key)

    def _note_peak(self) -> None:
        used = self.num_blocks - self._nfree  # held or idle-registered: what the pool's memory holds
        self.peak_used = max(self.peak_used, used)
