"""Isolated coding environments.

`create_sandbox(snapshot, config)` returns a `Sandbox` of the configured
backend: `bwrap` (namespaces; see `atelier.sandbox.bwrap` for exactly what is
and is not isolated) or `local` (a plain subprocess that isolates nothing).
"""

from __future__ import annotations

from atelier.sandbox.base import (
    WORKDIR,
    ExecResult,
    Sandbox,
    SandboxClosed,
    SandboxConfig,
    SandboxError,
    SandboxLimitExceeded,
    SandboxOutOfMemory,
    SandboxPathError,
    SandboxUnavailable,
    SnapshotMissing,
    SnapshotUnusable,
)
from atelier.sandbox.factory import create_sandbox
from atelier.sandbox.pool import PoolExhausted, SandboxPool

__all__ = [
    "WORKDIR", "ExecResult", "Sandbox", "SandboxClosed", "SandboxConfig", "SandboxError",
    "SandboxLimitExceeded", "SandboxOutOfMemory", "SandboxPathError", "SandboxUnavailable", "SnapshotMissing",
    "SnapshotUnusable",
    "create_sandbox", "SandboxPool", "PoolExhausted",
]
