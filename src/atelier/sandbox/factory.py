"""`create_sandbox(snapshot, config)`: a `Sandbox` of the configured backend, `bwrap`
(namespaces; see `atelier.sandbox.bwrap` for exactly what is and is not isolated) or `local`
(a plain subprocess that isolates nothing)."""

from __future__ import annotations

import os

from atelier.sandbox.base import Sandbox, SandboxConfig
from atelier.sandbox.bwrap import BwrapSandbox
from atelier.sandbox.local import LocalSandbox


def create_sandbox(snapshot: str | os.PathLike, config: SandboxConfig | None = None) -> Sandbox:
    config = config or SandboxConfig()
    if config.backend == "local":
        return LocalSandbox(snapshot, config)
    return BwrapSandbox(snapshot, config)
