"""The reconciler's rules as pure functions (the reconciler and the simulator both call them)."""

from __future__ import annotations

import pytest

from atelier.rl.chain import DELTA, FULL, chain_reads, publish_kind
from atelier.rl.rules import (
    TIED,
    TOO_FEW,
    FailureBreaker,
    admission_limit,
    breaker_limit,
    choose_batch,
    group_verdict,
    may_admit,
    retry_delay,
)


def test_the_docstrings_worked_example():
    """S = 1, G = 2: groups 0-3 admitted at version 0; 1 and 3 finish first and may be trained;
    at version 1 (groups 4, 5 admitted at 1) the batch must include 0 and 2."""
    assert admission_limit(1, 2) == 4
    assert choose_batch([False, True, False, True], [0, 0, 0, 0], version=0, staleness=1, groups_per_step=2,
                        exhausted=False) == [1, 3]
    # version 1: groups 0, 2 (admitted at 0) and 4, 5 (at 1); 4 and 5 are ready first
    untrained_versions = [0, 0, 1, 1]
    assert choose_batch([False, False, True, True], untrained_versions, version=1, staleness=1, groups_per_step=2,
                        exhausted=False) is None
    assert choose_batch([True, True, True, True], untrained_versions, version=1, staleness=1, groups_per_step=2,
                        exhausted=False) == [0, 1]


def test_sync_mode_trains_only_batches_of_the_current_version_and_the_tail_is_trained():
    assert choose_batch([True], [0], version=0, staleness=0, groups_per_step=2, exhausted=False) is None
    assert choose_batch([True], [0], version=0, staleness=0, groups_per_step=2, exhausted=True) == [0]
    assert not may_admit(2, 2, staleness=0, groups_per_step=2, total_steps=0)
    assert may_admit(1, 1, staleness=0, groups_per_step=2, total_steps=0)
    assert not may_admit(0, 6, staleness=1, groups_per_step=2, total_steps=3)   # the step budget is full


def test_retries_back_off_then_drop_and_the_breaker_counts_failures_in_a_row():
    assert [retry_delay(a, max_retries=2, backoff_base_s=1.0) for a in range(3)] == [1.0, 2.0, None]
    assert retry_delay(0, max_retries=1, backoff_base_s=100.0) == 60.0   # the cap
    assert breaker_limit(2) == 8 and breaker_limit(10) == 30
    breaker = FailureBreaker(3)
    assert breaker.failure("a") is None and breaker.failure("b") is None
    breaker.success()
    assert breaker.failure("c") is None and breaker.failure("d") is None
    assert "3 rollouts in a row" in breaker.failure("e").message


def test_group_verdicts():
    assert group_verdict([1.0], 4, min_valid=2, skip_tied_groups=False) == TOO_FEW
    assert group_verdict([1.0], 1, min_valid=2, skip_tied_groups=False) is None   # a group of one
    assert group_verdict([0.5, 0.5], 2, min_valid=2, skip_tied_groups=True) == TIED
    assert group_verdict([0.5, 0.5], 2, min_valid=2, skip_tied_groups=False) is None


def test_the_chain_rules_match_the_module_docstrings_example():
    """full_every=3, publishes at 0..4: full, delta, delta, full, delta; a reader at 1 loads 3's full
    snapshot and applies 4's delta."""
    kinds, has = [], False
    for step in range(5):
        kinds.append(publish_kind(step, full_every=3, has_previous=has))
        has = True
    assert kinds == [FULL, DELTA, DELTA, FULL, DELTA]
    steps = list(zip(range(5), kinds))
    assert chain_reads(steps, 1) == (3, [4])
    assert chain_reads(steps, 3) == (None, [4])
    assert chain_reads(steps, 4) == (None, [])
    assert chain_reads(steps, None) == (3, [4])
    assert chain_reads(steps[:3], 0) == (None, [1, 2])
    with pytest.raises(ValueError):
        chain_reads([(1, DELTA)], None)
    assert publish_kind(7, full_every=10, has_previous=True, same_keys=False) == FULL
