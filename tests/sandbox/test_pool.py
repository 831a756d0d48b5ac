"""SandboxPool: pressure readings (pure), then real bubblewrap sandboxes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from atelier.sandbox import SandboxClosed, SandboxConfig, SnapshotMissing
from atelier.sandbox.pool import PoolExhausted, SandboxPool, percentile
from atelier.sandbox.pressure import (
    CpuPressure,
    admission_wait_reason,
    parse_load_per_cpu,
    parse_mem_available_mb,
    parse_psi_some_avg10,
    read_cpu_pressure,
)
from tests.helpers import wait_until

MEMINFO = """MemTotal:       24683008 kB
MemFree:        23275252 kB
MemAvailable:     409600 kB
Buffers:          112308 kB
"""
PSI = """some avg10=12.50 avg60=3.40 avg300=0.15 total=3836694
full avg10=0.00 avg60=0.00 avg300=0.00 total=0
"""
CONFIG = SandboxConfig(timeout_s=10, disk_mb=16)
CALM = dict(memory_probe=lambda: None, cpu_probe=lambda: None)
"""Probes that never defer: timings here must not depend on the host's load."""


# -- pure functions ------------------------------------------------------------

def test_parse_readings() -> None:
    assert parse_mem_available_mb(MEMINFO) == 400.0
    assert parse_mem_available_mb("MemTotal: 1 kB\n") is None
    assert parse_psi_some_avg10(PSI) == 12.5
    assert parse_psi_some_avg10("") is None
    assert parse_load_per_cpu("6.00 3.10 1.00 2/345 6789\n", ncpu=4) == 1.5
    assert parse_load_per_cpu("", ncpu=4) is None


def test_admission_reason() -> None:
    limits = dict(min_available_mb=512, max_load_per_cpu=4.0, max_cpu_pressure=90.0)
    assert admission_wait_reason(1024, CpuPressure("psi", 50.0), **limits) is None
    assert admission_wait_reason(None, None, **limits) is None  # unknown never blocks
    assert "MemAvailable" in admission_wait_reason(400, None, **limits)
    assert "pressure" in admission_wait_reason(1024, CpuPressure("psi", 95.0), **limits)
    # A load of 5/CPU is over the load threshold; 5 % PSI is not over the PSI one.
    assert "load per CPU" in admission_wait_reason(1024, CpuPressure("loadavg", 5.0), **limits)
    assert admission_wait_reason(1024, CpuPressure("psi", 5.0), **limits) is None


def test_percentile_and_live_reading() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    cpu = read_cpu_pressure()
    assert cpu is None or cpu.value >= 0


# -- real sandboxes ------------------------------------------------------------

@pytest.fixture
def snapshot(hello_repo: Path) -> Path:
    return hello_repo


def test_bounded_concurrency(snapshot: Path) -> None:
    with SandboxPool(CONFIG, max_live=2, **CALM) as pool:
        a = pool.acquire(snapshot)
        pool.acquire(snapshot)
        assert a.exec("cat hello.txt").stdout == "hello\n"
        with pytest.raises(PoolExhausted, match="all 2 sandboxes") as info:
            pool.acquire(snapshot, timeout=0.3)
        assert "max_live" in info.value.hint
        # A blocked acquire goes through as soon as a sandbox is released.
        got = []
        waiter = threading.Thread(target=lambda: got.append(pool.acquire(snapshot, timeout=10)))
        waiter.start()
        assert wait_until(lambda: pool.stats()["waiting"] == 1)   # it is blocked inside acquire...
        assert not got                                  # ...and has nothing while the pool is full
        pool.release(a)
        waiter.join(10)
        assert len(got) == 1 and a.closed and not got[0].closed
        assert pool.stats()["live"] == 2


def test_live_never_exceeds_max_live_under_contention(snapshot: Path) -> None:
    pool = SandboxPool(CONFIG, max_live=3, **CALM)
    peak, now, lock = [0], [0], threading.Lock()

    def worker() -> None:
        for _ in range(3):
            with pool.sandbox(snapshot, timeout=30) as sb:
                with lock:
                    now[0] += 1
                    peak[0] = max(peak[0], now[0])
                assert sb.exec("true").ok
                with lock:
                    now[0] -= 1

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stats = pool.stats()
    pool.close()
    assert peak[0] <= 3 and stats["created"] == 24 and stats["live"] == 0


def test_warm_hits_and_latency(snapshot: Path) -> None:
    with SandboxPool(CONFIG, max_live=4, warm=1, **CALM) as pool:
        pool.release(pool.acquire(snapshot))  # a miss; declares the snapshot
        assert wait_until(lambda: pool.stats()["warm"] == 1)
        sb = pool.acquire(snapshot)
        assert sb.exec("cat hello.txt").ok
        stats = pool.stats()
        # A hit starts no process: two creations, the miss and the spare.
        assert stats["warm_hits"] == 1 and stats["created"] == 2 and stats["failed"] == 0
        assert stats["create_p50_ms"] > 0 and stats["create_p99_ms"] >= stats["create_p50_ms"]
        assert wait_until(lambda: pool.stats()["warm"] == 1)  # refilled


def test_prewarm_and_eviction(snapshot: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    with SandboxPool(CONFIG, max_live=2, **CALM) as pool:
        pool.prewarm(snapshot, 2)
        assert wait_until(lambda: pool.stats()["warm"] == 2)
        # The pool is full of spares: acquiring another snapshot closes one.
        sb = pool.acquire(other, timeout=5)
        assert sb.snapshot == other.resolve()
        stats = pool.stats()
        assert stats["evicted"] == 1 and stats["live"] == 1 and stats["warm"] == 1
        with pytest.raises(SnapshotMissing):
            pool.prewarm(tmp_path / "missing", 1)


def test_failed_creation_is_counted_and_frees_its_slot(tmp_path: Path) -> None:
    with SandboxPool(CONFIG, max_live=1, **CALM) as pool:
        for _ in range(2):
            with pytest.raises(SnapshotMissing):
                pool.acquire(tmp_path / "missing", timeout=1)
        assert pool.stats()["failed"] == 2 and pool.stats()["live"] == 0


def test_admission_defers_while_memory_is_short(snapshot: Path) -> None:
    readings = iter([100.0, 100.0, 100.0])  # short of memory three times, then plenty

    with SandboxPool(CONFIG, memory_probe=lambda: next(readings, 4096.0),
                     cpu_probe=lambda: None) as pool:
        pool.release(pool.acquire(snapshot))
        assert next(readings, None) is None  # it probed until memory came back
        stats = pool.stats()
        assert stats["deferred"] == 1 and stats["deferred_s"] > 0 and stats["created"] == 1
        pool.release(pool.acquire(snapshot))
        assert pool.stats()["deferred"] == 1  # no pressure: no wait


def test_admission_wait_is_bounded(snapshot: Path) -> None:
    with SandboxPool(CONFIG, max_defer_s=0.3, memory_probe=lambda: None,
                     cpu_probe=lambda: CpuPressure("loadavg", 50.0)) as pool:
        sb = pool.acquire(snapshot)  # the CPU never calms down: created anyway after the bound
        assert sb.exec("true").ok
        assert pool.stats()["deferred"] == 1


def test_close_reaps_everything(snapshot: Path, host) -> None:
    pool = SandboxPool(CONFIG, max_live=3, warm=1, **CALM)
    live = [pool.acquire(snapshot), pool.acquire(snapshot)]
    live[0].exec("sleep 300 >/dev/null 2>&1 &")
    assert wait_until(lambda: pool.stats()["warm"] == 1)
    assert host.snapshot_processes(snapshot)
    pool.close()
    assert all(sb.closed for sb in live)
    stats = pool.stats()
    assert stats["live"] == 0 and stats["warm"] == 0 and stats["creating"] == 0
    assert wait_until(lambda: not host.snapshot_processes(snapshot), timeout=5)
    with pytest.raises(SandboxClosed):
        pool.acquire(snapshot)


def test_close_wakes_a_blocked_acquire(snapshot: Path, host) -> None:
    pool = SandboxPool(CONFIG, max_live=1, **CALM)
    pool.acquire(snapshot)
    errors: list[BaseException] = []

    def acquire_blocked() -> None:
        try:
            pool.acquire(snapshot, timeout=30)
        except SandboxClosed as exc:
            errors.append(exc)

    waiter = threading.Thread(target=acquire_blocked)
    waiter.start()
    assert wait_until(lambda: pool.stats()["waiting"] == 1)
    pool.close()
    waiter.join(10)
    assert len(errors) == 1 and not waiter.is_alive()
    assert wait_until(lambda: not host.snapshot_processes(snapshot), timeout=5)
