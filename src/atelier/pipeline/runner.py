"""`atelier run`'s stage runner: every stage of `atelier.pipeline.stages.STAGES`, in order,
each in a process of its own, resumable.

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
The run's configuration is frozen in `config.toml` at the first start
(`atelier.rundir`): a rerun with a different one is refused rather than
mixing two recipes in one directory. Each stage's outputs also hold the load
average at its start and end; once the report stage is done, the run's
record, `run.json` (`atelier.pipeline.record`), is written from them and the
summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from atelier.errors import BugError
from atelier.fsio import atomic_write
from atelier.pipeline.config import RunConfig
from atelier.pipeline.memory import TreeMemory
from atelier.pipeline.record import RECORD_FILE, load_average, write_record
from atelier.pipeline.stages import STAGES, PipelineError, Progress, Say, Stage, StageContext
from atelier.rundir import freeze_config


class StageLedger:
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


def run_pipeline(config: RunConfig, run_dir: str | Path, *, recipe_dir: str | Path = ".", say: Say = print,
                 progress: Progress | None = None, stages: Sequence[Stage] = STAGES,
                 recipe: str | None = None) -> dict[str, dict[str, Any]]:
    """Run every stage of `config` in `run_dir` in order, or continue the run there; return each
    stage's outputs. `recipe` (the path the user gave) goes into the run's record."""
    run_dir = Path(run_dir).resolve()
    recipe_dir = Path(recipe_dir).resolve()
    freeze_config(config, run_dir, command="atelier run")
    ledger = StageLedger(run_dir)
    context = StageContext(config, run_dir, recipe_dir, say, ledger, progress)
    ran = False   # whether this invocation ran a stage (else the record, if any, stays whose it is)
    with TreeMemory() as memory:
        context.memory = memory
        for stage in stages:
            if stage.name in ledger.done:
                say(f"[{stage.name}] done earlier: {_brief(ledger.done[stage.name])}")
                continue
            say(f"[{stage.name}] ...")
            ran = True
            memory.reset()
            load_start = load_average()
            ledger.begin(stage.name, time.time(), last_activity(run_dir, stage.name))
            try:
                if config.isolate_stages and not stage.in_process and stage.off(config) is None:
                    outputs = run_in_child(stage.name, run_dir, recipe_dir, say, progress)
                else:
                    outputs = context.run(stage)
            finally:
                memory.sample()
                wall, this, peaks = ledger.end(stage.name, time.time(), memory.peaks_mb())
            starts = ledger.time[stage.name]["starts"]
            outputs.update(wall_s=round(wall, 1), **peaks, starts=starts, load_start=load_start,
                           load_end=load_average())
            if starts > 1:
                outputs["wall_s_last_start"] = round(this, 1)
            ledger.finish(stage.name, outputs)
            say(f"[{stage.name}] {_brief(outputs)}")
    summary = run_dir / "summary.json"
    if "report" in ledger.done and summary.is_file() and (ran or not (run_dir / RECORD_FILE).is_file()):
        write_record(run_dir, ledger.done, json.loads(summary.read_text()), seed=config.seed, recipe=recipe)
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


def _brief(outputs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in outputs.items() if not isinstance(v, (dict, list)))
