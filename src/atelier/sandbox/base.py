"""The `Sandbox` contract, its configuration, results and typed errors.

Every backend (bubblewrap, local subprocess, a Ray-placed remote) gives the same
five operations: `exec`, `read_file`/`write_file`, `diff`, `fork`, `close`.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Callable, Literal, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from atelier.errors import AtelierError

Command = Union[str, Sequence[str]]
"""A shell command line (run by ``/bin/sh -c``) or an argv list (run as is)."""

OutputCallback = Callable[[str, bytes], None]
"""Called with ("stdout" | "stderr", chunk) as output arrives, for streaming."""

WORKDIR = "/workspace"
MiB = 1024 * 1024


def parse_host_port(entry: str) -> tuple[str, int]:
    """Split `host:port` (`[v6]:port` for IPv6; `*.example.org:443` for every
    subdomain) into a lower-case host and a port; ValueError when malformed."""
    host, sep, port = entry.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host.lower().rstrip(".")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r} is not host:port (e.g. pypi.org:443, [::1]:8080)")
    if any(c.isspace() or c in "/@?#[]" for c in host):
        raise ValueError(f"{entry!r}: {host!r} is not a host name or address")
    return host, int(port)


class EgressConfig(BaseModel):
    """What a sandbox with `network = "proxy"` may reach (see `egress`)."""

    model_config = ConfigDict(extra="forbid")

    allow: list[str] = Field(default_factory=list)
    """`host:port` pairs the proxy lets through, e.g. `pypi.org:443`;
    `*.example.org:443` allows every subdomain of example.org. Matched on the
    name the client asks for (the proxy resolves it), never on an address
    the sandbox resolved. Everything else is refused with 403."""
    log: str | None = None
    """A file to which every attempt is appended as one JSON line (time,
    method, host, port, allowed or denied, why); always logged at INFO too."""
    port: int = Field(3128, gt=0, lt=65536)
    """The loopback port inside the sandbox where the proxy answers;
    HTTP(S)_PROXY of every command point there."""

    @field_validator("allow")
    @classmethod
    def _pairs(cls, allow: list[str]) -> list[str]:
        for entry in allow:
            parse_host_port(entry)
        return allow


class SandboxConfig(BaseModel):
    """Limits and options of one sandbox. A task may set any of them."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["bwrap", "local"] = "bwrap"
    """`bwrap` isolates with Linux namespaces; `local` is a plain subprocess that
    isolates nothing (for machines without user namespaces) and says so."""
    timeout_s: float = Field(60.0, gt=0)
    """Default wall-clock limit of one `exec`; the whole process group is killed
    past it and the result has exit code 124 and `timed_out=True`."""
    memory_mb: int = Field(2048, gt=0)
    """Memory of the whole sandbox (bwrap): past it a process is killed and
    the result says `oom_killed`. Enforced by a memory cgroup where one is
    writable (root; a user with a delegated cgroup), else by the host's
    memory watchdog plus this address-space limit on each process
    (RLIMIT_AS), where one process's allocation past it fails inside it
    (`MemoryError`, ENOMEM). See `atelier.sandbox.memory`. The local
    backend has only the per-process limit."""
    max_processes: int = Field(256, gt=0)
    """Processes and threads the sandbox may hold at once."""
    disk_mb: int = Field(1024, gt=0)
    """Bytes that may be written into the workspace and /tmp (each a tmpfs of
    this size); past it writes fail with ENOSPC."""
    max_file_mb: int = Field(512, gt=0)
    """Largest file a process may write (RLIMIT_FSIZE)."""
    max_open_files: int = Field(1024, gt=0)
    """File descriptors a process may hold (RLIMIT_NOFILE)."""
    cpu_time_s: int = Field(3600, gt=0)
    """CPU seconds per process (RLIMIT_CPU)."""
    output_limit_bytes: int = Field(1 * MiB, gt=0)
    """Captured stdout and stderr are each cut here, with a visible marker."""
    network: Literal["none", "host", "proxy"] = "none"
    """`none`: a network namespace with only its own loopback. `host`: the host's
    network, explicitly and loudly. `proxy`: the loopback only, plus an
    HTTP(S) proxy on the host that lets through the `egress.allow` pairs and
    logs every attempt (bwrap backend only)."""
    egress: EgressConfig = Field(default_factory=EgressConfig, validate_default=True)
    """The policy of `network = "proxy"`."""
    workspace: Literal["overlay", "copy"] = "overlay"
    """`overlay`: copy-on-write over the snapshot (creation and fork cost the
    same at any repository size); falls back to `copy` where the kernel refuses
    it or the snapshot belongs to another user or group (an overlay cannot
    copy such files up in a user namespace). `copy`: the snapshot is copied
    into the sandbox, costing time proportional to its size."""
    ro_mounts: list[str] = Field(default_factory=list)
    """Extra read-only mounts, `SRC` (same path inside) or `SRC:DEST`; e.g. a
    prepared dependency environment."""
    env: dict[str, str] = Field(default_factory=dict)
    """Variables added to the scrubbed environment of every command."""
    root_maps_to: int = Field(1_900_000_000, gt=0, lt=2**31 - 1)
    """When atelier runs as root: the unprivileged host uid and gid that the
    sandbox's users run as (its uid 0), instead of host root. Pick an id that
    no account or file on the host uses; the default lies in the range that
    systemd leaves unassigned."""

    @field_validator("egress")
    @classmethod
    def _egress_needs_proxy(cls, egress: EgressConfig, info: ValidationInfo) -> EgressConfig:
        network, backend = info.data.get("network"), info.data.get("backend")
        if egress.allow and network not in ("proxy", None):
            raise ValueError(f"egress.allow is used only with network = 'proxy' (network is {network!r})")
        if network == "proxy" and backend not in ("bwrap", None):
            raise ValueError("network = 'proxy' needs the bwrap backend (the local backend has the host's network)")
        return egress

    @field_validator("ro_mounts")
    @classmethod
    def _absolute_mounts(cls, mounts: list[str]) -> list[str]:
        for spec in mounts:
            parts = spec.split(":")
            if len(parts) > 2 or not all(p.startswith("/") for p in parts):
                raise ValueError(f"mount {spec!r} must be an absolute SRC or SRC:DEST")
        return mounts


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    truncated: bool = False
    """True when stdout or stderr was cut at `output_limit_bytes`."""
    oom_killed: bool = False
    """A process of the sandbox was killed for passing its memory limit
    while this command ran (by the kernel in its memory cgroup, or by the
    memory watchdog; never reported by the local backend)."""
    host_oom_killed: bool = False
    """A process of the sandbox was killed by the host's OOM killer (the host
    short of memory, not the sandbox past its limit) while this command ran:
    not the command's doing (see `memory.attribute_kill`)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxError(AtelierError):
    """Base of every sandbox failure."""


class SandboxUnavailable(SandboxError):
    """The backend cannot run on this machine (no bwrap, no user namespaces)."""


class SnapshotMissing(SandboxError):
    """The snapshot directory to create a sandbox from does not exist."""


class SnapshotUnusable(SandboxError):
    """The snapshot directory cannot become a workspace (it holds mount points, lies on a
    pseudo-filesystem, or holds files a copy of it cannot take: see `atelier.sandbox.snapshot`)."""


class SandboxLimitExceeded(SandboxError):
    """A limit of the sandbox was hit (disk cap, process count …)."""


class SandboxOutOfMemory(SandboxLimitExceeded):
    """A process was killed for passing the sandbox's memory limit where that
    says nothing about the code being judged (a graded test run): an
    infrastructure failure, retried and never scored (`atelier.failures`)."""


class SandboxClosed(SandboxError):
    """An operation on a sandbox after `close()`."""


class SandboxPathError(SandboxError):
    """A path that is outside the workspace, missing, or not a regular file."""


class Sandbox(abc.ABC):
    """An isolated workspace over a snapshot directory.

    The snapshot is never modified; all changes live in the sandbox and are
    visible through `diff()`. Use as a context manager or call `close()`.
    """

    snapshot: Path
    config: SandboxConfig
    memory_enforcement: str = "rlimit"
    """How `memory_mb` binds (see `atelier.sandbox.memory`): `cgroup` (the
    whole sandbox, kills counted), `watchdog` (each process by RLIMIT_AS,
    the whole sandbox by the host's watchdog, kills counted) or `rlimit`
    (each process only; no kill is ever reported)."""

    @abc.abstractmethod
    def exec(
        self,
        cmd: Command,
        timeout: float | None = None,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        on_output: OutputCallback | None = None,
    ) -> ExecResult:
        """Run a command in the workspace; background processes it starts live
        on until `close()`."""

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes: ...

    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def diff(self) -> str:
        """A unified diff of the workspace against the snapshot that `git apply`
        accepts (added, deleted, modified files; binary files as git binary
        patches)."""

    @abc.abstractmethod
    def fork(self) -> "Sandbox":
        """A new, independent sandbox starting from this one's files (not its
        processes)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Kill every process of the sandbox and free its storage. Idempotent."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    def read_file(self, path: str) -> str:
        return self.read_bytes(path).decode("utf-8", errors="replace")

    def write_file(self, path: str, content: str | bytes) -> None:
        data = content.encode("utf-8") if isinstance(content, str) else content
        self.write_bytes(path, data)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def workspace_relpath(path: str) -> str:
    """Normalise a path given by a user or a model to one relative to the
    workspace (`a/b`, `./a/b` and `/workspace/a/b` are the same file); refuse
    anything that would leave it."""
    if path == WORKDIR or path.startswith(WORKDIR + "/"):
        path = path[len(WORKDIR):].lstrip("/")
    elif path.startswith("/"):
        raise SandboxPathError(
            f"path {path!r} is outside the workspace",
            hint=f"use a path relative to the workspace or under {WORKDIR}/",
        )
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise SandboxPathError(
                    f"path {path!r} leaves the workspace",
                    hint="use a path inside the workspace",
                )
            parts.pop()
            continue
        parts.append(part)
    return "/".join(parts)


def command_argv(cmd: Command) -> list[str]:
    """The argv that runs `cmd`: a string through `/bin/sh -c`, a list as is."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    if not argv:
        raise SandboxError("empty command", hint="pass a shell string or a non-empty argv list")
    return argv
