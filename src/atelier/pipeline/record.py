"""`run.json`: the record of one `atelier run`, written into its run directory when the run
finishes. It is the file the repository's `results/` keeps for an adopted run, and what
`atelier results render` turns into the README's and the docs' tables.

One JSON object (`SCHEMA`):

- where and what: `commit` (of the atelier checkout that ran, `+dirty` with uncommitted
  changes; None outside a git checkout), `host` (CPU model, cores, bf16 units, Python and torch
  versions), `recipe` (the path given to `atelier run`), `config_sha256` (of the frozen
  `config.toml`, so two records of the same recipe can be told apart from two recipes), `seed`,
  `finished_utc`;
- cost: per stage `wall_s` (all its starts), `starts`, `peak_pss_mb` and `peak_rss_mb` (MiB,
  see `atelier.pipeline.memory`) and the one-minute load average at its start and end
  (`load_start`, `load_end`: a loaded machine runs slower, so a time is read with its load);
  `wall_s_total` and the run's peaks;
- result: each evaluation's attempts and, per measure (`pass`, `edit`), its successes, rate, 95%
  Wilson interval and best-of-K; the pre-registered `headline` test; the other tests; RL's
  group counts. Every figure is copied from `summary.json`, which recomputes them from the
  evaluation records.

A record in `results/` may also carry `version` (the recipe version it belongs to: a name, the
commit that made it, the log entry that tells it) and, for runs from before records existed,
`reconstructed` (where the figures were taken from); `atelier results add` writes the first.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

from atelier.eval.compare import MEASURES
from atelier.eval.records import write_json
from atelier.pipeline.memory import PEAK_KEYS

SCHEMA = "atelier.run/1"
RECORD_FILE = "run.json"
STAGE_KEYS = ("wall_s", "starts", *PEAK_KEYS, "load_start", "load_end")
"""What the record keeps of each stage's outputs in `stages.json`."""
EVALUATION_KEYS = ("attempts", "valid_attempts", "tasks", "mean_reward", *MEASURES)


def load_average() -> float | None:
    """The one-minute load average, None where the system has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def code_commit(root: Path | None = None) -> str | None:
    """The commit of the atelier checkout at `root` (default: this file's), `+dirty` when tracked
    files changed; None when it is not a git checkout or git is missing."""
    root = root or Path(__file__).resolve().parents[3]   # src/atelier/pipeline/record.py
    if not (root / ".git").exists():   # an installed copy: no commit to name
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def host() -> dict[str, Any]:
    """The machine a run ran on, read without importing torch."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {"cpu": model, "cores": os.cpu_count(), "arch": platform.machine(),
            "bf16_units": sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile")),
            "python": platform.python_version(), "torch": torch_version}


def build_record(run_dir: Path, stages: Mapping[str, Mapping[str, Any]], summary: Mapping[str, Any], *,
                 seed: int, recipe: str | None = None) -> dict[str, Any]:
    """The record of the run in `run_dir` from its stages' outputs and its summary (see the module
    docstring); `commit` and `host` are this process's."""
    frozen = run_dir / "config.toml"
    rl = summary.get("rl") or {}
    return {
        "schema": SCHEMA,
        "recipe": recipe,
        "commit": code_commit(),
        "config_sha256": hashlib.sha256(frozen.read_bytes()).hexdigest() if frozen.is_file() else None,
        "seed": seed,
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": host(),
        "stages": {name: {k: out[k] for k in STAGE_KEYS if out.get(k) is not None} for name, out in stages.items()},
        "wall_s_total": round(sum(out.get("wall_s") or 0.0 for out in stages.values()), 1),
        **{key: summary.get(f"{key}_run") for key in PEAK_KEYS},
        "evaluations": {label: {k: figures.get(k) for k in EVALUATION_KEYS}
                        for label, figures in (summary.get("evaluations") or {}).items()},
        "headline": dict(summary.get("headline") or {}),
        "other_tests": dict(summary.get("other_tests") or {}),
        "rl": {k: rl.get(k) for k in ("groups", "tied_groups_skipped", "zero_variance_groups")},
    }


def write_record(run_dir: Path, stages: Mapping[str, Mapping[str, Any]], summary: Mapping[str, Any], *,
                 seed: int, recipe: str | None = None) -> Path:
    path = run_dir / RECORD_FILE
    write_json(path, build_record(run_dir, stages, summary, seed=seed, recipe=recipe))
    return path
