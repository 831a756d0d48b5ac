"""Unusual workspaces: each works, or gets a typed error that names the problem; never a traceback.

Through the real CLI where a user would meet it (`atelier sandbox run --workspace X`), through the
API for what only the API shows (diffs, forks, the copy fallback, the local backend)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from atelier.sandbox import SandboxConfig, SandboxPathError, SnapshotUnusable, create_sandbox
from atelier.sandbox.snapshot import check_snapshot, mounts

pytestmark = [pytest.mark.usefixtures("bwrap_ready"), pytest.mark.timeout(120)]
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making mounts and device files needs root")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atelier.cli", "sandbox", "run", *args], capture_output=True,
                          text=True, timeout=120)


def _refused(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert all(w in res.stderr for w in words) and "hint:" in res.stderr, res.stderr


def test_the_tmp_directory_itself_is_a_workspace():
    """As root, /tmp is where sandboxes are staged: the workspace must be /tmp's own files. (Other
    processes, the test suite's other worker among them, add and remove files in /tmp meanwhile,
    so the listing is checked by a file of this test's own and by what stays in /tmp throughout.)"""
    with tempfile.NamedTemporaryFile(dir="/tmp", prefix="atelier-workspace-") as own:
        before = set(os.listdir("/tmp"))
        res = run_cli("--workspace", "/tmp", "--", "sh", "-c", "ls -A /workspace | sort")
        throughout = before & set(os.listdir("/tmp"))
        if any(mp.startswith("/tmp/") for mp, _ in mounts()):
            _refused(res, "holds mount points")
            return
        assert res.returncode == 0, res.stderr
        listed = set(res.stdout.split())
        assert Path(own.name).name in throughout and throughout <= listed


def test_a_workspace_holding_mount_points_or_on_a_kernel_filesystem_is_refused():
    _refused(run_cli("--workspace", "/", "--", "true"), "snapshot / holds mount points", "/proc")
    _refused(run_cli("--workspace", "/proc", "--", "true"), "proc filesystem")


def test_mount_points_are_found_in_the_mount_table():
    table = ("22 1 0:21 / /proc rw - proc proc rw\n30 1 8:1 / /srv/repo rw - ext4 /dev/sda1 rw\n"
             "31 30 0:40 / /srv/repo/data\\040dir rw - tmpfs none rw\n")
    with pytest.raises(SnapshotUnusable, match=r"holds mount points \(/srv/repo/data dir\)"):
        check_snapshot(Path("/srv/repo"), table)
    check_snapshot(Path("/srv/repo/src"), table)  # beside the mount, not above it
    check_snapshot(Path("/srv/repo/data dir"), table)  # the mount's own root is one filesystem
    with pytest.raises(SnapshotUnusable, match="proc filesystem"):
        check_snapshot(Path("/proc/self"), table)


@as_root
def test_a_mount_inside_the_workspace_is_named(tmp_path: Path):
    (tmp_path / "data").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "none", str(tmp_path / "data")], check=True)
    try:
        _refused(run_cli("--workspace", str(tmp_path), "--", "true"), f"({tmp_path / 'data'})", "one filesystem")
        with pytest.raises(SnapshotUnusable):
            create_sandbox(tmp_path, SandboxConfig(backend="local"))
    finally:
        subprocess.run(["umount", str(tmp_path / "data")], check=True)


@pytest.fixture()
def special(tmp_path: Path) -> Path:
    """A workspace holding a unix socket and a FIFO beside a file."""
    root = tmp_path / "special"
    root.mkdir()
    (root / "a.txt").write_text("one\n")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(root / "agent.sock"))
    os.mkfifo(root / "events.fifo")
    return root


@pytest.mark.parametrize("backend,workspace", [("bwrap", "overlay"), ("bwrap", "copy"), ("local", "overlay")])
def test_sockets_and_fifos_stay_and_are_never_opened(special: Path, backend: str, workspace: str):
    with create_sandbox(special, SandboxConfig(backend=backend, workspace=workspace, timeout_s=20)) as sb:
        res = sb.exec("ls -F; echo two >> a.txt; mkfifo new.fifo")
        assert res.ok and {"agent.sock=", "events.fifo|"} <= set(res.stdout.split()), res
        for name in ("agent.sock", "events.fifo"):
            with pytest.raises(SandboxPathError):
                sb.read_file(name)
        diff = sb.diff()
        assert "+two" in diff and "fifo" not in diff and "sock" not in diff
        with sb.fork() as child:
            assert child.read_file("a.txt") == "one\ntwo\n"


@as_root
def test_device_files_stay_in_an_overlay_and_are_named_when_a_copy_cannot_take_them(tmp_path: Path):
    root = tmp_path / "devices"
    root.mkdir()
    (root / "a.txt").write_text("one\n")
    os.mknod(root / "null", 0o666 | 0o020000, os.makedev(1, 3))
    with create_sandbox(root, SandboxConfig(timeout_s=20)) as sb:
        assert "null" in sb.exec("ls").stdout and sb.diff() == ""
    with pytest.raises(SnapshotUnusable, match=r"cannot be copied into a sandbox \(Operation not permitted: null\)") \
            as info:
        create_sandbox(root, SandboxConfig(workspace="copy", timeout_s=20))
    assert "device files" in info.value.hint


def test_files_no_one_may_read_stay_unreadable_inside(tmp_path: Path):
    root = tmp_path / "closed"
    (root / "vault").mkdir(parents=True)
    (root / "a.txt").write_text("one\n")
    (root / "secret").write_text("s3cret\n")
    (root / "vault" / "key").write_text("k\n")
    for path, mode in ((root / "secret", 0o000), (root / "vault", 0o000)):
        path.chmod(mode)
    try:
        with create_sandbox(root, SandboxConfig(timeout_s=20)) as sb:
            res = sb.exec("cat secret; ls vault; cat a.txt")
            assert "s3cret" not in res.stdout and "Permission denied" in res.stderr and "one" in res.stdout
            sb.exec("echo two >> a.txt")
            assert "+two" in sb.diff()
    finally:
        (root / "vault").chmod(0o755)


NOBODY_COPY = r"""
from atelier.sandbox import SandboxConfig, SnapshotUnusable, create_sandbox
with create_sandbox("snap", SandboxConfig(timeout_s=20)) as sb:
    assert sb.exec("cat a.txt").stdout == "one\n"
    assert "Permission denied" in sb.exec("cat secret").stderr
try:
    create_sandbox("snap", SandboxConfig(workspace="copy", timeout_s=20))
except SnapshotUnusable as exc:
    assert "Permission denied: secret" in exc.message and "readable" in exc.hint, exc
    print("NOBODY-OK")
"""


def test_a_copy_that_cannot_read_a_file_names_it(nobody):
    """An ordinary user's overlay shows a file they cannot read as unreadable; their copy names it."""
    work = Path(tempfile.mkdtemp(prefix="atelier-unreadable-"))  # where that user can reach it
    try:
        (work / "snap").mkdir()
        (work / "snap" / "a.txt").write_text("one\n")
        (work / "snap" / "secret").write_text("s3cret\n")
        res = nobody.run(work, NOBODY_COPY, prefix="chown 0:0 snap/secret && chmod 600 snap/secret")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert "NOBODY-OK" in res.stdout, res.stdout + res.stderr


def _deep(root: Path, levels: int) -> Path:
    """`levels` nested directories under `root`, a file at the bottom (made from within, since the
    whole path may pass what one system call takes)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            next_fd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        with open(os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
            f.write("leaf\n")
    finally:
        os.close(fd)
    return root


def _wide(root: Path, dirs: int, files: int) -> Path:
    for d in range(dirs):
        (root / f"pkg{d}").mkdir(parents=True)
        for f in range(files):
            (root / f"pkg{d}" / f"m{f}.py").write_text(f"X = {f}\n")
    return root


def _change_and_check(sb, files: int) -> None:
    """Count the files inside, change one at the bottom of the deep branch and one beside, diff, fork."""
    res = sb.exec("find . -type f | wc -l; find . -name leaf.txt -exec sh -c 'echo more >> \"$0\"' {} \\;")
    assert res.ok and int(res.stdout.split()[0]) == files, res
    sb.write_file("pkg3/m7.py", "X = 70\n")
    diff = sb.diff()
    assert diff.count("diff --git") == 2 and "+more" in diff and "+X = 70" in diff
    with sb.fork() as child:
        assert child.read_file("pkg3/m7.py") == "X = 70\n"


@pytest.fixture()
def tree(tmp_path: Path):
    """Where a test builds its tree; removed after it, at any depth (pytest's own clean-up of old
    temporary directories recurses once per level and would fail on a deep one)."""
    from atelier.sandbox.fsutil import remove_tree

    try:
        yield tmp_path / "tree"
    finally:
        remove_tree(tmp_path / "tree")


@pytest.mark.parametrize("backend", ["bwrap", "local"])
def test_a_wide_and_a_deep_tree_work(tree: Path, backend: str):
    """A tree nested deeper than Python's default recursion limit (1,000), beside a few thousand
    files: create, change at the bottom, diff, fork, close. A fixed depth: other tests of a session
    may raise the limit, and a path of 10,000 levels is past the kernel's PATH_MAX."""
    root = _deep(_wide(tree, 10, 200), 1_200)
    with create_sandbox(root, SandboxConfig(backend=backend, timeout_s=60)) as sb:
        _change_and_check(sb, 2_001)


@pytest.mark.slow
def test_a_huge_tree_costs_an_overlay_nothing(tree: Path):
    root = _deep(_wide(tree, 100, 1000), 50)
    with create_sandbox(root, SandboxConfig(timeout_s=300)) as sb:
        assert sb.mode == "overlay"
        _change_and_check(sb, 100_001)
