"""Loss, advantages and shaping against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from atelier.harness.trajectory import ToolCallRecord, Trajectory
from atelier.rl.advantages import group_advantages, group_stats
from atelier.rl.loss import LossInputs, policy_loss
from atelier.rl.shaping import ShapingConfig, length_cost, shape_reward, shape_trajectory


def test_group_advantage_is_reward_minus_mean_without_std():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    # std would be tiny here; no division means the values stay small
    assert group_advantages([0.1, 0.0]) == pytest.approx([0.05, -0.05])


def test_infra_failures_are_excluded_from_the_group_mean():
    assert group_advantages([1.0, None, 0.0, 0.0]) == pytest.approx([2 / 3, None, -1 / 3, -1 / 3])
    assert group_advantages([None, None]) == [None, None]
    stats = group_stats([1.0, None, 0.0], [True, None, False])
    assert stats["zero_variance"] == 0.0
    assert group_stats([-0.1, None, -0.1], [False, None, False])["zero_variance"] == 1.0
    assert stats == {"reward_mean": 0.5, "pass_rate": 0.5, "best_of_k": 1.0, "valid": 2.0, "zero_variance": 0.0}


def _inputs(logp, mu, adv, mask, ref=None):
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return LossInputs(t(logp).requires_grad_(), t(mu), t(adv), t(mask), None if ref is None else t(ref))


def test_loss_sums_tokens_and_divides_by_a_constant():
    # two sequences of different lengths; on-policy (ratio 1)
    logp = [[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]]
    inp = _inputs(logp, logp, [1.0, -2.0], [[1, 1, 0], [1, 0, 0]])
    loss, m = policy_loss(inp, norm_tokens=10.0)
    # -(1*(-1) + 1*(-2) + (-2)*(-0.5)) / 10 = -(-3 + 1)/10 = 0.2
    assert float(loss.detach()) == pytest.approx(0.2)
    loss.backward()
    # d loss / d logp = -w * A / 10 on masked tokens; no per-sequence length factor
    assert torch.allclose(inp.logprobs_BT.grad, torch.tensor([[-0.1, -0.1, 0.0], [0.2, 0.0, 0.0]], dtype=torch.float64))
    assert m["tokens"] == 3 and m["is_weight_mean"] == pytest.approx(1.0)


def test_importance_weight_is_truncated_at_c():
    # ratios: e^1 ~ 2.718 (capped at 2), e^-1 ~ 0.368
    inp = _inputs([[-1.0, -2.0]], [[-2.0, -1.0]], [1.0], [[1, 1]])
    loss, m = policy_loss(inp, is_cap=2.0, norm_tokens=1.0)
    expected = -(2.0 * -1.0 + math.exp(-1) * -2.0)
    assert float(loss.detach()) == pytest.approx(expected)
    loss.backward()
    assert torch.allclose(inp.logprobs_BT.grad, torch.tensor([[-2.0, -math.exp(-1)]], dtype=torch.float64))
    assert m["is_truncated_frac"] == pytest.approx(0.5)
    assert m["is_ratio_max"] == pytest.approx(math.e)


def test_k1_kl_enters_as_a_detached_per_token_penalty():
    inp = _inputs([[-1.0, -1.0]], [[-1.0, -1.0]], [0.0], [[1, 1]], ref=[[-1.5, -0.5]])
    loss, m = policy_loss(inp, kl_beta=0.1, norm_tokens=1.0)
    # k1 = logp - ref = [0.5, -0.5]; per-token advantage = -0.1 * k1
    assert float(loss.detach()) == pytest.approx(-((-0.05) * -1.0 + 0.05 * -1.0))
    assert m["kl_k1"] == pytest.approx(0.0)
    loss.backward()
    assert torch.allclose(inp.logprobs_BT.grad, torch.tensor([[0.05, -0.05]], dtype=torch.float64))


def test_beta_zero_needs_no_reference():
    inp = _inputs([[-1.0]], [[-1.0]], [1.0], [[1]])
    loss, m = policy_loss(inp, kl_beta=0.0)
    assert m["kl_k1"] == 0.0
    with pytest.raises(ValueError):
        policy_loss(inp, kl_beta=0.1)


def test_length_cost_is_concave_and_matches_the_formula():
    k, q = 0.01, 0.5
    # ((1 + 1)^0.5 - 1) / (0.01 * 0.5) at x = 100
    assert length_cost(100, k, q) == pytest.approx((math.sqrt(2) - 1) / 0.005)
    assert length_cost(0, k, q) == 0.0
    assert length_cost(200, k, q) - length_cost(100, k, q) < length_cost(100, k, q)
    assert length_cost(100, k, 1.0) == pytest.approx(math.log(2) / 0.01)
    assert length_cost(100, k, 0.0) == pytest.approx(100.0)  # q = 0: linear


def test_shaping_reports_every_part():
    cfg = ShapingConfig(length_coef=0.001, length_k=0.01, length_q=0.0,
                        token_weights={"completion": 1.0, "tool_output": 0.5},
                        tool_call_weight=10.0, turn_weight=5.0,
                        broken_call_penalty=0.2, unfinished_todo_penalty=0.1)
    parts = shape_reward(1.0, tokens={"completion": 100, "tool_output": 40, "prompt": 999},
                         tool_calls=2, turns=3, broken_calls=1,
                         todos=[{"status": "done"}, {"status": "pending"}, {"text": "x"}], cfg=cfg)
    # x = 100 + 20 + 20 + 15 = 155; linear cost (q=0) = 155 -> -0.155
    assert parts["length_x"] == pytest.approx(155.0)
    assert parts["length"] == pytest.approx(-0.155)
    assert parts["broken_calls"] == pytest.approx(-0.2)
    assert parts["unfinished_todos"] == pytest.approx(-0.2)
    assert parts["total"] == pytest.approx(1.0 - 0.155 - 0.2 - 0.2)


def test_broken_calls_are_penalised_on_a_trajectory_not_discarded():
    traj = Trajectory(task_id="t", turns=1, tokens={"completion": 10})
    traj.tool_calls.append(ToolCallRecord(turn=0, name="?", arguments={}, output="bad json", ok=False, broken=True))
    parts = shape_trajectory(traj, 0.0, ShapingConfig(broken_call_penalty=0.3))
    assert traj.reward == pytest.approx(-0.3) and traj.reward_parts is parts


def test_edit_bonus_needs_a_changed_line_that_the_grader_applied():
    diff = "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    cfg = ShapingConfig(edit_bonus=0.5)
    edited = Trajectory(task_id="t", turns=2, final_diff=diff)
    assert shape_trajectory(edited, 0.0, cfg)["edit"] == pytest.approx(0.5)
    assert edited.reward == pytest.approx(0.5)
    rejected = Trajectory(task_id="t", turns=2, final_diff=diff)
    assert shape_trajectory(rejected, 0.0, cfg, applied=False)["edit"] == 0.0
    headers_only = Trajectory(task_id="t", turns=2, final_diff="--- a/m.py\n+++ b/m.py\n")
    assert shape_trajectory(headers_only, 0.0, cfg)["edit"] == 0.0
    off = Trajectory(task_id="t", turns=2, final_diff=diff)
    assert shape_trajectory(off, 0.0, ShapingConfig())["edit"] == 0.0 and off.reward == 0.0


def test_changed_lines_counts_added_and_removed_lines_not_headers():
    from atelier.harness.trajectory import changed_lines

    diff = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n-a\n+b\n c\n+d\n"
    assert changed_lines(diff) == 3 and changed_lines("") == 0
