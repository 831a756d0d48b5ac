"""RaySandboxPool on a local Ray instance; the error paths need no Ray."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from atelier.sandbox import (
    SandboxClosed,
    SandboxConfig,
    SandboxPathError,
    SnapshotMissing,
)
from atelier.sandbox.pool import PoolExhausted
from atelier.sandbox.ray_pool import RaySandboxPool, RayUnavailable, SandboxHost

CONFIG = SandboxConfig(timeout_s=10, disk_mb=16)
CALM = dict(min_available_mb=0, max_load_per_cpu=1e9, max_cpu_pressure=101.0)
"""Thresholds never reached: timings here must not depend on the host's load."""


@pytest.fixture
def snapshot(hello_repo: Path) -> Path:
    return hello_repo


def no_sandbox_processes(host, snapshot: Path, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while host.snapshot_processes(snapshot):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_missing_ray_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` fail
    with pytest.raises(RayUnavailable) as info:
        RaySandboxPool(CONFIG)
    assert "atelier-rl[ray]" in info.value.hint


def test_host_errors_cross_with_their_type_and_hint(snapshot: Path, tmp_path: Path) -> None:
    host = SandboxHost(CONFIG, {"max_live": 1, **CALM})  # the actor's class, in process
    try:
        failure = host.acquire(str(tmp_path / "missing"), None, 1)
        with pytest.raises(SnapshotMissing) as info:
            failure.reraise()
        assert info.value.hint
        sid = host.acquire(str(snapshot), None, 1)
        assert isinstance(sid, str)
        with pytest.raises(PoolExhausted):
            host.acquire(str(snapshot), None, 0.1).reraise()
    finally:
        host.shutdown()


@pytest.mark.ray
def test_remote_sandbox_roundtrip(ray_instance, snapshot: Path, host) -> None:
    with RaySandboxPool(CONFIG, max_live=2, warm=1, **CALM) as pool:
        sb = pool.acquire(snapshot)
        chunks: list[tuple[str, bytes]] = []
        res = sb.exec("cat hello.txt; echo oops >&2; exit 3", on_output=lambda s, c: chunks.append((s, c)))
        assert (res.exit_code, res.stdout, res.stderr) == (3, "hello\n", "oops\n")
        assert b"".join(c for s, c in chunks if s == "stdout") == b"hello\n"
        assert sb.exec(["sh", "-c", "echo $X"], env={"X": "42"}).stdout == "42\n"

        sb.write_file("new.txt", "written remotely\n")
        assert sb.read_file("new.txt") == "written remotely\n"
        with pytest.raises(SandboxPathError):
            sb.read_file("absent.txt")
        assert "+++ b/new.txt" in sb.diff()

        child = sb.fork()
        child.write_file("hello.txt", "changed in the fork\n")
        assert child.read_file("new.txt") == "written remotely\n"
        assert sb.read_file("hello.txt") == "hello\n"
        assert child.node_id == sb.node_id
        child.close()
        with pytest.raises(SandboxClosed):
            child.diff()

        # max_live applies per node: this one-node cluster is full.
        other = pool.acquire(snapshot, timeout=5)
        with pytest.raises(PoolExhausted):
            pool.acquire(snapshot, timeout=0.2)
        other.close()
        sb.close()
        assert sb.closed
        stats = pool.stats()
        assert stats["hosts"] == 1 and stats["live"] == 0 and stats["created"] >= 2
        assert stats["create_p50_ms"] > 0
        remaining = pool.acquire(snapshot)
    assert remaining.closed  # the pool's close reaped it
    assert no_sandbox_processes(host, snapshot)
    with pytest.raises(SandboxClosed):
        pool.acquire(snapshot)


@pytest.mark.ray
def test_acquire_picks_the_least_loaded_host(ray_instance, snapshot: Path) -> None:
    node = ray_instance.get_runtime_context().get_node_id()
    # Two hosts on the one local node stand in for two nodes.
    with RaySandboxPool(CONFIG, max_live=2, node_ids=[node, node], **CALM) as pool:
        a, b = pool.acquire(snapshot), pool.acquire(snapshot)
        assert {a.host, b.host} == {0, 1}
        a.close()
        c = pool.acquire(snapshot)
        assert c.host == a.host
        assert pool.stats()["hosts"] == 2 and pool.stats()["live"] == 2
