"""The token-balanced partition of a step is balanced, deterministic, and the same number of
passes on every rank."""

from __future__ import annotations

from atelier.train.batching import balanced_partition, step_plan


def test_balanced_partition_balances_tokens_and_every_rank_runs_the_same_passes():
    lengths = [100, 7, 53, 53, 9, 200, 31, 64, 12, 80, 5]
    parts = balanced_partition(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)            # the greedy bound
    assert max(loads) <= sum(lengths) / 3 + max(lengths)
    assert balanced_partition(lengths, 3) == parts          # every rank computes the same plan
    plans = [step_plan(lengths, 3, r, micro_batch=2) for r in range(3)]
    assert len({len(p) for p in plans}) == 1                  # same number of forward/backward passes
    assert sorted(i for p in plans for mb in p for i in mb) == list(range(len(lengths)))
    assert step_plan([5, 6], 4, 3, micro_batch=8) == [[]]  # more ranks than samples: an empty pass
    assert step_plan(lengths, 1, 0, micro_batch=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
