"""Sandboxes placed on Ray worker nodes, behind the same interface as `SandboxPool`.

`RaySandboxPool` starts one `SandboxHost` actor per alive node, pinned there
with `NodeAffinitySchedulingStrategy` and holding no CPUs (the sandboxes'
processes are outside Ray's accounting; the host's own admission control
watches the node's real memory and CPU pressure). Each host wraps a local
`SandboxPool`. `acquire` picks the host on which this pool has the fewest open
sandboxes (ties in turn; other drivers' pools are not counted) and returns a
`RemoteSandbox`: a proxy whose every operation is one actor call naming the
sandbox by an id. Forks stay on their parent's node.

What differs from a local pool, exactly:
- `max_live`, `warm` and the admission thresholds apply per node, so the
  cluster holds up to `max_live` x nodes sandboxes.
- The snapshot path is opened on the node: it must exist there (shared storage
  or the same image).
- `exec(on_output=...)` does not stream. The host collects the chunks (up to
  `output_limit_bytes` per stream) and the proxy hands them to the callback, in
  order, after the command ends.
- Nodes that join after the pool started are not used. When a host's node dies,
  calls on its sandboxes raise `SandboxHostLost`.
- `ray` is imported here only, and only when a `RaySandboxPool` is made; if it
  is not installed, `RayUnavailable` says how to get it. If Ray is not
  initialised, the pool calls `ray.init(address=address)` and leaves it
  running at `close()`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import os
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any, Iterator

from atelier.sandbox.base import (
    Command,
    ExecResult,
    OutputCallback,
    Sandbox,
    SandboxClosed,
    SandboxConfig,
    SandboxError,
)
from atelier.sandbox.pool import SandboxPool, least_loaded, percentile


class RayUnavailable(SandboxError):
    """Ray is not installed here."""


class SandboxHostLost(SandboxError):
    """The actor (or node) that held a remote sandbox is gone."""


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailable(f"Ray sandboxes need the `ray` package ({exc})",
                             hint="pip install 'atelier-rl[ray]'") from None
    return ray


# -- the actor: a plain class, made a Ray actor only by RaySandboxPool ---------

class _Failure:
    """A SandboxError crossing the actor boundary (pickling an AtelierError
    would drop its hint, and Ray wraps what it raises)."""

    def __init__(self, exc: SandboxError) -> None:
        self.module, self.name = type(exc).__module__, type(exc).__qualname__
        self.message, self.hint = exc.message, exc.hint

    def reraise(self) -> None:
        try:
            cls = getattr(importlib.import_module(self.module), self.name)
        except (ImportError, AttributeError):
            cls = SandboxError
        if not (isinstance(cls, type) and issubclass(cls, SandboxError)):
            cls = SandboxError
        raise cls(self.message, hint=self.hint)


def _reply(method):  # type: ignore[no-untyped-def]
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return method(self, *args, **kwargs)
        except SandboxError as exc:
            return _Failure(exc)
    return wrapper


class SandboxHost:
    """Owns one node's sandboxes: a local `SandboxPool` plus the forks made
    from them, each reachable by id. Thread-safe (the actor is threaded)."""

    def __init__(self, config: SandboxConfig, pool_options: dict[str, Any]) -> None:
        self._pool = SandboxPool(config, **pool_options)
        self._sandboxes: dict[str, Sandbox] = {}
        self._lock = threading.Lock()

    def _add(self, sb: Sandbox) -> str:
        sid = uuid.uuid4().hex
        with self._lock:
            self._sandboxes[sid] = sb
        return sid

    def _get(self, sid: str) -> Sandbox:
        with self._lock:
            sb = self._sandboxes.get(sid)
        if sb is None:
            raise SandboxClosed(f"no open sandbox {sid} on this host", hint="it was closed")
        return sb

    def ping(self) -> str:
        return os.uname().nodename

    @_reply
    def acquire(self, snapshot: str, config: SandboxConfig | None, timeout: float | None) -> str:
        return self._add(self._pool.acquire(snapshot, config, timeout))

    @_reply
    def exec(self, sid: str, cmd: Command, timeout: float | None, cwd: str | None,
             env: dict[str, str] | None, stdin: bytes | None,
             collect: bool) -> tuple[ExecResult, list[tuple[str, bytes]]]:
        sb = self._get(sid)
        chunks: list[tuple[str, bytes]] = []
        room = collections.Counter({"stdout": sb.config.output_limit_bytes,
                                    "stderr": sb.config.output_limit_bytes})

        def keep(stream: str, chunk: bytes) -> None:
            if room[stream] > 0:
                chunks.append((stream, chunk[:room[stream]]))
                room[stream] -= len(chunk)

        result = sb.exec(cmd, timeout, cwd=cwd, env=env, stdin=stdin,
                         on_output=keep if collect else None)
        return result, chunks

    @_reply
    def read_bytes(self, sid: str, path: str) -> bytes:
        return self._get(sid).read_bytes(path)

    @_reply
    def write_bytes(self, sid: str, path: str, data: bytes) -> None:
        self._get(sid).write_bytes(path, data)

    @_reply
    def diff(self, sid: str) -> str:
        return self._get(sid).diff()

    @_reply
    def fork(self, sid: str) -> str:
        return self._add(self._get(sid).fork())

    @_reply
    def close(self, sid: str) -> None:
        with self._lock:
            sb = self._sandboxes.pop(sid, None)
        if sb is not None:
            self._pool.release(sb)  # closes it; frees its slot if the pool made it

    def stats(self) -> tuple[dict[str, Any], list[float]]:
        return self._pool.stats(), self._pool.create_times_ms()

    def shutdown(self) -> None:
        with self._lock:
            forks = list(self._sandboxes.values())
            self._sandboxes.clear()
        for sb in forks:
            sb.close()
        self._pool.close()


# -- the driver side -----------------------------------------------------------

class RemoteSandbox(Sandbox):
    """A sandbox that lives in a `SandboxHost` actor; see the module docstring
    for what differs (`on_output` is replayed after the command ends)."""

    def __init__(self, pool: "RaySandboxPool", host: int, sid: str, snapshot: Path,
                 config: SandboxConfig) -> None:
        self._pool, self.host, self.id = pool, host, sid
        self.snapshot, self.config = snapshot, config
        self._closed = False

    @property
    def node_id(self) -> str:
        return self._pool._node_ids[self.host]

    def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise SandboxClosed("the sandbox is closed", hint="create a new sandbox or fork before closing")
        return self._pool._call(self.host, method, self.id, *args)

    def exec(self, cmd: Command, timeout: float | None = None, *, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: bytes | None = None,
             on_output: OutputCallback | None = None) -> ExecResult:
        cmd = cmd if isinstance(cmd, str) else list(cmd)
        result, chunks = self._call("exec", cmd, timeout, cwd, env, stdin, on_output is not None)
        for stream, chunk in chunks:
            on_output(stream, chunk)  # type: ignore[misc]
        return result

    def read_bytes(self, path: str) -> bytes:
        return self._call("read_bytes", path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._call("write_bytes", path, data)

    def diff(self) -> str:
        return self._call("diff")

    def fork(self) -> "RemoteSandbox":
        self._pool._reserve(self.host)
        try:
            sid = self._call("fork")
        except BaseException:
            self._pool._unreserve(self.host)
            raise
        return self._pool._track(RemoteSandbox(self._pool, self.host, sid, self.snapshot, self.config))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._pool._call(self.host, "close", self.id)
        except SandboxHostLost:
            pass  # its node is gone, and its processes with it
        finally:
            self._pool._unreserve(self.host)

    @property
    def closed(self) -> bool:
        return self._closed

    def _mark_closed(self) -> None:
        self._closed = True


class RaySandboxPool:
    """`SandboxPool`'s interface over the nodes of a Ray cluster."""

    def __init__(self, config: SandboxConfig | None = None, max_live: int = 64, warm: int = 0,
                 min_available_mb: int = 512, max_load_per_cpu: float = 4.0, *,
                 address: str | None = None, node_ids: list[str] | None = None,
                 **pool_options: Any) -> None:
        """`node_ids` limits placement to those nodes (default: every alive
        node); `pool_options` go to each node's `SandboxPool`."""
        ray = _import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=address)
        self._ray = ray
        self.config = config or SandboxConfig()
        self.max_live = max_live
        options = dict(max_live=max_live, warm=warm, min_available_mb=min_available_mb,
                       max_load_per_cpu=max_load_per_cpu, **pool_options)
        self._node_ids = node_ids or [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        if not self._node_ids:
            raise SandboxError("the Ray cluster has no alive node", hint="check `ray status`")
        actor = ray.remote(SandboxHost)
        self._hosts = [
            actor.options(num_cpus=0, max_concurrency=2 * max_live + 4,
                          scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            .remote(self.config, options)
            for node_id in self._node_ids
        ]
        self._lock = threading.Lock()
        self._open = [0] * len(self._hosts)
        self._turn = 0
        self._closed = False
        self._sandboxes: "weakref.WeakSet[RemoteSandbox]" = weakref.WeakSet()
        for i in range(len(self._hosts)):
            self._call(i, "ping")  # surfaces a host that cannot start, here

    def acquire(self, snapshot: str | os.PathLike, config: SandboxConfig | None = None,
                timeout: float | None = None) -> RemoteSandbox:
        """A fresh sandbox on the least-loaded node; blocks while that node's
        pool is full, for at most `timeout` seconds."""
        with self._lock:
            if self._closed:
                raise SandboxClosed("the sandbox pool is closed", hint="create a new RaySandboxPool")
            host = least_loaded(self._open, self._turn)
            self._turn = (host + 1) % len(self._hosts)
            self._open[host] += 1
        try:
            sid = self._call(host, "acquire", os.fspath(snapshot), config, timeout)
        except BaseException:
            self._unreserve(host)
            raise
        return self._track(RemoteSandbox(self, host, sid, Path(snapshot), config or self.config))

    def release(self, sandbox: Sandbox) -> None:
        sandbox.close()

    @contextlib.contextmanager
    def sandbox(self, snapshot: str | os.PathLike, config: SandboxConfig | None = None,
                timeout: float | None = None) -> Iterator[RemoteSandbox]:
        sb = self.acquire(snapshot, config, timeout)
        try:
            yield sb
        finally:
            self.release(sb)

    def stats(self) -> dict[str, Any]:
        """Counters summed over the nodes; percentiles over all their recent
        creations; `per_node` keeps each node's own."""
        replies = self._ray.get([h.stats.remote() for h in self._hosts])
        total: dict[str, Any] = collections.Counter()
        times: list[float] = []
        for node_stats, node_times in replies:
            times += node_times
            for name, value in node_stats.items():
                if not name.startswith("create_p"):
                    total[name] += value
        total = dict(total)
        total.update(create_p50_ms=percentile(times, 50), create_p99_ms=percentile(times, 99),
                     hosts=len(self._hosts),
                     per_node={node: s for node, (s, _) in zip(self._node_ids, replies)})
        return total

    def close(self) -> None:
        """Close every sandbox on every node and end the host actors. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for sb in list(self._sandboxes):
            sb._mark_closed()
        refs = [h.shutdown.remote() for h in self._hosts]
        for ref in refs:
            with contextlib.suppress(self._ray.exceptions.RayError):
                self._ray.get(ref)
        for host in self._hosts:
            self._ray.kill(host)

    def __enter__(self) -> "RaySandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------
    def _call(self, host: int, method: str, *args: Any) -> Any:
        ray = self._ray
        lost = tuple(getattr(ray.exceptions, name) for name in ("RayActorError", "ActorUnavailableError")
                     if hasattr(ray.exceptions, name))
        try:
            reply = ray.get(getattr(self._hosts[host], method).remote(*args))
        except lost as exc:
            raise SandboxHostLost(f"the sandbox host on node {self._node_ids[host]} is gone: {exc}",
                                  hint="its sandboxes are lost; acquire new ones") from None
        if isinstance(reply, _Failure):
            reply.reraise()
        return reply

    def _track(self, sb: RemoteSandbox) -> RemoteSandbox:
        self._sandboxes.add(sb)
        return sb

    def _reserve(self, host: int) -> None:
        with self._lock:
            self._open[host] += 1

    def _unreserve(self, host: int) -> None:
        with self._lock:
            self._open[host] -= 1
