"""Reward = correctness + behaviour shaping, every part reported (pure).

- Length: a concave, increasing cost C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q))
  of a weighted sum x of token kinds (`Trajectory.tokens`), tool calls and
  turns. Concave so the first thousand tokens cost more than the next
  thousand: the model is pushed to be brief on easy tasks without being
  forbidden to think long on hard ones. q = 1 is the log limit log(1 + kx)/k.
- Broken tool calls: a fixed penalty per malformed call. Such rollouts are
  trained on as negative samples, never discarded (discarding them was a
  reward hack: the model learned that breaking a call erases a bad episode).
- To-dos: a penalty per to-do item created and left unfinished.
- Edit (off by default): a targeted behaviour reward, `edit_bonus` when the
  episode's final diff changes at least one line and the grader could apply
  it: the same predicate as the evaluation's `edit` measure
  (`atelier.eval.compare`). At a scale where no rollout passes the hidden
  tests, correctness gives every group zero variance and RL learns nothing;
  this term rewards the first step of a fix (a well-formed, applied edit),
  so groups differ. A recipe that turns it on and names `edit` as its
  headline must say so: the test then measures whether a rewarded behaviour
  carries over to held-out files, not correctness.
- Tamper suspicion (off by default): a fixed penalty when the static screen
  (`atelier.tasks.screen`) flags the final diff for reaching into test
  machinery or process exit. A tampered run already scores 0 whatever the
  shaping; this term only prices the attempt, so a policy learns not to try.
  It is off by default because a real fix may legitimately register an exit
  hook or write `sys.modules`; `tamper_suspect_flag` is logged either way.

`shape_reward` returns a dict of parts whose "total" is the reward used for
the advantage; the rest is logged as is.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from atelier.config import AtelierConfig
from atelier.harness.trajectory import changed_lines
from atelier.tasks.screen import screen_patch

DONE_TODO = {"done", "completed", "complete", "cancelled"}


class ShapingConfig(AtelierConfig):
    length_coef: float = 0.0
    """Weight of the length cost C(x) in the reward (0 turns it off)."""
    length_k: float = Field(1e-3, gt=0)
    """Scale k of the length cost (see the module docstring)."""
    length_q: float = Field(0.5, ge=0)
    """Concavity: 0 is linear, closer to 1 flattens faster."""
    token_weights: dict[str, float] = Field(default_factory=lambda: {
        "thinking": 1.0, "tool_call": 1.0, "tool_output": 0.1, "final_message": 1.0, "summary": 1.0})
    """Weight of each token kind in x (kinds as in Trajectory.tokens; missing kinds weigh 0).
    "completion" is the harness's total of sampled tokens, so it is left out by default
    (it would count thinking and tool-call tokens twice)."""
    tool_call_weight: float = 20.0
    """Weight of each tool call in x."""
    turn_weight: float = 20.0
    """Weight of each turn in x."""
    broken_call_penalty: float = 0.1
    """Subtracted per malformed tool call (such rollouts are trained on, never discarded)."""
    unfinished_todo_penalty: float = 0.05
    """Subtracted per to-do item created and left unfinished."""
    tamper_suspect_penalty: float = Field(0.0, ge=0)
    """Subtracted when the static screen flags the final diff (0 turns it off)."""
    edit_bonus: float = Field(0.0, ge=0)
    """Added when the final diff changes code and applies (0 turns it off; see the module docstring)."""


def length_cost(x: float, k: float, q: float) -> float:
    """C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)); the log limit at q = 1."""
    if x < 0:
        raise ValueError("length x must be >= 0")
    if abs(1.0 - q) < 1e-12:
        return math.log1p(k * x) / k
    return ((1.0 + k * x) ** (1.0 - q) - 1.0) / (k * (1.0 - q))


def length_units(tokens: dict[str, int], tool_calls: int, turns: int, cfg: ShapingConfig) -> float:
    """The weighted sum x the length cost is taken of."""
    x = sum(cfg.token_weights.get(kind, 0.0) * n for kind, n in tokens.items())
    return x + cfg.tool_call_weight * tool_calls + cfg.turn_weight * turns


def unfinished_todos(todos: list[dict[str, Any]]) -> int:
    return sum(1 for t in todos if str(t.get("status", "")).lower() not in DONE_TODO)


def shape_reward(correctness: float, *, tokens: dict[str, int], tool_calls: int, turns: int,
                 broken_calls: int, todos: list[dict[str, Any]], cfg: ShapingConfig,
                 tamper_suspect: bool = False, edited: bool = False) -> dict[str, float]:
    """All parts of the reward; parts["total"] is their sum."""
    x = length_units(tokens, tool_calls, turns, cfg)
    parts = {
        "correctness": float(correctness),
        "length": -cfg.length_coef * length_cost(x, cfg.length_k, cfg.length_q),
        "broken_calls": -cfg.broken_call_penalty * broken_calls,
        "unfinished_todos": -cfg.unfinished_todo_penalty * unfinished_todos(todos),
        "tamper_suspect": -cfg.tamper_suspect_penalty * float(tamper_suspect),
        "edit": cfg.edit_bonus * float(edited),
    }
    parts["total"] = sum(parts.values())
    parts["length_x"] = x  # logged, not part of the total
    parts["tamper_suspect_flag"] = float(tamper_suspect)  # logged, not part of the total
    return parts


def shape_trajectory(traj, correctness: float, cfg: ShapingConfig, *, applied: bool = True) -> dict[str, float]:
    """`shape_reward` over a Trajectory's counters and its final diff's
    static screen; sets traj.reward and reward_parts. `applied`: the grader
    could apply the final diff (no grade error), which the edit term needs."""
    suspect = bool(screen_patch(traj.final_diff)) if getattr(traj, "final_diff", None) else False
    parts = shape_reward(correctness, tokens=traj.tokens, tool_calls=traj.num_tool_calls,
                         turns=traj.turns, broken_calls=traj.broken_calls, todos=traj.todos, cfg=cfg,
                         tamper_suspect=suspect, edited=applied and changed_lines(traj.final_diff) > 0)
    traj.reward = parts["total"]
    traj.reward_parts = parts
    return parts
