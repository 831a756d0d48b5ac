"""Isolated coding environments.

`create_sandbox(snapshot, config)` returns a `Sandbox` of the configured
backend: `bwrap` (namespaces; see `atelier.sandbox.bwrap` for exactly what is
and is not isolated) or `local` (a plain subprocess that isolates nothing).
"""

from __future__ import annotations

import os

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

__all__ = [
    "WORKDIR", "ExecResult", "Sandbox", "SandboxClosed", "SandboxConfig", "SandboxError",
    "SandboxLimitExceeded", "SandboxOutOfMemory", "SandboxPathError", "SandboxUnavailable", "SnapshotMissing",
    "SnapshotUnusable",
    "create_sandbox", "SandboxPool", "PoolExhausted",
]


def __getattr__(name: str):
    # Pools are imported on first use: most callers only need create_sandbox.
    if name in ("SandboxPool", "PoolExhausted"):
        from atelier.sandbox import pool

        return getattr(pool, name)
    raise AttributeError(f"module 'atelier.sandbox' has no attribute {name!r}")


def create_sandbox(snapshot: str | os.PathLike, config: SandboxConfig | None = None) -> Sandbox:
    config = config or SandboxConfig()
    if config.backend == "local":
        from atelier.sandbox.local import LocalSandbox

        return LocalSandbox(snapshot, config)
    from atelier.sandbox.bwrap import BwrapSandbox

    return BwrapSandbox(snapshot, config)
