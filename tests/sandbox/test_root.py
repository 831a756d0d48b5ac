"""Sandboxes started by root: commands are never host root, and everything
that worked with host uid 0 inside (overlay over root-owned snapshots, files
written by the host, forks, diffs) still works. Each check is made on the
host. Skipped for ordinary users, whom `test_unprivileged` and the rest of
the suite cover."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.usefixtures("bwrap_ready"),
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0, reason="about sandboxes started by root"),
]


@pytest.fixture
def root_only(tmp_path: Path) -> Path:
    """A host directory, readable by everyone, holding files only root may
    read: what the bound system directories may hold."""
    d = tmp_path / "sysdir"
    d.mkdir()
    d.chmod(0o755)
    secret = f"ROOT-ONLY-{uuid.uuid4().hex}"
    for name, mode in (("shadow", 0o600), ("group-secret", 0o640), ("public", 0o644)):
        (d / name).write_text(secret + "\n")
        (d / name).chmod(mode)
    return d


def test_files_only_root_may_read_stay_unreadable(make_sandbox, snapshot, root_only) -> None:
    sb = make_sandbox(snapshot, ro_mounts=[f"{root_only}:/sys-like"])
    assert sb.exec("cat /sys-like/public").ok
    for name in ("shadow", "group-secret"):
        res = sb.exec(f"cat /sys-like/{name}")
        assert res.exit_code != 0 and "Permission denied" in res.stderr, res


def test_root_owned_snapshot_keeps_the_overlay(make_sandbox, tmp_path, host) -> None:
    snap = host.write_tree(tmp_path / "snap", {"private.txt": "one\n", "pkg/mod.py": "A = 1\n"})
    (snap / "private.txt").chmod(0o600)
    before = host.tree_digest(snap)
    sb = make_sandbox(snap)
    assert sb.mode == "overlay"
    res = sb.exec("cat private.txt && echo two >> private.txt && rm pkg/mod.py && mkdir new && echo n > new/f")
    assert res.ok, res
    # What the host writes belongs to the sandbox, which can change it.
    sb.write_file("pkg/added.py", "B = 2\n")
    sb.write_file("tests/hidden/test_x.py", "def test_x(): pass\n")
    res = sb.exec("echo C = 3 >> pkg/added.py && mv tests/hidden/test_x.py tests/ && rmdir tests/hidden")
    assert res.ok, res
    patch = sb.diff()
    for line in ("+two", "-A = 1", "+n", "+B = 2", "+C = 3", "+def test_x(): pass"):
        assert line in patch
    upper = f"/proc/{os.getpid()}/fd/{sb._upper_fd}"
    owners = {os.lstat(os.path.join(d, n)).st_uid
              for d, dirs, files in os.walk(upper) for n in dirs + files}
    assert owners == {sb.config.root_maps_to}
    child = make_sandbox.track(sb.fork())
    assert child.exec("cat private.txt pkg/added.py").stdout == "one\ntwo\nB = 2\nC = 3\n"
    assert child.exec("echo three >> private.txt").ok
    assert host.tree_digest(snap) == before


def test_copy_workspace_reads_files_only_the_owner_may(make_sandbox, tmp_path, host) -> None:
    snap = host.write_tree(tmp_path / "snap", {"private.txt": "one\n"})
    (snap / "private.txt").chmod(0o600)
    sb = make_sandbox(snap, workspace="copy")
    assert sb.mode == "copy"
    assert sb.exec("cat private.txt && echo two >> private.txt").stdout == "one\n"
    assert "+two" in sb.diff()


def test_host_mount_table_is_untouched(make_sandbox, snapshot) -> None:
    """Sources are staged in a private mount namespace, never on the host."""
    before = Path("/proc/self/mountinfo").read_text()
    sb = make_sandbox(snapshot, ro_mounts=[str(snapshot.parent)])
    make_sandbox.track(sb.fork())
    assert Path("/proc/self/mountinfo").read_text() == before


def test_process_cap_holds_without_cgroups(make_sandbox, snapshot, monkeypatch) -> None:
    """RLIMIT_NPROC binds root's sandboxes too (they are not uid 0), so the
    cap holds where no cgroup hierarchy is writable."""
    from atelier.sandbox import cgroups

    monkeypatch.setattr(cgroups, "_candidate_parents", lambda controller: [])
    sb = make_sandbox(snapshot, max_processes=32)
    assert sb._cgroup is not None and sb._cgroup.dirs == []
    bomb = sb.exec("for i in $(seq 100); do sleep 5 & done", timeout=10)
    assert "fork" in bomb.stderr.lower(), bomb
    assert sb.exec("echo alive").stdout == "alive\n"


def test_out_of_memory_without_a_memory_cgroup(make_sandbox, snapshot, monkeypatch) -> None:
    """Without a memory cgroup, RLIMIT_AS is the limit: the allocation fails
    inside the process and nothing claims an OOM kill it cannot see."""
    from atelier.sandbox import cgroups
    from atelier.sandbox.hostfs import python_executable, python_mounts

    monkeypatch.setattr(cgroups, "_candidate_parents", lambda controller: [])
    sb = make_sandbox(snapshot, memory_mb=256, ro_mounts=python_mounts())
    assert sb._cgroup is not None and not sb._cgroup.limits_memory
    res = sb.exec([python_executable(), "-c", "bytearray(1024**3)"])
    assert res.exit_code == 1 and "MemoryError" in res.stderr and not res.oom_killed


def test_oom_kill_counts_are_read_from_v1_and_v2_files() -> None:
    from atelier.sandbox.cgroups import parse_oom_kills

    v2 = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"
    v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"
    assert parse_oom_kills(v2) == 2 and parse_oom_kills(v1) == 5
    assert parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n") is None  # a kernel that does not count
