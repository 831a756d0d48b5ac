"""What failed: the infrastructure, the model or the code, told apart once.

Every batch edge (an RL rollout, an evaluation attempt) sorts a failure into
one of three classes, and each class has one rule:

- **infra** (`is_infra`): a sandbox died or could not start, the grader
  timed out, the engine or server is unreachable or closed, memory ran out.
  It says nothing about the policy: retried with backoff, never scored.
  Which exceptions are infra is decided here and nowhere else:
  `InfraError` and its subclasses (`EngineClosed`, `EngineBusy`,
  `ServerUnreachable`, vLLM's `EngineUnavailable` and `VLLMUnavailable`,
  what the Ray launcher makes of a dead actor), every
  `SandboxError` but a path error (the harness turns those into failed tool
  calls), `MemoryError`, `ConnectionError`, `TimeoutError`, an `OSError`
  out of disk or memory, and torch's out-of-memory error.
- **malformed**: a model output the harness cannot read (`FormatError`) is
  not an exception at the batch edge at all: the model sees why, the call
  counts as broken, and the episode is scored like any other (a negative
  sample). Counted per step as rollouts with a broken call.
- **bug**: anything else (a plain exception in an environment, the harness,
  the grader's code). Retrying a bug would only throw samples away, so it
  stops the run at once: the traceback goes to the run's `failures.log`, the
  console gets a `BugError` naming the slot and the task (exit status 1),
  and the slot is queued again, so the run resumes with nothing lost once
  the bug is fixed.

`FailureLog` is that log: one line per infra failure, the whole traceback
per bug. `backoff_s` is the retry delay of both RL and evaluation.
"""

from __future__ import annotations

import errno
import sys
import threading
import time
import traceback
from pathlib import Path

from atelier.errors import BugError, InfraError

__all__ = ["BugError", "FailureLog", "InfraError", "backoff_s", "classify", "describe", "is_infra"]

_OS_INFRA = {errno.ENOSPC, errno.ENOMEM, errno.EDQUOT}


def is_infra(exc: BaseException) -> bool:
    """Whether `exc` is the infrastructure's failure (see the module docstring)."""
    if isinstance(exc, (InfraError, MemoryError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _OS_INFRA:
        return True
    # Modules not imported yet cannot have raised: look them up instead of importing them.
    sandbox = sys.modules.get("atelier.sandbox.base")
    if sandbox is not None and isinstance(exc, sandbox.SandboxError):
        return not isinstance(exc, sandbox.SandboxPathError)
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(exc, oom)


def classify(exc: BaseException) -> str:
    """"infra" or "bug" (a malformed output never reaches a batch edge as an exception)."""
    return "infra" if is_infra(exc) else "bug"


def describe(exc: BaseException) -> str:
    """`Type: message at file:line` (the innermost frame), short enough for a ledger line."""
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" at {where[0].filename.rsplit('/', 1)[-1]}:{where[0].lineno}" if where else ""
    return f"{type(exc).__name__}: {str(exc)[:300]}{at}"


def backoff_s(base: float, attempt: int, cap: float = 60.0) -> float:
    """Delay before retry `attempt` (1, 2, ...): base, 2·base, 4·base ..., at most `cap`."""
    if base <= 0 or attempt <= 0:
        return 0.0
    return min(cap, base * 2 ** (attempt - 1))


def full_traceback(exc: BaseException) -> str:
    """The local traceback, plus the remote one a Ray worker sent (`remote_traceback`)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    remote = getattr(exc, "remote_traceback", None)
    return text + (f"raised remotely:\n{remote}\n" if remote else "")


class FailureLog:
    """`failures.log` of a run: appended, never rewritten; thread-safe."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def record(self, kind: str, where: str, exc: BaseException) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        text = f"{stamp} {kind} {where}: {describe(exc)}\n"
        if kind == "bug":
            text += full_traceback(exc) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(text)
