"""Run a model over a task suite, several passes, and record every attempt.

For each task and pass (an *attempt*): `atelier.harness.episode.run_and_grade`
(a sandbox over the task's snapshot with its dependency venv mounted
read-only and first on PATH, the agent loop, the final diff graded in a
fresh sandbox: the same path as an RL rollout). The attempt becomes one
`EvalRecord` line in `results.jsonl` and one trajectory JSON file.

Resuming: attempts whose latest record is not an infrastructure error are
finished and skipped; the others run again. A run directory belongs to one
model: resuming it with another is refused.

Errors (`atelier.failures`, the same rule as RL): the one broad `except
Exception` is per attempt (mini-swe-agent's batch edge). An infrastructure
failure (a sandbox that died or could not start, a server that is down, a
grading timeout) is recorded with its error type, never scored, its
trajectory saved, and retried `infra_retries` times after a backoff
(`retry_backoff_s`, doubling). Anything else is a bug: its traceback goes
to OUT/failures.log, no record is written (so a rerun attempts it again),
and `run_eval` raises a `BugError` naming the task and pass once the
attempts already running have finished.

Concurrency: attempts run on a thread pool of `concurrency` workers. Models
are thread-safe by contract (`TokenModel.generate`); each attempt owns its
sandboxes; `ResultsWriter` serialises the appends. Ctrl-C cancels attempts
not yet started; finished ones are already on disk.
"""

from __future__ import annotations

import datetime as _dt
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Protocol, Sequence, Union, runtime_checkable

from pydantic import Field

from atelier.config import AtelierConfig
from atelier.errors import BugError
from atelier.eval.metrics import EvalMetrics, compute_metrics
from atelier.eval.prices import PriceTable, load_prices
from atelier.eval.records import (
    META_FILE,
    SUMMARY_FILE,
    EvalError,
    EvalRecord,
    ResultsWriter,
    read_json,
    read_records,
    trajectory_path,
    write_json,
)
from atelier.eval.tasks import load_tasks
from atelier.failures import FailureLog, backoff_s, is_infra
from atelier.fsio import crash_point
from atelier.harness.config import AgentConfig
from atelier.harness.episode import run_and_grade
from atelier.harness.trajectory import Trajectory, changed_lines
from atelier.inference.types import ChatModel, TokenModel
from atelier.tasks.envs import ensure_env
from atelier.tasks.schema import Task

Progress = Callable[[int, int, EvalRecord], None]
"""Called after each attempt with (attempts done now, attempts to run now, record)."""


class EvalConfig(AtelierConfig):
    passes: int = Field(1, ge=1)
    """How many times each task is attempted (K of pass@k and best-of-K)."""
    concurrency: int = Field(1, ge=1)
    """Attempts running at once."""
    backend: Literal["bwrap", "local"] = "bwrap"
    """Sandbox backend; `local` isolates nothing."""
    threshold: float = 1.0
    """A reward at or above this is a success (pass@k)."""
    infra_retries: int = Field(1, ge=0)
    """Retries of an attempt that hit an infrastructure error."""
    retry_backoff_s: float = Field(1.0, ge=0)
    """Delay before the first such retry; it doubles with each retry (at most 60 s)."""
    env_cache: str | None = None
    """Where task venvs are built (default `$ATELIER_CACHE/envs`)."""


class EvalRecipe(EvalConfig):
    """What `atelier eval RECIPE` reads (every key `--set` can override): the evaluation's
    options and, under `agent`, the agent's."""

    agent: AgentConfig = Field(default_factory=AgentConfig)
    """The agent of every attempt."""


@dataclass
class EvalSummary:
    run_dir: Path
    metrics: EvalMetrics
    ran: int
    """Attempts run by this call."""
    skipped: int
    """Attempts already finished in the run directory."""


@runtime_checkable
class PerTaskModel(Protocol):
    """A policy that needs the task to act (a gold replay): a fresh model per attempt."""

    name: str

    def for_task(self, task: Task) -> TokenModel | ChatModel: ...


Policy = Union[TokenModel, ChatModel, PerTaskModel]


def model_name(model: Policy) -> str:
    return str(model.name or type(model).__name__)


def resolve_model(model: Policy, task: Task) -> TokenModel | ChatModel:
    """The model that acts on `task`: `for_task(task)` of a `PerTaskModel`, else `model` itself."""
    return model.for_task(task) if isinstance(model, PerTaskModel) else model


def run_eval(model: Policy, tasks: Sequence[Task] | str | Path, out_dir: str | Path, passes: int = 1,
             concurrency: int = 1, agent_config: AgentConfig | None = None, *, config: EvalConfig | None = None,
             prices: PriceTable | str | Path | None = None, split: str | None = None,
             progress: Progress | None = None) -> EvalSummary:
    """Evaluate `model` (a TokenModel, a ChatModel, or a PerTaskModel) on `tasks` (loaded tasks, or a
    task/suite directory), writing into `out_dir`. `config` wins over `passes` and `concurrency`."""
    config = config or EvalConfig(passes=passes, concurrency=concurrency)
    task_list = load_tasks(tasks, split) if isinstance(tasks, (str, Path)) else list(tasks)
    if not task_list:
        raise EvalError("no tasks to evaluate", hint="pass a task directory or a suite of them")
    table = prices if isinstance(prices, PriceTable) else load_prices(prices)
    agent_config = agent_config or AgentConfig()
    run_dir = Path(out_dir)
    name = model_name(model)
    _prepare_run_dir(run_dir, name, task_list, config, agent_config, tasks)
    crash_point("eval.after_meta")

    done = {r.key for r in read_records(run_dir) if not r.infra_error}
    todo = [(task, i) for i in range(config.passes) for task in task_list if (task.id, i) not in done]
    _build_envs(list({task.id: task for task, _ in todo}.values()), config)
    skipped = config.passes * len(task_list) - len(todo)
    writer = ResultsWriter(run_dir)

    def one(task: Task, index: int) -> EvalRecord:
        for attempt in range(config.infra_retries + 1):
            time.sleep(backoff_s(config.retry_backoff_s, attempt))
            record = run_attempt(model, task, index, run_dir, config, agent_config, table)
            crash_point("eval.after_trajectory")
            writer.append(record)  # the attempt's commit point
            crash_point("eval.after_record")
            if not record.infra_error:
                break
        return record

    pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="eval")
    try:
        futures = [pool.submit(one, task, i) for task, i in todo]
        for n, future in enumerate(as_completed(futures), 1):
            record = future.result()
            if progress is not None:
                progress(n, len(todo), record)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        crash_point("eval.before_summary")
        metrics = summarize(run_dir, threshold=config.threshold)  # K: the most passes the dir was run with
    return EvalSummary(run_dir=run_dir, metrics=metrics, ran=len(todo), skipped=skipped)


def _build_envs(tasks: list[Task], config: EvalConfig) -> None:
    """Build every dependency venv before the clock starts: a first build
    takes minutes and would count as one attempt's latency. A venv that
    cannot be built is the user's problem to fix (a `TaskError`), not an
    infrastructure error of each attempt."""
    for task in tasks:
        ensure_env(task, config.env_cache)


def summarize(run_dir: str | Path, *, passes: int | None = None, threshold: float = 1.0) -> EvalMetrics:
    """Metrics over the run directory's records, also written to summary.json."""
    run_dir = Path(run_dir)
    meta = read_json(run_dir / META_FILE) or {}
    metrics = compute_metrics(read_records(run_dir), passes=passes or meta.get("passes"),
                              threshold=threshold, model=meta.get("model", ""))
    metrics.infra_error_attempts = sum(r.infra_error for r in read_records(run_dir, latest=False))
    write_json(run_dir / SUMMARY_FILE, metrics.to_dict())
    return metrics


def _prepare_run_dir(run_dir: Path, name: str, tasks: list[Task], config: EvalConfig,
                     agent_config: AgentConfig, source: Any) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise EvalError(f"--run-dir {run_dir} is a file, not a run directory",
                        hint="pass a new or existing run directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = read_json(run_dir / META_FILE)
    if meta is not None and meta.get("model") != name:
        raise EvalError(f"run directory {run_dir} holds an evaluation of model {meta.get('model')!r}, "
                        f"not {name!r}", hint="use a new --run-dir for each model")
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    ids = list(dict.fromkeys([*(meta or {}).get("tasks", []), *(t.id for t in tasks)]))
    write_json(run_dir / META_FILE, {
        "model": name, "tasks": ids,
        "tasks_source": str(source) if isinstance(source, (str, Path)) else None,
        "passes": max(config.passes, (meta or {}).get("passes", 0)),
        "eval_config": config.model_dump(mode="json"),
        "agent_config": agent_config.model_dump(mode="json"),
        "started": (meta or {}).get("started", now), "updated": now,
    })


def run_attempt(model: Policy, task: Task, index: int, run_dir: Path, config: EvalConfig,
                agent_config: AgentConfig, prices: PriceTable) -> EvalRecord:
    """One task, one pass: `run_and_grade`, then the record. Raises `BugError` for a bug only."""
    name = model_name(model)
    record = EvalRecord(task_id=task.id, pass_index=index, model=name,
                        trajectory=trajectory_path(task.id, index))
    traj: Trajectory | None = None
    start = time.monotonic()
    try:
        episode = run_and_grade(task, resolve_model(model, task), config_for_pass(agent_config, index),
                                backend=config.backend, env_cache=config.env_cache)
        traj, result = episode.trajectory, episode.grade
        record.episode_s, record.grade_s = episode.episode_s, episode.grade_s
        record.reward_parts = dict(traj.reward_parts)
        if episode.infra_error is not None:
            record.infra_error, record.error_type = True, episode.error_type
            record.error = result.error if result is not None else traj.error
        else:
            record.reward = result.reward
            record.success = result.reward >= config.threshold
            record.grade_error = result.error
    except Exception as exc:  # the batch edge: sorted by atelier.failures
        if not is_infra(exc):
            raise _attempt_bug(exc, task, index, run_dir) from None
        record.infra_error, record.error_type = True, type(exc).__name__
        record.error = str(exc)[-4000:]
        record.reward, record.success = None, False
    record.wall_s = time.monotonic() - start
    if traj is None:
        traj = Trajectory(task_id=task.id, model=name, exit_reason="error",
                          error=f"{record.error_type}: {record.error}")
    _fill_from_trajectory(record, traj, prices)
    traj.save(run_dir / record.trajectory)
    return record


def _attempt_bug(exc: BaseException, task: Task, index: int, run_dir: Path) -> BugError:
    """Log the traceback of a bug in one attempt; the error that stops the evaluation."""
    log = FailureLog(run_dir / "failures.log")
    log.record("bug", f"{task.id} pass {index}", exc)
    return BugError(f"attempt {task.id} pass {index} failed with a bug, not an infrastructure failure: "
                    f"{type(exc).__name__}: {str(exc)[:300]}",
                    hint=f"the traceback is in {log.path}; fix the bug and run the same command again: "
                         "finished attempts are kept and this one runs again")


def config_for_pass(agent_config: AgentConfig, index: int) -> AgentConfig:
    """Pass i samples with seed + i·PASS_SEED_STRIDE when a seed is set: with
    one seed for every pass, all K attempts would be the same sample and
    pass@k would equal pass@1."""
    sampling = agent_config.sampling
    if sampling.seed is None or index == 0:
        return agent_config
    seed = sampling.seed + index * PASS_SEED_STRIDE
    return agent_config.model_copy(update={"sampling": sampling.model_copy(update={"seed": seed})})


PASS_SEED_STRIDE = 100_003
"""Larger than any turn count, so turn seeds (seed + t) of passes never meet."""


def billed_tokens(traj: Trajectory) -> tuple[int, int]:
    """(tokens in, tokens out) as an API without prompt caching bills them.

    In: the whole context of every model call. A token model's segments
    show it exactly (each run of sampled tokens was generated after the
    tokens before it); a chat model's `prompt` count is the server's usage,
    already per call. Out: every sampled token (`completion`)."""
    tokens_out = int(traj.tokens.get("completion", 0))
    if any(seg.loss_mask for seg in traj.segments):
        tokens_in = 0
        for seg in traj.segments:
            prev = 0
            for i, mask in enumerate(seg.loss_mask):
                if mask and not prev:
                    tokens_in += i
                prev = mask
        return tokens_in, tokens_out
    return int(traj.tokens.get("prompt", 0)), tokens_out


def _fill_from_trajectory(record: EvalRecord, traj: Trajectory, prices: PriceTable) -> None:
    record.exit_reason = record.exit_reason or traj.exit_reason
    record.tokens = dict(traj.tokens)
    record.tokens_in, record.tokens_out = billed_tokens(traj)
    record.turns, record.tool_calls, record.broken_calls = traj.turns, traj.num_tool_calls, traj.broken_calls
    record.cost = prices.cost(record.model, record.tokens_in, record.tokens_out)
    record.diff_lines = changed_lines(traj.final_diff)
