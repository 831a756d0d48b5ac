"""What every benchmark writes beside its figures: where, when, on what, at which load.

`machine()` names the CPU, its cores and bf16/AMX units, the accelerator if any, and the
versions that decide speed; `commit()` the code measured (with `+dirty` when the tree had
uncommitted changes); `save(name, report)` writes the report as
`benchmarks/results/<name>-<UTC time>-<commit>.json` and returns the path. A run's load is
part of its figures: `load()` is the one-minute load average, taken per measured row, and
`settle()` waits, before a row, until the rows measured before it have let go of the cores.
Every benchmark script starts its report with `stamp()` and ends with `finish(name, report,
save)`, which saves it (or, with the script's `--no-save`, only adds the load at the end);
`atelier results render` lists the saved files in `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def load() -> float:
    return round(os.getloadavg()[0], 2)


def busy_cores(seconds: float = 0.25) -> float:
    """Cores busy over the next `seconds`, every process counted (from /proc/stat; 0.0 where
    the kernel does not say)."""
    def sample() -> tuple[int, int]:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return 0, 0
        return sum(fields), fields[3] + fields[4]   # all ticks, idle + iowait ticks
    (total0, idle0), _ = sample(), time.sleep(seconds)
    total1, idle1 = sample()
    if total1 == total0:
        return 0.0
    return round((os.cpu_count() or 1) * (1 - (idle1 - idle0) / (total1 - total0)), 2)


def settle(below: float = 0.2, most_s: float = 10.0, busy=busy_cores) -> dict:
    """Wait until fewer than `below` cores are busy, at most `most_s` seconds. A peer can keep
    a core spinning after it answers (vLLM's CPU worker polls for its next step for about a
    second), which would otherwise be charged to whichever row runs next. Returns how long it
    waited and what was busy when it stopped waiting. `busy`: what measures the cores in use."""
    start = time.monotonic()
    used = busy()
    while used >= below and time.monotonic() - start < most_s:
        used = busy()
    return {"settle_s": round(time.monotonic() - start, 2), "busy_cores": used}


def commit() -> str:
    root = Path(__file__).parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> dict:
    """The run's host as `atelier run`'s records name it, with the accelerator if any."""
    import torch

    from atelier.pipeline.record import host

    info = {**host(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def stamp() -> dict:
    return {"commit": commit(), "machine": machine(), "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_at_start": load()}


def portable(text: str) -> str:
    """`text` with this checkout's root written `.` and the home directory `~`: a record names
    files the same on every machine, and names no one's directories."""
    root = str(Path(__file__).resolve().parent.parent)
    return text.replace(root, ".").replace(str(Path.home()), "~")


def save(name: str, report: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    report["load_at_end"] = load()
    when = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = RESULTS / f"{name}-{when}-{report.get('commit', commit()).replace('+', '-')}.json"
    path.write_text(portable(json.dumps(report, indent=1)) + "\n")
    return path


def finish(name: str, report: dict, save_it: bool = True) -> dict:
    """`report` closed: saved (its path under `saved_to`, relative to the repository), or with
    only `load_at_end` added when `save_it` is false; returned for printing."""
    if save_it:
        report["saved_to"] = str(save(name, report).relative_to(RESULTS.parent.parent))
    else:
        report["load_at_end"] = load()
    return report


def add_no_save(parser) -> None:
    parser.add_argument("--no-save", action="store_true", help="print the report without saving it under "
                        "benchmarks/results/")
