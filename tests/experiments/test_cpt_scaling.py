"""experiments/cpt_scaling: the next-line task and reward, and the whole experiment at smoke scale."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.helpers import load_experiment

run = load_experiment("cpt_scaling")  # puts the experiment directory on sys.path for `completion`
completion = sys.modules["completion"]

CODE = "\n".join([
    "import os",
    "",
    "# a comment that is never a target",
    "def join(a, b):",
    "    path = os.path.join(a, b)",
    "    return path",
    "",
    "class Thing:",
    "    def __init__(self, value):",
    "        self.value = value",
    "    def double(self):",
    "        return self.value * 2",
]) + "\n"


def test_line_tasks_ask_for_the_line_after_their_context() -> None:
    lines = CODE.splitlines()
    tasks = completion.line_tasks([("pkg/mod.py", CODE)], 10, seed=0, per_file=10, context_lines=3,
                                  min_chars=8, max_chars=48)
    assert tasks, "the file has predictable lines"
    for task in tasks:
        n = task.metadata["line"]  # 1-based line number of the target
        assert task.target == lines[n - 1]
        assert task.target.strip() and not task.target.strip().startswith("#")
        assert task.prompt == completion.prompt_for("pkg/mod.py", lines[n - 4:n - 1])
    again = completion.line_tasks([("pkg/mod.py", CODE)], 10, seed=0, per_file=10, context_lines=3,
                                  min_chars=8, max_chars=48)
    assert [t.to_json() for t in again] == [t.to_json() for t in tasks]
    assert len(completion.line_tasks([("pkg/mod.py", CODE)], 2, seed=0, per_file=10, context_lines=3)) == 2


def test_line_reward_scores_the_first_line_by_edit_similarity() -> None:
    assert completion.line_reward("    return path\nmore text", "    return path") == 1.0
    assert completion.line_reward("    return path   ", "    return path") == 1.0
    assert completion.line_reward("", "    return path") == 0.0
    partial = completion.line_reward("    return pat", "    return path")
    assert 0.0 < partial < 1.0
    assert partial == pytest.approx(1 - 1 / len("    return path"))


def test_environment_rollout_rewards_and_passes_on_the_written_line(tiny_model_dir) -> None:
    from atelier.inference.scripted import ScriptedModel
    from atelier.rl.config import RolloutConfig
    from atelier.rl.shaping import ShapingConfig

    task = completion.LineTask("rl-0", completion.prompt_for("m.py", ["def f(x):"]), "    return x + 1")
    env = completion.NextLineEnvironment([task], RolloutConfig(max_tokens=32), ShapingConfig())
    model = ScriptedModel(tiny_model_dir, ["    return x + 1", "    return x"])
    exact, partial = env.rollout(task, model, seed=1), env.rollout(task, model, seed=2)
    assert exact.reward == 1.0 and exact.reward_parts["pass"] == 1.0
    assert 0.0 < partial.reward < 1.0 and partial.reward_parts["pass"] == 0.0
    seg = exact.segments[0]
    assert sum(seg.loss_mask) == len(model.outputs[0])  # trained on exactly the sampled tokens
    assert env.tasks() == [task] and env.category(task) == "indent-0"


def test_budgets_and_final_reward() -> None:
    assert run.parse_budgets("1,4,16") == [1, 4, 16]
    for bad in ("4,1", "1", "0,2", "1,1,4"):
        with pytest.raises(SystemExit):
            run.parse_budgets(bad)
    m, se = run.final_reward([0.0, 0.0, 0.2, 0.4], 2)
    assert m == pytest.approx(0.3) and se == pytest.approx(0.1)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_smoke_experiment_end_to_end(tmp_path) -> None:
    out = tmp_path / "exp"
    results = run.main(["--out", str(out), "--smoke"])

    saved = json.loads((out / "results.json").read_text())
    assert saved["arms"] == json.loads(json.dumps(results["arms"]))
    arms = saved["arms"]
    assert [a["multiplier"] for a in arms] == [1, 4, 16]
    tokens = [a["cpt"]["tokens"] for a in arms]
    assert tokens[1] == 4 * tokens[0] and tokens[2] == 16 * tokens[0]
    nll = [a["cpt"]["heldout_nll"] for a in arms]
    assert all(math.isfinite(x) and 0 < x < math.log(600) for x in nll)
    assert nll[2] < nll[0], nll  # 16x the CPT lowers held-out loss even at smoke scale
    rl_ids = {json.loads(line)["id"] for line in (out / "rl_tasks.jsonl").read_text().splitlines()}
    for arm in arms:
        m = arm["multiplier"]
        assert (out / f"cpt-{m}x" / "final" / "config.json").exists()
        assert (out / f"sft-{m}x" / "final" / "config.json").exists()
        assert arm["sft"]["steps"] == saved["setup"]["sft_steps"]
        rl = arm["rl"]
        assert rl["steps"] == saved["setup"]["rl_steps"] == len(rl["reward_curve"])
        assert all(0.0 <= r <= 1.0 for r in rl["reward_curve"])
        assert 0.0 <= rl["reward_final"] <= 1.0
        # The RL run trained on the next-line tasks, named by its config as an [env.python] factory.
        assert 'completion.py:make_environment' in (out / f"rl-{m}x" / "config.toml").read_text()
        rollouts = list((out / f"rl-{m}x" / "rollouts").glob("*.json"))
        assert rollouts and {json.loads(p.read_text())["task_id"] for p in rollouts} <= rl_ids
    png = out / "cpt_scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # A second call finds every stage done and reports the same figures.
    again = run.main(["--out", str(out), "--smoke"])
    assert [a["cpt"]["heldout_nll"] for a in again["arms"]] == nll
    assert [a["rl"]["reward_curve"] for a in again["arms"]] == [a["rl"]["reward_curve"] for a in arms]
