"""Helpers that tests of several packages share (plain functions; fixtures stay in conftest.py).

Waits tell a hang from progress: their timeouts are generous bounds for a loaded
2-core machine, and no test asserts how long anything took.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).parents[1]


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, *, interval: float = 0.02,
               process: subprocess.Popen | None = None) -> bool:
    """Poll `predicate` until it is true (True) or `timeout` seconds pass (False). With `process`,
    fail at once, with what it printed, if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if process is not None and process.poll() is not None:
            out, err = process.communicate()
            raise AssertionError(f"the process exited with status {process.returncode} first:\n"
                                 f"{(err or out or '')[-3000:] if isinstance(err or out, str) else err or out}")
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def rank_env() -> dict[str, str]:
    """What a test's trainer ranks get on top of the test's environment: this checkout first on the
    path (tests import `tests.*`), one thread each."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}
