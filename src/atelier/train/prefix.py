"""Prefix sharing: a trainer step's samples as a tree of the token runs they share, each run
forward once, over a key/value cache that never grows.

Legend: P = tokens of one run.

An RL step's samples begin alike, and further than the system prompt: the
members of a group share their task too, and a policy that greps and reads
alike shares its first turns with its group until the turn where the members
diverge (the demo's rollouts: a group of 6 shared 1,277-2,320 tokens, where
the step's samples as a whole shared only the 1,217 of the system prompt).
Running each sample whole runs every shared token once per sample. The
trainer instead walks this tree (`atelier.rl.trainer`): a `PrefixNode` runs
its tokens forward and backward once over its parent's keys and values, and
its children and leaves continue from its end.

Where a node holds trained tokens (a turn its members sampled alike), their
logprob is one number under the current weights, computed once, and each
member's own loss term (its advantage, its sampler logprob, its importance
weight) is applied to it: the loss is a sum over (sample, token), so the
step is the one of running every sample whole, up to rounding
(tests/rl/test_trainer.py).

Positions, for a node that runs [start, end): it feeds the tokens at
start..end-1 and reads from them the logprobs of the tokens at
start+1..end, all of which its members share. A child or leaf continuing it
feeds from `end` on: its first token's logprob was the parent's last (a
sequence's position 0, which nothing predicts, is the same case at the
root), so the continuation's own first position trains nothing.

`encode_prefix(head, ids_1P, ...)` runs one node's tokens and returns a
`SharedPrefix`: its keys and values, which the continuations read through a
`ReadOnlyKVCache`, and (for a node with trained tokens) their logprobs.
`SharedPrefix.backward` then sends the continuations' gradients through the
run's forward once.

The continuations read a run's keys and values through a `ReadOnlyKVCache`
(the trainer's own; the engine's reuse of prompts across requests is
`atelier.inference.prefix_cache`, another thing): a forward reads it and never
grows it, so running the forward again (activation checkpointing's recompute)
sees exactly what the first run saw. Transformers' `DynamicCache.update`
appends each layer's new keys and values to the cache; recomputing a
checkpointed layer in the backward would append them a second time, and the
recomputed attention would read the prefix, the continuation and the
continuation again. `ReadOnlyKVCache.update` instead returns the fixed keys
and values it was built with followed by the new ones and stores nothing in
its layers, so a layer may be recomputed any number of times (transformers
keeps such a cache under checkpointing when the layer says
`_can_checkpoint_with_cache`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from transformers import DynamicCache

from atelier.kernels.logprobs import chunked_logprobs
from atelier.train.head import PolicyHead, cache_keyword, decoder_of

MIN_SHARED_TOKENS = 64
"""A run shorter than this is fed again in each continuation instead: a node's own forward,
kept keys and values and backward cost more than a few dozen tokens run twice."""


@dataclass
class PrefixNode:
    start: int
    end: int
    members: list[int]
    """Indices of the samples that pass through this run (every one shares tokens 0..end)."""
    children: list[PrefixNode] = field(default_factory=list)
    leaves: list[int] = field(default_factory=list)
    """Samples that continue from `end` on their own, to their last token."""


def prefix_forest(token_ids: list[list[int]], minimum: int = MIN_SHARED_TOKENS
                  ) -> tuple[list[PrefixNode], list[int]]:
    """The runs of `minimum` or more tokens that two or more sequences share, as trees, and the
    sequences that share no such run from their start (run whole)."""
    return _forest(token_ids, list(range(len(token_ids))), 0, minimum)


def positions_run(forest: tuple[list[PrefixNode], list[int]], lengths: list[int]) -> int:
    """Positions a step over the forest feeds forward (against sum(lengths) run whole)."""
    nodes, leaves = forest
    return sum(lengths[i] for i in leaves) + sum(_node_positions(n, lengths) for n in nodes)


def _node_positions(node: PrefixNode, lengths: list[int]) -> int:
    return (node.end - node.start + sum(lengths[i] - node.end for i in node.leaves)
            + sum(_node_positions(c, lengths) for c in node.children))


def _forest(seqs: list[list[int]], members: list[int], start: int, minimum: int
            ) -> tuple[list[PrefixNode], list[int]]:
    """`members` share tokens 0..start (0..start-1 at the root) and continue from `start`."""
    if len(members) < 2:
        return [], list(members)
    common = _common_length(seqs, members, start)
    # a node stops one token before the first it cannot share: the continuations feed that token
    # to read the logprob of the next, which differs among them
    end = common - 1
    if end - start >= minimum:
        children, leaves = _forest(seqs, members, end, minimum)
        return [PrefixNode(start, end, list(members), children, leaves)], []
    nodes: list[PrefixNode] = []
    leaves: list[int] = []
    by_next: dict[int, list[int]] = {}
    for m in members:
        if len(seqs[m]) - start <= 1:
            continue   # wholly inside the parent: its last token's logprob is the parent's
        if len(seqs[m]) == common:
            leaves.append(m)
        else:
            by_next.setdefault(seqs[m][common], []).append(m)
    for part in by_next.values():   # each part shares at least one more token than `members` do
        part_nodes, part_leaves = _forest(seqs, part, start, minimum)
        nodes += part_nodes
        leaves += part_leaves
    return nodes, sorted(leaves)


def _common_length(seqs: list[list[int]], members: list[int], start: int) -> int:
    """The length of the prefix every member has in common (at most the shortest member)."""
    first = seqs[members[0]]
    shortest = min(len(seqs[m]) for m in members)
    for i in range(start, shortest):
        token = first[i]
        if any(seqs[m][i] != token for m in members):
            return i
    return shortest


# --- the runs: forward once, backward once ---------------------------------------

class ReadOnlyKVCache(DynamicCache):
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


class SharedPrefix:
    """A run of tokens that sequences of a trainer step continue, run forward once for all of them.

    A step's RL samples share their first ~1,200 tokens (the harness's system
    prompt), and a group's members their task and often their first turns
    (`prefix_forest`): running them once instead of once per sample
    is most of a step's compute on this recipe. The continuations attend to
    detached copies of the run's keys and values (`leaves`), whose gradients
    collect over every continuation's backward; `backward()` then sends them
    through the run's forward once, with the loss of the run's own trained
    tokens. The result is the gradient of running every sample whole, up to
    rounding (tests/rl/test_trainer.py). With `recompute` (the trainer's
    `recompute_prefix`), that forward is run again for the backward instead
    of being kept: the run's activations are not held while every continuation
    runs, for one more forward of the run a step
    (docs/log/2026-12-04-shared-prefix-trainer.md). `length` counts every position the
    continuations read: the parent's too.
    """

    def __init__(self, length: int, kv: list[tuple[torch.Tensor, torch.Tensor]], logprobs_1P: torch.Tensor | None,
                 entropy_1P: torch.Tensor | None, config: Any, recompute: Callable[[], tuple] | None = None) -> None:
        self.length, self.kv, self.config, self.recompute = length, kv, config, recompute
        self.logprobs_1P, self.entropy_1P = logprobs_1P, entropy_1P
        self.leaves = [tuple(t.detach().requires_grad_(t.requires_grad or recompute is not None) for t in pair)
                       for pair in kv]

    def cache(self, batch: int, keep: bool = False):
        """A cache over the leaves for `batch` continuations, which they read and never grow (so a
        checkpointed layer can be recomputed: `ReadOnlyKVCache`); with `keep`, it records what
        a continuation's forward adds (for a run that continues this one)."""
        prefix = [tuple(t.expand(batch, -1, -1, -1) for t in pair) for pair in self.leaves]
        return ReadOnlyKVCache(self.config, prefix, keep=keep)

    def backward(self, loss_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Send the continuations' gradients through the run's forward, with `loss_of(logprobs_1P)`,
        the loss of the run's own trained tokens, when given (computed on the recomputed logprobs
        under `recompute`)."""
        if loss_of is None and not any(leaf.grad is not None for pair in self.leaves for leaf in pair):
            return
        kv, logprobs_1P, _ = self.recompute() if self.recompute is not None else (self.kv, self.logprobs_1P, None)
        outputs, grads = [], []
        for pair, leaves in zip(kv, self.leaves):
            for out, leaf in zip(pair, leaves):
                if leaf.grad is not None:
                    outputs.append(out)
                    grads.append(leaf.grad)
        if loss_of is not None:
            outputs.append(loss_of(logprobs_1P))
            grads.append(None)   # a scalar: d loss / d loss = 1
        if outputs:
            torch.autograd.backward(outputs, grads)


def encode_prefix(head: PolicyHead, ids_1P: torch.Tensor, recompute: bool = False, *,
                  parent: SharedPrefix | None = None, labels_1P: torch.Tensor | None = None,
                  temperature: float = 1.0) -> SharedPrefix:
    """The key/value cache of a run of tokens that sequences continue, in this forward's autograd
    graph (unless under no_grad). With `parent`, the run itself continues the parent's (a node
    of `prefix_forest`); with `labels_1P`, the token after each of `ids_1P`, the run
    also gives their logprobs and entropy (`SharedPrefix.logprobs_1P`, `entropy_1P`).

    With `recompute`, the forward runs without a graph and `SharedPrefix.backward` runs it
    again with one (activation checkpointing of the run alone): the run's activations are
    not held while its continuations run.

    Not for a sharded head: FSDP unshards a layer for its backward when the gradient reaches
    the layer's output, and a prefix's gradient reaches its layers through their keys and
    values instead (the trainer shares prefixes on one rank only).
    """
    lm = head.lm
    base = decoder_of(lm)
    past = parent.length if parent is not None else 0

    def run() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None, torch.Tensor | None]:
        cache = parent.cache(1, keep=True) if parent is not None else ReadOnlyKVCache(lm.config, keep=True)
        hidden_1PH = base(input_ids=ids_1P, attention_mask=ids_1P.new_ones(1, past + ids_1P.shape[1]),
                          use_cache=False, **{cache_keyword(type(base)): cache}).last_hidden_state
        if labels_1P is None:
            return cache.kept_keys_and_values(), None, None
        out = lm.get_output_embeddings()
        logp_N, ent_N = chunked_logprobs(hidden_1PH.reshape(-1, hidden_1PH.shape[-1]), out.weight, out.bias,
                                         labels_1P.reshape(-1), temperature, head.chunk, True)
        return cache.kept_keys_and_values(), logp_N.view(1, -1), ent_N.view(1, -1)

    if not (recompute and torch.is_grad_enabled()):
        return SharedPrefix(past + ids_1P.shape[1], *run(), lm.config)
    rng = _rng_states(ids_1P.device)
    with torch.no_grad():
        kept = run()

    def again():
        with _rng_restored(ids_1P.device, rng):   # the same dropout masks, if the model has any
            return run()

    return SharedPrefix(past + ids_1P.shape[1], *kept, lm.config, recompute=again)


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _rng_restored(device: torch.device, states: tuple[torch.Tensor, torch.Tensor | None]) -> Iterator[None]:
    """Run the block from RNG `states` (as `_rng_states` took them); the RNGs are as before after it."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state(states[1], device)
        yield
