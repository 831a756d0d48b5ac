"""One RL step on two real coding tasks: the real harness, sandboxes, grader and trainer."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from atelier.config import load_config
from atelier.rl.config import TrainConfig
from atelier.rl.ledger import Ledger
from atelier.rl.run import run_training
from atelier.tasks.schema import PythonEnv, TaskLimits, TaskMetadata, TaskSpec
from atelier.tasks.writer import write_task

OPS = ("def add(a, b):\n    return a - b\n\n\n"
       "def mul(a, b):\n    return a + b\n\n\n"
       "def sub(a, b):\n    return a - b\n")
TESTS = ("from calc import add, mul, sub\n\n\n"
         "def test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_mul():\n    assert mul(3, 4) == 12\n\n\n"
         "def test_sub():\n    assert sub(5, 3) == 2\n")


def _unified(path: str, old: str, new: str) -> str:
    return f"diff --git a/{path} b/{path}\n" + "".join(difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}"))


def _suite(root: Path) -> Path:
    """Two mutation-style tasks (a swapped operator each) in the standard task layout."""
    repo = root / "_repo"
    (repo / "calc").mkdir(parents=True)
    (repo / "calc" / "__init__.py").write_text("from calc.ops import add, mul, sub\n")
    (repo / "calc" / "ops.py").write_text(OPS)
    suite = root / "suite"
    fixes = {"calc-add": ("add", OPS.replace("return a - b", "return a + b", 1)),
             "calc-mul": ("mul", OPS.replace("return a + b", "return a * b", 1))}
    for task_id, (name, fixed) in fixes.items():
        spec = TaskSpec(
            id=task_id, prompt=f"{name}() gives wrong answers; fix it.",
            env=PythonEnv(python="3.11", system_site_packages=True),
            hidden_tests=["tests/test_calc.py"], fail_to_pass=[f"tests/test_calc.py::test_{name}"],
            pass_to_pass=["tests/test_calc.py::test_sub"],
            metadata=TaskMetadata(source="mutation", category="wrong-operator", files_changed=1, lines_changed=1),
            limits=TaskLimits(timeout_s=60))
        write_task(suite / task_id, spec, repo, {"tests/test_calc.py": TESTS}, _unified("calc/ops.py", OPS, fixed))
    return suite


@pytest.mark.slow   # venv build, sandboxes and two grades per task: over a minute on 2 busy cores
def test_one_step_on_real_tasks_through_harness_sandbox_and_grader(bwrap_ready, tiny_model_dir, tmp_path):
    suite = _suite(tmp_path)
    config = load_config(TrainConfig, None, [
        f"model={tiny_model_dir}", "env.kind=tasks", f"env.tasks.suite={suite}",
        f"env.tasks.env_cache={tmp_path / 'envs'}", "env.tasks.agent={max_turns = 2, max_context_tokens = 4096}",
        "trainer.steps=1", "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.workers=4",
        "rollout.max_tokens=24", "rollout.min_valid=1", "trainer.lr=1e-4",
        # a random model's members tie (zero advantage), and with kl_beta = 0 such samples are not run;
        # the KL term trains them, so the step always runs real rollouts through the trainer
        "trainer.kl_beta=0.01"])
    summary = run_training(config, tmp_path / "run")
    assert summary.steps == 1
    ledger = Ledger.load(tmp_path / "run" / "ledger.jsonl")
    assert {g.task_id for g in ledger.groups.values()} == {"calc-add", "calc-mul"}
    trained = [s for s in ledger.slots.values() if s.state == "trained"]
    assert trained and all(s.step == 1 and s.reward is not None for s in trained)
    assert summary.ledger["queued"] == summary.ledger["running"] == 0
    row = summary.metrics[0]
    assert "correctness" in row["reward_parts"] and "fail_to_pass" in row["reward_parts"]
    assert row["train_tokens"] > 0
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    assert (ckpt / "model" / "config.json").exists() and (ckpt / "optimizer.pt").exists()
    traj = next((tmp_path / "run" / "rollouts").glob("*.json")).read_text()
    assert '"limits"' in traj and '"max_turns": 2' in traj
