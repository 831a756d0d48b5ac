"""`sft.tasks`: the train split divided between the tasks whose gold replays SFT
trains on and the tasks RL trains on, on a suite of small tasks written here
(no sandbox, no model: only how tasks are chosen)."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from atelier.pipeline.config import RunConfig
from atelier.pipeline.runner import StageLedger
from atelier.pipeline.stages import PipelineError, StageContext, choose_held_out, split_tasks, write_splits
from atelier.tasks.schema import PythonEnv, TaskError, TaskLimits, TaskMetadata, TaskSpec
from atelier.tasks.split import hold_apart, task_files
from atelier.tasks.writer import write_task

# task id -> the source file its gold patch changes; "t1" is held out.
FILES = {"a1": "pkg/a.py", "a2": "pkg/a.py", "b1": "pkg/b.py", "c1": "pkg/c.py",
         "d1": "pkg/d.py", "d2": "pkg/d.py", "e1": "pkg/e.py", "t1": "pkg/t.py"}


def _suite(root: Path) -> Path:
    repo = root / "_repo"
    (repo / "pkg").mkdir(parents=True)
    for rel in set(FILES.values()):
        (repo / rel).write_text("X = 1\n")
    suite = root / "suite"
    for task_id, rel in FILES.items():
        diff = f"diff --git a/{rel} b/{rel}\n" + "".join(difflib.unified_diff(
            ["X = 1\n"], ["X = 2\n"], f"a/{rel}", f"b/{rel}"))
        spec = TaskSpec(id=task_id, prompt="X is wrong.", env=PythonEnv(python="3.11", system_site_packages=True),
                        hidden_tests=["tests/test_x.py"], fail_to_pass=["tests/test_x.py::test_x"],
                        metadata=TaskMetadata(source="test", category="constant", files_changed=1, lines_changed=1),
                        limits=TaskLimits(timeout_s=60))
        write_task(suite / task_id, spec, repo, {"tests/test_x.py": "def test_x():\n    pass\n"}, diff)
    write_splits(suite, {t: "test" if t == "t1" else "train" for t in FILES})
    return suite


def _context(run_dir: Path, suite: Path, rl_only: tuple[str, ...] = (), **sft) -> StageContext:
    config = RunConfig.model_validate({
        "tasks": {"package": "pkg", "path": "repo", "count": 8, "test_count": 1},
        "headline": {"min_attempts": 1}, "sft": sft})
    ledger = StageLedger(run_dir)
    ledger.done["tasks"] = {"dir": str(suite), **({"rl_only": list(rl_only)} if rl_only else {})}
    return StageContext(config, run_dir, run_dir, print, ledger)


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    return _suite(tmp_path)


def test_a_split_by_file_that_holds_out_too_few_attempts_stops_the_run() -> None:
    """Files come in pairs of tasks, so asking for 3 held-out tasks gets 2: 8 attempts at 4 passes,
    below the 12 the recipe's headline needs. The run stops at its tasks stage, saying what to raise."""
    files = {f"{name}{i}": {f"pkg/{name}.py"} for name in "abc" for i in (1, 2)}

    def config(min_attempts: int) -> RunConfig:
        return RunConfig.model_validate({"tasks": {"package": "pkg", "path": "repo", "count": 6, "test_count": 3},
                                         "eval": {"passes": 4}, "headline": {"min_attempts": min_attempts}})

    with pytest.raises(PipelineError, match=r"held out 2 of the 3 tasks.*8 held-out attempts") as info:
        choose_held_out(files, config(12))
    assert "tasks.test_count" in info.value.hint
    assert len(choose_held_out(files, config(8))) == 2


def test_sft_and_rl_divide_the_train_split_by_file(tmp_path: Path, suite: Path) -> None:
    context = _context(tmp_path, suite, tasks=3)
    sft = {t.id for t in context.train_tasks("sft")}
    rl = {t.id for t in context.train_tasks("rl")}
    train = set(FILES) - {"t1"}
    assert sft and rl and not sft & rl and sft | rl == train and len(sft) <= 3
    files = {t.id: task_files(t) for t in context.train_tasks("sft") + context.train_tasks("rl")}
    assert not set().union(*(files[t] for t in sft)) & set().union(*(files[t] for t in rl))
    # Deterministic: a new context (a resumed run, the rl stage's own process) chooses the same.
    again = _context(tmp_path, suite, tasks=3)
    assert {t.id for t in again.train_tasks("sft")} == sft and {t.id for t in again.train_tasks("rl")} == rl


@pytest.mark.parametrize("split", ["file", "random"])
def test_tasks_built_for_rl_alone_leave_the_held_out_split_as_it_was(split: str) -> None:
    """`tasks.rl_extra`: the first `count` tasks in build order are split as if nothing more were
    built; of the rest, a split by file leaves out the one sharing the held-out task's file."""
    first = ["a1", "b1", "c1", "d1"]
    extra = ["a2", "b2", "c2", "d2", "x1"]
    files = {t: {f"pkg/{t[0]}.py"} for t in first + extra}

    def config(rl_extra: int) -> RunConfig:
        return RunConfig.model_validate({"tasks": {"package": "pkg", "path": "repo", "count": 4, "test_count": 1,
                                                   "rl_extra": rl_extra, "split": split, "seed": 3},
                                         "headline": {"min_attempts": 1}})

    alone, none = split_tasks(first, files, config(0))
    test, rl_only = split_tasks(first + extra, files, config(5))
    assert test == alone and len(test) == 1 and none == []
    if split == "file":
        (held,) = test
        assert rl_only == [t for t in extra if t[0] != held[0]] and len(rl_only) == 4
    else:
        assert rl_only == extra


def test_tasks_for_rl_alone_join_rl_and_leave_sfts_division_as_it_was(tmp_path: Path, suite: Path) -> None:
    """"e1" built for RL alone: SFT's side and RL's own side are those of a run without it."""
    rest = set(FILES) - {"t1", "e1"}
    for sft in ({"tasks": 3}, {}):
        context = _context(tmp_path, suite, ("e1",), **sft)
        sft_side = {t.id for t in context.train_tasks("sft")}
        rl_side = {t.id for t in context.train_tasks("rl")}
        assert "e1" not in sft_side and "e1" in rl_side and sft_side <= rest
        if sft:
            assert sft_side == hold_apart({t: {FILES[t]} for t in rest}, 3, 0, "file")
            assert rl_side == rest - sft_side | {"e1"} and set(context.rl_env().tasks.tasks) == rl_side
        else:
            assert sft_side == rest and rl_side == rest | {"e1"}


def test_without_sft_tasks_both_stages_take_the_whole_train_split(tmp_path: Path, suite: Path) -> None:
    context = _context(tmp_path, suite)
    train = set(FILES) - {"t1"}
    assert {t.id for t in context.train_tasks("sft")} == {t.id for t in context.train_tasks("rl")} == train
    assert context.rl_env().tasks.tasks is None and context.rl_env().tasks.split == "train"


def test_rl_samples_only_the_tasks_sft_did_not_replay(tmp_path: Path, suite: Path) -> None:
    from atelier.rl.config import RolloutConfig
    from atelier.rl.shaping import ShapingConfig
    from atelier.rl.task_env import TaskEnvironment

    context = _context(tmp_path, suite, tasks=3)
    rl = {t.id for t in context.train_tasks("rl")}
    env = context.rl_env()
    assert set(env.tasks.tasks) == rl
    # What RL samples from: the environment's tasks (atelier.rl.run hands env.tasks() to the reconciler).
    sampled = TaskEnvironment(env.tasks, RolloutConfig(), ShapingConfig()).tasks()
    assert {t.id for t in sampled} == rl


def test_an_unknown_task_id_is_an_error(suite: Path) -> None:
    from atelier.rl.config import RolloutConfig, TasksEnvConfig
    from atelier.rl.shaping import ShapingConfig
    from atelier.rl.task_env import TaskEnvironment

    with pytest.raises(TaskError, match="t1"):   # held out, so not in the train split
        TaskEnvironment(TasksEnvConfig(suite=str(suite), split="train", tasks=["a1", "t1"]),
                        RolloutConfig(), ShapingConfig())


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_evaluations_open_the_engine_batch_invariant_when_asked(tmp_path: Path, tiny_model_dir,
                                                               batch_invariant: bool) -> None:
    config = RunConfig.model_validate({
        "tasks": {"package": "pkg", "path": "repo", "count": 8, "test_count": 1},
        "headline": {"min_attempts": 1}, "eval": {"batch_invariant": batch_invariant}})
    context = StageContext(config, tmp_path, tmp_path, print, StageLedger(tmp_path))
    with context.open_eval_model(str(tiny_model_dir)) as engine:
        assert engine.batch_invariant is batch_invariant


def test_batch_invariant_evaluation_is_a_built_in_engine_switch() -> None:
    with pytest.raises(ValueError, match="eval.batch_invariant"):
        RunConfig.model_validate({"tasks": {"package": "pkg", "path": "repo", "count": 8, "test_count": 1},
                                  "headline": {"min_attempts": 1}, "eval": {"batch_invariant": True},
                                  "inference": {"engine": "vllm"}})
