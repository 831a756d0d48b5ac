"""The `local` backend: a plain subprocess in a copy of the snapshot.

It ISOLATES NOTHING. Commands run as you, with your network, and can read and
write anything you can. It exists for machines without user namespaces (some
CI runners, macOS) and for debugging; it is used only when asked for
(`backend="local"`) and warns every time a sandbox is created.

What it does give: the snapshot is copied (so it is never modified; cost grows
with the repository's size), a scrubbed environment, per-process resource
limits (prlimit where available), a per-exec timeout on the process group,
capped output, and `close()` kills the process groups it started (a daemon that
called `setsid` escapes).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from atelier.sandbox import diff as diffs
from atelier.sandbox import fsutil
from atelier.sandbox.base import (
    Command,
    ExecResult,
    MiB,
    OutputCallback,
    Sandbox,
    SandboxClosed,
    SandboxConfig,
    SandboxPathError,
    SnapshotMissing,
    command_argv,
    workspace_relpath,
)
from atelier.sandbox.hostfs import SANDBOX_PATH, runtime_dir
from atelier.sandbox.process import run_process
from atelier.sandbox.snapshot import check_snapshot, copied_from, copy_failure

log = logging.getLogger(__name__)


class LocalSandbox(Sandbox):
    def __init__(self, snapshot: str | os.PathLike, config: SandboxConfig | None = None,
                 *, _copy_from: Path | None = None) -> None:
        self.config = config or SandboxConfig(backend="local")
        self.snapshot = Path(snapshot).resolve()
        if not self.snapshot.is_dir():
            raise SnapshotMissing(f"snapshot directory {str(snapshot)!r} does not exist",
                                  hint="pass the path of a repository checkout")
        check_snapshot(self.snapshot)
        log.warning("local sandbox backend: commands run UNISOLATED on this machine, as this user")
        self._root = Path(tempfile.mkdtemp(prefix="local-", dir=runtime_dir()))
        self.workspace = self._root / "workspace"
        source = _copy_from or self.snapshot
        # cp -a, as the bwrap backend's copy: sockets and FIFOs are made anew (never opened), the
        # depth of a tree is no limit, and what cannot be copied is named.
        copied = subprocess.run(["cp", "-a", "--no-preserve=ownership", "--", f"{source}/.", str(self.workspace)],
                                capture_output=True, text=True)
        if copied.returncode != 0:
            fsutil.remove_tree(self._root)
            raise copy_failure(self.snapshot, copied.stderr, self.config.disk_mb,
                               copied_from(str(source), str(self.workspace)))
        (self._root / "tmp").mkdir()
        self._ws_fd = os.open(self.workspace, os.O_RDONLY | os.O_DIRECTORY)
        self._groups: list[int] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed("the sandbox is closed", hint="create a new sandbox")

    def exec(self, cmd: Command, timeout: float | None = None, *, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: bytes | None = None,
             on_output: OutputCallback | None = None) -> ExecResult:
        self._check_open()
        cfg = self.config
        argv = command_argv(cmd)
        if shutil.which("prlimit"):
            argv = ["prlimit", f"--as={cfg.memory_mb * MiB}", f"--fsize={cfg.max_file_mb * MiB}",
                    f"--nofile={cfg.max_open_files}", f"--cpu={cfg.cpu_time_s}", "--", *argv]
        workdir = self.workspace / workspace_relpath(cwd or "")
        tmp = str(self._root / "tmp")
        run_env = {"PATH": os.environ.get("PATH", SANDBOX_PATH), "HOME": tmp, "TMPDIR": tmp,
                   "LANG": "C.UTF-8", "TERM": "dumb", **cfg.env, **(env or {})}
        return run_process(argv, env=run_env, cwd=str(workdir), timeout=timeout or cfg.timeout_s,
                           output_limit=cfg.output_limit_bytes, stdin=stdin, on_output=on_output,
                           on_start=self._groups.append)

    def read_bytes(self, path: str) -> bytes:
        self._check_open()
        rel = workspace_relpath(path)
        try:
            return fsutil.read_beneath(self._ws_fd, rel)
        except OSError as exc:
            raise SandboxPathError(f"cannot read {rel!r}: {exc.strerror}") from None

    def write_bytes(self, path: str, data: bytes) -> None:
        self._check_open()
        rel = workspace_relpath(path)
        try:
            fsutil.write_beneath(self._ws_fd, rel, data)
        except OSError as exc:
            raise SandboxPathError(f"cannot write {rel!r}: {exc.strerror}") from None

    def diff(self) -> str:
        self._check_open()
        snap_fd = os.open(self.snapshot, os.O_RDONLY | os.O_DIRECTORY)
        try:
            paths = diffs.all_files(snap_fd) | diffs.all_files(self._ws_fd)
            return diffs.unified_diff(paths, old=lambda p: fsutil.entry_beneath(snap_fd, p),
                                      new=lambda p: fsutil.entry_beneath(self._ws_fd, p))
        finally:
            os.close(snap_fd)

    def fork(self) -> "LocalSandbox":
        self._check_open()
        return LocalSandbox(self.snapshot, self.config, _copy_from=self.workspace)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pgid in self._groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        os.close(self._ws_fd)
        fsutil.remove_tree(self._root)
