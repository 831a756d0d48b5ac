"""A sandbox never takes the host down by allocating memory, for root and
for an ordinary user, and a process killed for memory is reported as such
(`atelier.sandbox.memory`): a memory cgroup where one is writable, else the
watchdog over RLIMIT_AS. The user's cases run as `nobody` (see `Nobody`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from atelier.sandbox.memory import allocation_failed, attribute_kill, host_oom_kills, over_limit

pytestmark = [pytest.mark.usefixtures("bwrap_ready"), pytest.mark.timeout(120)]

# Six processes of 120 MiB each: every one fits under RLIMIT_AS (256 MiB),
# together they pass the sandbox's 256 MiB. The watchdog must kill.
HOG_SCRIPT = r"""
import sys
from atelier.sandbox import SandboxConfig, create_sandbox
from atelier.sandbox.hostfs import python_executable, python_mounts
py = python_executable()
config = SandboxConfig(memory_mb=256, max_processes=64, ro_mounts=python_mounts(), timeout_s=60)
with create_sandbox("snap", config) as sb:
    print("ENFORCEMENT", sb.memory_enforcement)
    hog = ("import time; b = bytearray(120 * 1024**2); time.sleep(8)")
    many = sb.exec(["sh", "-c", f"for i in 1 2 3 4 5 6; do {py} -c '{hog}' & done; wait"], timeout=60)
    print("MANY", many.oom_killed, many.exit_code)
    one = sb.exec([py, "-c", "bytearray(1024**3)"])
    print("ONE", one.oom_killed, one.exit_code, "MemoryError" in one.stderr)
    fine = sb.exec([py, "-c", "b = bytearray(100 * 1024**2); print(len(b))"])
    print("FINE", fine.oom_killed, fine.stdout.strip())
    print("ALIVE", sb.exec("echo ok").stdout.strip())
"""


@pytest.fixture
def work() -> Iterator[Path]:
    """A directory `nobody` can use (pytest's own lie under a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="atelier-memory-"))
    (d / "snap").mkdir()
    (d / "snap" / "a.txt").write_text("one\n")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _lines(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}


def test_the_largest_process_goes_once_the_sum_passes() -> None:
    mib = 1024**2
    assert over_limit({1: 100 * mib, 2: 100 * mib}, 256 * mib) is None
    assert over_limit({1: 100 * mib, 2: 120 * mib, 3: 90 * mib}, 256 * mib) == 2
    assert over_limit({}, 0) is None


def test_kills_are_told_apart_the_sandboxs_limit_from_the_hosts_shortage() -> None:
    # A memory cgroup: a kill with a hit of the limit is the sandbox's; without, the host's.
    assert attribute_kill(137, (0, 1), (3, 4), (10, 11)) == "sandbox"
    assert attribute_kill(137, (0, 1), (3, 3), (10, 11)) == "host"
    assert attribute_kill(137, (0, 0), (3, 3), (10, 11)) is None  # another cgroup's kill: not ours
    # The watchdog: its kills are the sandbox's; a SIGKILL while the host's count rose, the host's.
    assert attribute_kill(137, (0, 1), None, (10, 10)) == "sandbox"
    assert attribute_kill(137, (0, 0), None, (10, 11)) == "host"
    assert attribute_kill(137, (0, 0), None, (10, 10)) is None  # a plain kill -9
    assert attribute_kill(1, (0, 0), None, (10, 11)) is None
    assert attribute_kill(137, (None, None), None, (None, None)) is None
    assert host_oom_kills() is None or host_oom_kills() >= 0


def test_failed_allocations_are_recognised_for_the_agents_hint() -> None:
    assert allocation_failed(1, "Traceback ...\nMemoryError\n")
    assert allocation_failed(134, "terminate called after throwing an instance of 'std::bad_alloc'")
    assert not allocation_failed(0, "MemoryError")
    assert not allocation_failed(1, "AssertionError: 2 != 3")


def test_watchdog_bounds_an_ordinary_users_sandbox(nobody, work: Path) -> None:
    """No writable cgroup for `nobody` here: RLIMIT_AS stops one process,
    the watchdog the sum of many, and says it killed."""
    res = nobody.run(work, HOG_SCRIPT)
    out = _lines(res.stdout)
    assert "ALIVE" in out, res.stdout + res.stderr
    if out["ENFORCEMENT"] != ["watchdog"]:
        pytest.skip(f"nobody has a writable memory cgroup here ({out['ENFORCEMENT']})")
    assert out["MANY"][0] == "True", res.stdout
    assert out["ONE"] == ["False", "1", "True"], res.stdout  # RLIMIT_AS: a MemoryError, no kill
    assert out["FINE"] == ["False", str(100 * 1024**2)] and out["ALIVE"] == ["ok"], res.stdout


@pytest.mark.slow
def test_delegated_cgroup_bounds_an_ordinary_users_sandbox(nobody, work: Path) -> None:
    """A user whose own memory cgroup is delegated to it (here a v1 cgroup
    owned by `nobody`, which the process is started in) gets per-sandbox
    cgroups: the kernel kills, even a single process, and it is counted."""
    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "memory" in line.split(":")[1].split(",")), None)
    parent = Path("/sys/fs/cgroup/memory") / (own or "").lstrip("/")
    if own is None or not (parent / "cgroup.procs").exists() or not os.access(parent, os.W_OK):
        pytest.skip("no writable cgroup v1 memory hierarchy to delegate from")
    delegated = parent / f"atelier-test-{os.getpid()}"
    delegated.mkdir()
    try:
        for p in [delegated, *delegated.iterdir()]:
            os.chown(p, 65534, 65534)
        res = nobody.run(work, HOG_SCRIPT, prefix=f"echo $$ > {delegated}/cgroup.procs")
        out = _lines(res.stdout)
        assert out.get("ENFORCEMENT") == ["cgroup"], res.stdout + res.stderr
        assert out["MANY"][0] == "True" and out["ONE"][:2] == ["True", "137"], res.stdout
        assert out["FINE"] == ["False", str(100 * 1024**2)] and out["ALIVE"] == ["ok"], res.stdout
    finally:
        for child in delegated.iterdir():
            if child.is_dir():
                child.rmdir()
        delegated.rmdir()


def test_watchdog_as_root_without_a_memory_cgroup(make_sandbox, snapshot, monkeypatch, host) -> None:
    """Root where no cgroup is writable (some containers) falls back the
    same way; background processes, orphaned to the sandbox's init, are
    watched too."""
    from atelier.sandbox import cgroups, memory
    from atelier.sandbox.hostfs import python_executable, python_mounts

    monkeypatch.setattr(cgroups, "_candidate_parents", lambda controller: [])
    sb = make_sandbox(snapshot, memory_mb=256, max_processes=64, ro_mounts=python_mounts(), timeout_s=60)
    assert sb.memory_enforcement == "watchdog"
    py = python_executable()
    started = sb.exec(["sh", "-c", f"for i in 1 2 3 4; do {py} -c 'import time; b = bytearray(120 * 1024**2);"
                                   f" time.sleep(30)' >/dev/null 2>&1 & done"], timeout=60)
    assert started.ok and not started.oom_killed, started
    assert host.wait_until(lambda: sb._watch.kills >= 2, timeout=30), sb._watch.kills

    def resident() -> int:
        return sum(memory.anon_bytes(p) for p in memory.tree([sb._init_pid]))

    assert host.wait_until(lambda: resident() <= 256 * 1024**2, timeout=10), resident()
    assert sb.exec("echo ok").stdout == "ok\n"
