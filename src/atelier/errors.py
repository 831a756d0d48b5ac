"""The root of atelier's typed errors.

Every error a user can cause (bad input, missing tool, bad config) is an
`AtelierError`: its message says what is wrong and `hint` says how to fix it.
The CLI prints both and exits with status 2, never a traceback.
"""

from __future__ import annotations


class ToldError(Exception):
    """A message for the user and a hint that says what to do, printed without a traceback."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class AtelierError(ToldError):
    """Bad input or a missing prerequisite: the CLI prints it and exits with status 2."""


class InfraError(Exception):
    """The infrastructure, not the policy or the code, failed: a sandbox died or
    could not start, the grader timed out, the engine or server is unreachable,
    memory ran out. Retried with backoff and never scored (`atelier.failures`)."""


class BugError(ToldError):
    """A failure that is neither the infrastructure's nor the model's stopped a
    run. `message` names where (the slot and task, or the attempt), `hint`
    where the traceback went and how to resume once it is fixed; the CLI
    prints both and exits with status 1, without a traceback."""
