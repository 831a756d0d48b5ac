"""Prefix sharing's pieces: the tree of shared runs, and a recomputed run's gradients.

(That a trainer step over the tree is the step of running every sample whole is
tests/rl/test_trainer.py's.)"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from atelier.train.head import PolicyHead
from atelier.train.prefix import encode_prefix, positions_run, prefix_forest


def test_a_recomputed_prefix_holds_no_graph_until_its_backward(tiny_model_dir):
    """`recompute_prefix`: while the continuations run, the prefix's keys and values come from a
    forward without a graph (its activations are not held); its backward runs it again and gives
    the gradients of the kept graph."""
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    head = PolicyHead(lm)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    grads = []
    for recompute in (False, True):
        head.zero_grad(set_to_none=True)
        prefix = encode_prefix(head, ids[:, :30], recompute=recompute)
        assert all((k.grad_fn is None) == recompute for k, _ in prefix.kv)
        logp, _ = head(ids[:, 30:], torch.ones(1, 10, dtype=torch.long), prefix=prefix)
        logp.sum().backward()
        prefix.backward()
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None})
    kept, recomputed = grads
    assert kept.keys() == recomputed.keys() and "model.layers.0.self_attn.k_proj.weight" in kept
    for name in kept:
        torch.testing.assert_close(recomputed[name], kept[name], rtol=1e-5, atol=1e-7)


def test_prefix_forest_shares_runs_of_the_minimum_length_and_stops_before_a_split():
    prompt = list(range(100))
    a = prompt + [1] * 80 + [5, 6]          # a and b share 180 tokens, c only the prompt
    b = prompt + [1] * 80 + [7, 8, 9]
    c = prompt + [2] * 10
    nodes, leaves = prefix_forest([a, b, c], minimum=64)
    assert leaves == []
    (root,) = nodes
    # the root feeds 0..98 and reads token 99's logprob last: token 100 is the first the continuations differ in
    assert (root.start, root.end, root.members, root.leaves) == (0, 99, [0, 1, 2], [2])
    (pair,) = root.children
    assert (pair.start, pair.end, pair.members, pair.leaves, pair.children) == (99, 179, [0, 1], [0, 1], [])
    assert positions_run((nodes, leaves), [182, 183, 110]) == 99 + 80 + (182 - 179) + (183 - 179) + (110 - 99)
    # below the minimum nothing is shared; a lone sequence is a leaf; a sequence inside another is covered
    assert prefix_forest([a, b, c], minimum=200) == ([], [0, 1, 2])
    assert prefix_forest([a]) == ([], [0])
    nodes, leaves = prefix_forest([a, a[:150]], minimum=64)
    assert leaves == [] and (nodes[0].start, nodes[0].end, nodes[0].leaves) == (0, 149, [0])
