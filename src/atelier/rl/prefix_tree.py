"""A trainer step's samples as a tree of the token runs they share, each run once.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
