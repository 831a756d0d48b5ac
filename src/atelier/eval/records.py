"""What one attempt (a task and a pass) leaves behind, and where a run keeps it.

A run directory::

    RUN_DIR/
      eval.json         what ran: model, tasks, passes, configs (checked on resume)
      results.jsonl     one `EvalRecord` per finished attempt, appended
      trajectories/     <task id>/pass-<i>.json, one `Trajectory` per attempt
      summary.json      the metrics of the latest run over results.jsonl

`results.jsonl` is append-only: a resumed run adds lines, never rewrites
them. A run killed mid-write leaves at most one partial last line, which
`read_records` skips. When one attempt has several records (an infrastructure
error, then a retry), the last one counts.

Crash consistency (the rule of `atelier.fsio`): an attempt's commit point is
its fsynced line in `results.jsonl`. What it owns, its trajectory, is written
(atomically) before that line; an attempt killed before its line is not
finished and runs again on resume, overwriting its trajectory. `eval.json`
is rewritten (atomically) at each start and `summary.json` is rebuilt from
the records at each end, so neither can disagree with the records for long.
The named crash points (`eval.after_meta`, `eval.after_trajectory`,
`eval.after_record`, `eval.before_summary`) are tested in turn.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from atelier.errors import AtelierError
from atelier.fsio import atomic_write

RESULTS_FILE = "results.jsonl"
META_FILE = "eval.json"
SUMMARY_FILE = "summary.json"
TRAJ_DIR = "trajectories"


class EvalError(AtelierError):
    """An evaluation or report that cannot run as asked (bad run dir, model, tasks)."""


@dataclass
class EvalRecord:
    """One attempt at one task. `reward` is None when no grade was obtained."""

    task_id: str
    pass_index: int
    model: str = ""
    reward: float | None = None
    reward_parts: dict[str, float] = field(default_factory=dict)
    success: bool = False
    infra_error: bool = False
    """The attempt failed for reasons not the model's (an exception in the
    sandbox, harness or grader; a test run that timed out): excluded from
    accuracy and retried on resume."""
    error_type: str | None = None
    error: str | None = None
    grade_error: str | None = None
    """Why the grader gave 0 without trusting the tests (e.g. the patch does
    not apply); a failure of the model's patch, not of the infrastructure."""
    exit_reason: str = ""
    tokens: dict[str, int] = field(default_factory=dict)
    tokens_in: int = 0
    tokens_out: int = 0
    turns: int = 0
    tool_calls: int = 0
    broken_calls: int = 0
    episode_s: float = 0.0
    grade_s: float = 0.0
    wall_s: float = 0.0
    cost: float | None = None
    """Dollars at the price table's rates; None when the model has no price."""
    diff_lines: int = 0
    trajectory: str | None = None
    """Path of the saved trajectory, relative to the run directory."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_id, self.pass_index)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EvalRecord":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def trajectory_path(task_id: str, pass_index: int) -> str:
    return f"{TRAJ_DIR}/{task_id}/pass-{pass_index}.json"


class ResultsWriter:
    """Appends records to `results.jsonl` from many threads.

    Ordering: each `append` writes one whole line under a lock and fsyncs it
    before returning, so a record is on disk once the attempt counts as
    finished, and lines never interleave.
    A partial last line left by a killed run is ended first, so it stays one
    unreadable line instead of swallowing the next record.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / RESULTS_FILE
        self._lock = threading.Lock()

    def append(self, record: EvalRecord) -> None:
        line = json.dumps(record.to_dict(), sort_keys=True).encode("utf-8") + b"\n"
        with self._lock, open(self.path, "ab+") as fh:
            if fh.tell() > 0:  # a line cut short by a kill: end it, or ours would join it
                fh.seek(-1, 2)
                if fh.read(1) != b"\n":
                    line = b"\n" + line
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())


def read_records(run_dir: str | Path, *, latest: bool = True) -> list[EvalRecord]:
    """The records of a run; with `latest`, one per attempt (the last written)."""
    path = Path(run_dir) / RESULTS_FILE
    if not path.is_file():
        return []
    out: list[EvalRecord] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(EvalRecord.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue  # a line cut short by a killed run
    if not latest:
        return out
    by_key: dict[tuple[str, int], EvalRecord] = {}
    for rec in out:
        by_key.pop(rec.key, None)  # keep first-seen order of the final versions
        by_key[rec.key] = rec
    return sorted(by_key.values(), key=lambda r: (r.task_id, r.pass_index))


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Through a temporary file and a rename: never half a file."""
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
