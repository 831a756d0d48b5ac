"""The `Sandbox` contract, on real bubblewrap sandboxes: state, processes,
commands, files, forks, limits and typed errors."""

from __future__ import annotations

import time
import uuid

import pytest

from atelier.sandbox.base import (
    MiB,
    SandboxClosed,
    SandboxLimitExceeded,
    SandboxPathError,
    SnapshotMissing,
)
from atelier.sandbox.hostfs import SANDBOX_PATH, python_executable, python_mounts

pytestmark = [pytest.mark.usefixtures("bwrap_ready"), pytest.mark.timeout(60)]


# -- state and processes -------------------------------------------------------

def test_files_persist_across_exec(sandbox) -> None:
    assert sandbox.exec("echo one > notes.txt && mkdir -p a/b && echo two > a/b/c").ok
    res = sandbox.exec("cat notes.txt a/b/c")
    assert (res.exit_code, res.stdout) == (0, "one\ntwo\n")


def test_background_process_lives_across_exec_until_close(sandbox, host) -> None:
    start = time.monotonic()
    res = sandbox.exec("sh -c 'while :; do echo t >> tick; sleep 0.05; done' >/dev/null 2>&1 &"
                       " sleep 100 & echo started")
    # The command returns although its children keep running (and `sleep`
    # still holds the output pipe).
    assert res.ok and res.stdout == "started\n"
    assert time.monotonic() - start < 60  # not the 100 s `sleep` holding the pipe

    def ticks() -> int:
        return int(sandbox.exec("wc -l < tick").stdout or 0)

    assert host.wait_until(lambda: ticks() >= 2)
    before = ticks()
    assert host.wait_until(lambda: ticks() > before)

    def names() -> list[str]:
        return [host.cmdline(pid) for pid, _ in host.sandbox_procs(sandbox)]

    assert host.wait_until(lambda: any("while" in n for n in names()) and "sleep 100" in names())
    procs = host.sandbox_procs(sandbox)
    sandbox.close()
    assert host.wait_until(lambda: not host.alive(procs)), "sandbox processes outlived close()"


def test_exit_codes_and_separate_streams(sandbox) -> None:
    res = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (res.exit_code, res.stdout, res.stderr, res.timed_out) == (3, "out\n", "err\n", False)
    assert not res.ok
    assert sandbox.exec(["sh", "-c", "exit 7"]).exit_code == 7
    assert sandbox.exec(["true"]).ok
    assert sandbox.exec("no-such-command-here").exit_code == 127
    assert sandbox.exec("kill -9 $$").exit_code == 128 + 9


def test_cwd_is_a_workspace_subdirectory(sandbox) -> None:
    assert sandbox.exec("pwd").stdout == "/workspace\n"
    assert sandbox.exec("pwd; cat deep.txt", cwd="pkg/sub").stdout == "/workspace/pkg/sub\ndeep\n"
    assert sandbox.exec(["pwd"], cwd="/workspace/pkg").stdout == "/workspace/pkg\n"
    assert sandbox.exec("pwd", cwd="no/such/dir").exit_code != 0
    with pytest.raises(SandboxPathError):
        sandbox.exec("pwd", cwd="../")


def test_stdin_is_passed(sandbox) -> None:
    assert sandbox.exec("tr a-z A-Z", stdin=b"hello").stdout == "HELLO"
    big = b"x" * (2 * MiB)  # more than a pipe holds: must be written while reading
    assert sandbox.exec("wc -c", stdin=big).stdout.strip() == str(len(big))
    assert sandbox.exec("cat").stdout == ""  # no stdin: EOF, not a hang


def test_environment_is_scrubbed(make_sandbox, snapshot, monkeypatch) -> None:
    name, value = f"ATELIER_HOST_ONLY_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    monkeypatch.setenv(name, value)
    sb = make_sandbox(snapshot, env={"EXTRA_VAR": "with space"})
    env = sb.exec("env", env={"PER_CALL": "1"}).stdout
    assert name not in env and value not in env
    lines = set(env.splitlines())
    assert {"EXTRA_VAR=with space", "PER_CALL=1", "HOME=/tmp", f"PATH={SANDBOX_PATH}"} <= lines
    assert "PER_CALL" not in sb.exec("env").stdout


# -- limits --------------------------------------------------------------------

def test_timeout_kills_the_whole_process_group(sandbox, host) -> None:
    res = sandbox.exec("sleep 10", timeout=0.5)
    assert (res.exit_code, res.timed_out, res.ok) == (124, True, False)
    assert res.duration_s < 8  # killed at the timeout, not after the 10 s sleep

    res = sandbox.exec("sleep 31 & sleep 32 & echo spawned; wait", timeout=0.5)
    assert res.timed_out and res.stdout == "spawned\n"

    def sleepers() -> list[str]:
        return [c for pid, _ in host.alive(host.sandbox_procs(sandbox))
                if (c := host.cmdline(pid)).startswith("sleep 3")]

    assert host.wait_until(lambda: not sleepers(), timeout=3), sleepers()
    assert sandbox.exec("pgrep -x sleep").exit_code == 1


def test_output_is_capped_with_a_marker(make_sandbox, snapshot) -> None:
    sb = make_sandbox(snapshot, output_limit_bytes=MiB)
    res = sb.exec("head -c 3145728 /dev/zero | tr '\\0' a; echo small >&2")
    assert res.exit_code == 0 and res.truncated
    assert "output truncated" in res.stdout and str(2 * MiB) in res.stdout
    assert MiB <= len(res.stdout) <= MiB + 200
    assert res.stderr == "small\n"
    assert not sb.exec("echo fine").truncated


def test_disk_cap(make_sandbox, snapshot) -> None:
    sb = make_sandbox(snapshot, disk_mb=5)
    res = sb.exec("head -c 20000000 /dev/zero > big")
    assert res.exit_code != 0 and "No space left on device" in res.stderr
    res = sb.exec("head -c 20000000 /dev/zero > /tmp/big")
    assert res.exit_code != 0 and "No space left on device" in res.stderr
    assert sb.exec("rm -f big /tmp/big").ok
    with pytest.raises(SandboxLimitExceeded):
        sb.write_file("big.dat", b"\0" * 20_000_000)
    # A failed write leaves nothing behind, and an existing file as it was.
    sb.write_file("keep.txt", "old\n")
    with pytest.raises(SandboxLimitExceeded):
        sb.write_file("keep.txt", b"\0" * 20_000_000)
    assert sb.read_file("keep.txt") == "old\n"
    assert "big.dat" not in sb.exec("ls -A").stdout and ".atelier-" not in sb.exec("ls -A").stdout


def test_memory_limit(make_sandbox, snapshot) -> None:
    sb = make_sandbox(snapshot, memory_mb=512, ro_mounts=python_mounts())
    py = python_executable()
    assert sb.exec([py, "-c", "b = bytearray(100 * 1024**2); print(len(b))"]).stdout == "104857600\n"
    res = sb.exec([py, "-c", "bytearray(3 * 1024**3)"])
    cgroup = getattr(sb, "_cgroup", None)
    if cgroup is not None and cgroup.limits_memory:
        # A memory cgroup bounds the sandbox: the kernel kills, and the result says so.
        assert res.exit_code == 137 and res.oom_killed, res
    else:
        # Only RLIMIT_AS: the allocation fails inside the process, which is all one can see.
        assert res.exit_code != 0 and "MemoryError" in res.stderr and not res.oom_killed
    assert not sb.exec([py, "-c", "b = bytearray(100 * 1024**2)"]).oom_killed  # counted per command
    # The host is fine, and so is the sandbox.
    assert len(bytearray(256 * MiB)) == 256 * MiB
    assert sb.exec("echo ok").stdout == "ok\n"


# -- files ---------------------------------------------------------------------

def test_read_write_round_trip(sandbox, snapshot) -> None:
    sandbox.write_file("new/nested/dir/f.txt", "héllo\nwörld\n")
    assert sandbox.read_file("new/nested/dir/f.txt") == "héllo\nwörld\n"
    assert sandbox.exec("cat new/nested/dir/f.txt").stdout == "héllo\nwörld\n"
    blob = bytes(range(256)) * 10
    sandbox.write_file("/workspace/bin/blob", blob)
    assert sandbox.read_bytes("./bin/blob") == blob
    sandbox.exec("ln -s bin/blob blob-link && ln -s /etc/passwd outside-link")
    assert sandbox.read_bytes("blob-link") == blob  # resolved inside, exact bytes
    with pytest.raises(SandboxPathError):
        sandbox.read_file("outside-link")  # not a workspace file
    sandbox.write_file("README.md", "replaced\n")
    assert sandbox.exec("cat README.md").stdout == "replaced\n"
    assert sandbox.read_file("readme-link") == "replaced\n"  # a symlink inside the workspace
    sandbox.exec("printf 'from exec' > made.txt")
    assert sandbox.read_file("made.txt") == "from exec"
    assert (snapshot / "README.md").read_text() == "# demo\n\nA small project.\n"
    assert not (snapshot / "new").exists()


def test_path_errors(sandbox) -> None:
    with pytest.raises(SandboxPathError):
        sandbox.read_file("missing.txt")
    with pytest.raises(SandboxPathError):
        sandbox.read_file("pkg")  # a directory
    for bad in ("../x", "a/../../x", "/etc/passwd", "/workspace/../etc/passwd"):
        with pytest.raises(SandboxPathError):
            sandbox.read_file(bad)
        with pytest.raises(SandboxPathError):
            sandbox.write_file(bad, "x")


def test_fork_is_independent(make_sandbox, snapshot) -> None:
    parent = make_sandbox(snapshot)
    parent.exec("echo parent > a.txt && rm pkg/mod.py")
    child = make_sandbox.track(parent.fork())
    assert child.exec("cat a.txt; ls pkg").stdout == "parent\n__init__.py\nsub\n"

    child.exec("echo child > a.txt && echo b > b.txt && rm README.md")
    parent.exec("echo c > c.txt")
    assert parent.exec("cat a.txt; ls b.txt; cat README.md").stdout.startswith("parent\n# demo")
    assert child.exec("ls c.txt").exit_code != 0

    grandchild = make_sandbox.track(child.fork())
    assert grandchild.exec("cat a.txt b.txt; ls README.md pkg/mod.py").stdout == "child\nb\n"
    grandchild.exec("echo g > a.txt")

    parent.close()
    assert child.exec("cat a.txt b.txt").stdout == "child\nb\n"
    assert grandchild.exec("cat a.txt").stdout == "g\n"
    child.close()
    assert grandchild.exec("cat b.txt; ls c.txt README.md pkg/mod.py").stdout == "b\n"
    assert "+g" in grandchild.diff()


def test_snapshot_is_never_modified(make_sandbox, snapshot, host) -> None:
    before = host.tree_digest(snapshot)
    sb = make_sandbox(snapshot)
    script = ("echo more >> README.md && rm pkg/mod.py && rm -rf pkg/sub && mkdir pkg/sub &&"
              " echo new > pkg/sub/new.txt && chmod +x src/app.py && chmod -x run.sh &&"
              " mv data.bin data2.bin && touch -d 2001-01-01 src && ln -sf src readme-link &&"
              " echo add > added.txt")
    res = sb.exec(script)
    assert res.ok, res.stderr
    sb.write_file("src/app.py", "overwritten\n")
    sb.write_file("deeper/new/file", "x")
    child = make_sandbox.track(sb.fork())
    child.exec("rm -rf src pkg && echo z > README.md")
    assert sb.diff() and child.diff()
    child.close()
    sb.close()
    assert host.tree_digest(snapshot) == before


def test_typed_errors(make_sandbox, snapshot, tmp_path) -> None:
    with pytest.raises(SnapshotMissing):
        make_sandbox(tmp_path / "does-not-exist")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(SnapshotMissing):
        make_sandbox(tmp_path / "a-file")

    sb = make_sandbox(snapshot)
    sb.close()
    assert sb.closed
    sb.close()  # idempotent
    for op in (lambda: sb.exec("true"), lambda: sb.read_file("README.md"),
               lambda: sb.write_file("x", "y"), sb.diff, sb.fork):
        with pytest.raises(SandboxClosed):
            op()
