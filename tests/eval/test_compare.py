"""The headline comparison's statistics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from atelier.eval.compare import (
    MEASURES,
    binomial_upper_tail,
    evaluation_figures,
    mcnemar_one_sided,
    pair_attempts,
    wilson_interval,
)
from atelier.eval.records import EvalRecord


def rec(task: str, index: int, success: bool, *, diff: int = 0, infra: bool = False,
        grade_error: str | None = None, reward: float | None = None) -> EvalRecord:
    return EvalRecord(task_id=task, pass_index=index, success=success, infra_error=infra, diff_lines=diff,
                      grade_error=grade_error, reward=float(success) if reward is None else reward)


def test_binomial_upper_tail_by_enumeration() -> None:
    assert binomial_upper_tail(0, 5) == 1.0
    assert binomial_upper_tail(5, 5) == 1 / 32
    assert binomial_upper_tail(4, 5) == 6 / 32
    assert binomial_upper_tail(6, 5) == 0.0
    # Against a brute-force count over all 2^n outcomes.
    n = 9
    for k in range(n + 2):
        brute = sum(1 for bits in range(2 ** n) if bin(bits).count("1") >= k) / 2 ** n
        assert math.isclose(binomial_upper_tail(k, n), brute)


def test_mcnemar_counts_only_discordant_pairs() -> None:
    pairs = [(False, True)] * 6 + [(True, False)] * 1 + [(True, True)] * 20 + [(False, False)] * 10
    result = mcnemar_one_sided(pairs)
    assert (result["improved"], result["worsened"], result["pairs"]) == (6, 1, 37)
    assert math.isclose(result["p_value"], (math.comb(7, 6) + math.comb(7, 7)) / 2 ** 7)  # 0.0625
    assert mcnemar_one_sided([(True, True), (False, False)])["p_value"] == 1.0
    # A change for the worse is never significant one-sided.
    assert mcnemar_one_sided([(True, False)] * 8)["p_value"] == 1.0
    assert mcnemar_one_sided([(False, True)] * 5)["p_value"] == 1 / 32


def test_wilson_interval_known_values() -> None:
    low, high = wilson_interval(0, 32)
    assert low == 0.0 and math.isclose(high, 0.10718, abs_tol=1e-4)
    low, high = wilson_interval(16, 32)
    assert math.isclose(low, 0.33631, abs_tol=1e-4) and math.isclose(high, 0.66369, abs_tol=1e-4)
    assert wilson_interval(0, 0) is None
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_pairing_is_by_task_and_pass_and_skips_infrastructure_errors() -> None:
    before = [rec("a", 0, False), rec("a", 1, True), rec("b", 0, False, infra=True), rec("c", 0, False)]
    after = [rec("a", 1, True), rec("a", 0, True), rec("b", 0, True), rec("d", 0, True)]
    assert pair_attempts(before, after, MEASURES["pass"]) == [(False, True), (True, True)]


def test_evaluation_figures() -> None:
    records = [rec("a", 0, True, diff=3), rec("a", 1, False, diff=2, grade_error="patch does not apply"),
               rec("b", 0, False, diff=0), rec("b", 1, False, infra=True), rec("c", 0, False, diff=1, reward=0.5)]
    f = evaluation_figures(records, "edit")
    assert f["attempts"] == 5 and f["valid_attempts"] == 4 and f["tasks"] == 3
    assert f["pass_rate"] == 0.25 and f["best_of_k"] == 1 / 3
    assert f["pass_rate_interval_95"] == wilson_interval(1, 4)
    assert f["edit"]["rate"] == 0.5 and f["edit"]["best_of_k"] == 2 / 3
    assert f["headline"]["measure"] == "edit" and f["headline"]["rate"] == 0.5
    assert f["mean_reward"] == 1.5 / 4
    with pytest.raises(ValueError, match="unknown measure"):
        evaluation_figures(records, "vibes")
