"""Metrics against values computed by hand (pure: no sandbox, no model)."""

from __future__ import annotations

import math

import pytest

from atelier.eval.metrics import EvalMetrics, compute_metrics, mean_ci, pass_at_k
from atelier.eval.records import EvalRecord


def rec(task: str, i: int, reward: float | None, *, infra: bool = False, cost: float | None = None,
        wall: float = 1.0, turns: int = 1, calls: int = 0, broken: int = 0, **kw) -> EvalRecord:
    return EvalRecord(task_id=task, pass_index=i, reward=reward, success=reward == 1.0,
                      infra_error=infra, cost=cost, wall_s=wall, turns=turns, tool_calls=calls,
                      broken_calls=broken, **kw)


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 0, 1, 0.0),
    (5, 5, 3, 1.0),
    (5, 2, 1, 2 / 5),
    # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 2, 0.7),
    # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 3, 0.9),
    # n - c < k: every k-subset holds a success
    (5, 2, 4, 1.0),
    # 1 - C(7,4)/C(10,4) = 1 - 35/210
    (10, 3, 4, 1 - 35 / 210),
])
def test_pass_at_k_matches_the_binomial_formula(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    if n - c >= k:
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_mean_ci_is_the_normal_approximation() -> None:
    # values 0, 0.5, 1: mean 0.5, sample stdev 0.5, se = 0.5/sqrt(3)
    mean, low, high = mean_ci([0.0, 0.5, 1.0], z=2.0)
    se = 0.5 / math.sqrt(3)
    assert mean == 0.5 and low == pytest.approx(0.5 - 2 * se) and high == pytest.approx(0.5 + 2 * se)
    assert mean_ci([0.7]) == (0.7, None, None)


def test_run_metrics_by_hand() -> None:
    records = [
        # task a: 2 of 3 solved
        rec("a", 0, 1.0, cost=0.10, wall=2.0, turns=3, calls=4, broken=1, tokens={"completion": 10}),
        rec("a", 1, 0.0, cost=0.20, wall=4.0, turns=5, calls=6, tokens={"completion": 30}),
        rec("a", 2, 1.0, cost=0.30, wall=6.0, turns=1, calls=0, tokens={"completion": 20}),
        # task b: never solved, one infrastructure error (excluded everywhere but the count)
        rec("b", 0, 0.0, cost=0.40, wall=8.0, turns=1, calls=0),
        rec("b", 1, None, infra=True, error_type="SandboxError", cost=9.0, wall=100.0),
        rec("b", 2, 0.0, cost=0.50, wall=10.0, turns=2, calls=0),
    ]
    m = compute_metrics(records, passes=3, model="m")
    assert (m.tasks, m.attempts, m.valid_attempts, m.infra_errors) == (2, 6, 5, 1)
    assert m.infra_error_types == {"SandboxError": 1}
    # per-task means 2/3 and 0: accuracy 1/3
    assert m.accuracy == pytest.approx(1 / 3)
    se = math.sqrt(((2 / 3 - 1 / 3) ** 2 + (0 - 1 / 3) ** 2) / 1) / math.sqrt(2)
    low, high = m.accuracy_ci
    assert 1 / 3 - 1.959963984540054 * se < 0 and low == 0.0  # clipped to the reward's range
    assert high == pytest.approx(1 / 3 + 1.959963984540054 * se)
    # pass@1 = mean(2/3, 0); pass@2 = mean(1 - C(1,2)/C(3,2) = 1, 1 - C(2,2)/C(2,2) = 0)
    assert m.pass_at_k[1] == pytest.approx(1 / 3)
    assert m.pass_at_k[2] == pytest.approx(0.5)
    # pass@3 only over task a (b has 2 valid passes): 1
    assert m.pass_at_k[3] == pytest.approx(1.0) and m.pass_at_k_tasks == {1: 2, 2: 2, 3: 1}
    assert m.best_of_k == pytest.approx(0.5)
    # per pass: pass 0 = (1 + 0)/2, pass 1 = 0/1 (b's infra left out), pass 2 = (1 + 0)/2
    assert m.pass_accuracies == pytest.approx([0.5, 0.0, 0.5])
    assert m.median_cost == pytest.approx(0.30) and m.total_cost == pytest.approx(1.5)
    assert m.median_wall_s == pytest.approx(6.0) and m.mean_wall_s == pytest.approx(6.0)
    assert m.tokens == {"completion": 60} and m.mean_tokens == {"completion": 12.0}
    assert m.mean_turns == pytest.approx(12 / 5) and m.mean_tool_calls == pytest.approx(2.0)
    assert m.broken_calls == 1 and m.broken_call_rate == pytest.approx(0.1)
    a, b = m.per_task
    assert (a.task_id, a.successes, a.valid, a.mean_reward, a.best_reward) == ("a", 2, 3, pytest.approx(2 / 3), 1.0)
    assert (b.valid, b.infra_errors, b.best_reward, b.median_cost) == (2, 1, 0.0, pytest.approx(0.45))


def test_best_of_k_differs_from_pass_at_1_with_partial_rewards() -> None:
    records = [rec("a", 0, 0.5), rec("a", 1, 0.0), rec("b", 0, 1.0), rec("b", 1, 1.0)]
    m = compute_metrics(records)
    assert m.passes == 2
    assert m.best_of_k == pytest.approx((0.5 + 1.0) / 2)
    assert m.accuracy == pytest.approx((0.25 + 1.0) / 2)
    assert m.pass_at_k[2] == pytest.approx(0.5)  # 0.5 is not a success


def test_single_task_has_no_interval_and_round_trips() -> None:
    m = compute_metrics([rec("a", 0, 1.0, cost=None)])
    assert m.accuracy == 1.0 and m.accuracy_ci is None and m.median_cost is None
    again = EvalMetrics.from_dict(m.to_dict())
    assert again == m


def test_only_infra_errors_leave_accuracy_undefined() -> None:
    m = compute_metrics([rec("a", 0, None, infra=True, error_type="ConnectionError")])
    assert m.accuracy is None and m.best_of_k is None and m.pass_at_k == {}
    assert m.infra_errors == 1 and m.valid_attempts == 0


def test_price_table_longest_pattern_wins_and_unknown_has_no_price(tmp_path) -> None:
    from atelier.eval.prices import load_prices
    from atelier.eval.records import EvalError

    table = load_prices()  # the packaged table parses
    assert table.cost("smollm2-135m", 1000, 1000) == 0.0
    path = tmp_path / "p.toml"
    path.write_text('[models."gpt*"]\ninput = 1.0\noutput = 2.0\n'
                    '[models."gpt-mini*"]\ninput = 0.5\noutput = 1.0\n')
    mine = load_prices(path)
    # 2M in at 0.5 $/M + 1M out at 1 $/M
    assert mine.cost("gpt-mini-2", 2_000_000, 1_000_000) == pytest.approx(2.0)
    assert mine.cost("gpt-x", 1_000_000, 1_000_000) == pytest.approx(3.0)
    assert mine.cost("llama", 10, 10) is None
    with pytest.raises(EvalError, match="not found"):
        load_prices(tmp_path / "missing.toml")
    path.write_text('[models."x"]\ninput = -1\noutput = 0\n')
    with pytest.raises(EvalError, match="price table"):
        load_prices(path)


def test_each_pass_gets_its_own_seed() -> None:
    from atelier.eval.runner import PASS_SEED_STRIDE, config_for_pass
    from atelier.harness.config import AgentConfig

    unseeded = AgentConfig()
    assert config_for_pass(unseeded, 3) is unseeded
    seeded = AgentConfig.model_validate({"sampling": {"seed": 7}})
    seeds = [config_for_pass(seeded, i).sampling.seed for i in range(3)]
    assert seeds == [7, 7 + PASS_SEED_STRIDE, 7 + 2 * PASS_SEED_STRIDE]
    assert seeded.sampling.seed == 7  # the caller's config is not changed
