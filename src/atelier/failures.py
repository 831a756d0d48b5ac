"""What failed: the infrastructure, the model or the code, told apart once.

Every batch edge (an RL rollout, an evaluation attempt) sorts a failure into
one of three classes, and each class has one rule:

- **infra** (`is_infra`): a sandbox died or could not start, the grader
  timed out, the engine or server is unreachable or closed, memory ran out
  where that is not the code under test's doing (see out of memory below).
  It says nothing about the policy: retried with backoff, never scored.
  Which exceptions are infra is decided here and nowhere else:
  `InfraError` and its subclasses (`EngineClosed`, `EngineBusy`,
  `ServerUnreachable`, vLLM's `EngineUnavailable` and `VLLMUnavailable`,
  what the Ray launcher makes of a dead actor), every
  `SandboxError` but a path error (the harness turns those into failed tool
  calls), `MemoryError`, `ConnectionError`, `TimeoutError`, an `OSError`
  out of disk or memory, and torch's out-of-memory error.
- **out of memory** is one of three, by whose doing it can be:
  - an agent's own command killed for passing the sandbox's memory limit:
    the episode's outcome, not a failure (the tool result says so and the
    episode goes on);
  - a graded test run killed so, where the task's gold patch runs under the
    same limit: the patch's failure, scored 0 and labelled (`GradeResult.
    oom_killed`, an error starting `OUT_OF_MEMORY`, counted per step as
    `out_of_memory`). Were it infra, a policy could dodge every negative
    reward by allocating until killed;
  - only where the limit cannot have been the patch's doing (the gold is
    killed under it too; the host's OOM killer, not the sandbox's limit,
    killed the run, `ExecResult.host_oom_killed`; the trainer or engine ran
    out): infra, `SandboxOutOfMemory`, `MemoryError`, torch's
    out-of-memory error.
  `atelier.tasks.grade` applies the rule.
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

__all__ = ["BugError", "FailureLog", "InfraError", "OUT_OF_MEMORY", "backoff_s", "classify", "describe",
           "is_infra", "is_out_of_memory"]

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


OUT_OF_MEMORY = "out of memory: "
"""How a grading error starts when the patch ran the tests out of memory."""


def is_out_of_memory(error: str | None) -> bool:
    """Whether a grading error says the patch's test run passed the memory
    limit (scored 0, not infra)."""
    return bool(error) and error.startswith(OUT_OF_MEMORY)


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
