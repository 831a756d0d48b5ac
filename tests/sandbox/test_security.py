"""Attacks from inside a bubblewrap sandbox, each checked ON THE HOST: no
file appeared, no connection arrived, no process survived or was signalled,
no secret came back. A failure here is an isolation hole, not a flaky test."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from atelier.sandbox.base import SandboxClosed, SandboxPathError
from atelier.sandbox.hostfs import python_executable, python_mounts, runtime_dir

pytestmark = [pytest.mark.usefixtures("bwrap_ready"), pytest.mark.timeout(60)]

PY = python_executable()  # usable inside with `ro_mounts=python_mounts()`


def outputs(*results) -> str:
    return "".join(r.stdout + r.stderr for r in results)


@pytest.fixture
def py_sandbox(make_sandbox, snapshot):
    """A sandbox that can run this interpreter (its prefix bound read-only)."""
    return make_sandbox(snapshot, ro_mounts=python_mounts())


@pytest.fixture
def host_dir(tmp_path: Path) -> Path:
    """A host directory with a secret in it, outside every sandbox."""
    d = tmp_path / "hostdir"
    d.mkdir()
    (d / "secret").write_text(f"HOST-SECRET-{uuid.uuid4().hex}\n")
    return d


# -- network -------------------------------------------------------------------

def test_no_outbound_network(py_sandbox) -> None:
    sandbox = py_sandbox
    connect = sandbox.exec([PY, "-c", "import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)"])
    assert connect.exit_code != 0 and "unreachable" in connect.stderr
    dns = sandbox.exec([PY, "-c", "import socket; print(socket.getaddrinfo('example.com', 80))"])
    assert dns.exit_code != 0 and "gaierror" in dns.stderr
    assert sandbox.exec("getent hosts example.com").exit_code != 0
    tcp = sandbox.exec(["bash", "-c", "echo > /dev/tcp/1.1.1.1/80"], timeout=5)
    assert tcp.exit_code != 0 and "connect: Network is unreachable" in tcp.stderr
    # On the host: the sandbox's network namespace is its own, with only a
    # loopback and no route anywhere.
    holder = sandbox._holder_pid
    assert os.readlink(f"/proc/{holder}/ns/net") != os.readlink("/proc/self/ns/net")
    devices = [line.split(":")[0].strip() for line in Path(f"/proc/{holder}/net/dev").read_text().splitlines()[2:]]
    assert devices == ["lo"]
    assert Path(f"/proc/{holder}/net/route").read_text().splitlines()[1:] == []


def test_host_loopback_and_abstract_sockets_unreachable(py_sandbox) -> None:
    sandbox = py_sandbox
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    port = tcp.getsockname()[1]
    name = f"atelier-test-{uuid.uuid4().hex}"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind("\0" + name)
    unix.listen(8)
    accepted: list[object] = []

    def accept_all(sock: socket.socket) -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(sock.accept())
            except (socket.timeout, OSError):
                pass

    stop = threading.Event()
    threads = [threading.Thread(target=accept_all, args=(s,), daemon=True) for s in (tcp, unix)]
    for t in threads:
        t.start()
    try:
        results = [
            sandbox.exec(["bash", "-c", f"echo hi > /dev/tcp/127.0.0.1/{port}"], timeout=5),
            sandbox.exec([PY, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"]),
            sandbox.exec([PY, "-c", f"import socket; s = socket.socket(socket.AF_UNIX); s.connect('\\0{name}')"]),
        ]
        assert all(r.exit_code != 0 for r in results), outputs(*results)
        assert "connect: Connection refused" in results[0].stderr  # the sandbox's own loopback
    finally:
        stop.set()
        for t in threads:
            t.join()
        # A connect that got through was queued before the exec that made it returned: a
        # non-blocking accept finds it now, with no waiting.
        for sock in (tcp, unix):
            sock.setblocking(False)
            try:
                accepted.append(sock.accept())
            except BlockingIOError:
                pass
        tcp.close()
        unix.close()
    assert accepted == []


# -- host files ----------------------------------------------------------------

def test_host_paths_are_not_writable(sandbox, snapshot, host_dir, host) -> None:
    tag = uuid.uuid4().hex
    targets = [host_dir / f"evil-{tag}", Path.home() / f"atelier-evil-{tag}",
               snapshot / f"evil-{tag}", snapshot / "pkg" / f"evil-{tag}",
               Path("/tmp") / f"atelier-evil-{tag}", runtime_dir() / f"evil-{tag}",
               Path("/") / f"atelier-evil-{tag}", Path("/etc") / f"atelier-evil-{tag}"]
    before = host.tree_digest(snapshot)
    for target in targets:
        # Creating the parent may work: it is the sandbox's own /tmp or
        # nothing; what matters is where the bytes land.
        sandbox.exec(f"mkdir -p '{target.parent}'; echo pwned > '{target}'")
    sandbox.exec(f"echo pwned >> '{host_dir}/secret'; rm -rf '{host_dir}' '{snapshot}/pkg'")
    sandbox.exec("for d in /.atelier/*; do echo pwned > $d/README.md; done")
    for target in targets:
        assert not target.exists(), f"the sandbox wrote {target} on the host"
    assert "pwned" not in (host_dir / "secret").read_text()
    assert host.tree_digest(snapshot) == before


def test_host_secrets_are_unreadable(sandbox, host_dir) -> None:
    secret = (host_dir / "secret").read_text().strip()
    home_secret = Path.home() / f".atelier-test-secret-{uuid.uuid4().hex}"
    home_secret.write_text(secret + "\n")
    try:
        results = [
            sandbox.exec(f"cat '{host_dir}/secret' '{home_secret}'"),
            sandbox.exec(f"ls -la '{host_dir}' '{Path.home()}' /root /home /var /run /mnt /opt /srv"),
            sandbox.exec("cat /proc/1/environ /proc/*/environ | tr '\\0' '\\n'"),
            sandbox.exec("grep -rs HOST-SECRET /tmp /workspace /etc /dev 2>/dev/null"),
            sandbox.exec(f"find / -name '{home_secret.name}' -not -path '/proc/*' 2>/dev/null"),
        ]
    finally:
        home_secret.unlink()
    assert secret not in outputs(*results)
    assert home_secret.name not in results[-1].stdout


def test_private_keys_of_the_host_are_not_bound(sandbox) -> None:
    # Certificates are bound so TLS tooling works; the private keys beside them never are.
    res = sandbox.exec("ls /etc/ssl/private /etc/pki/tls/private /etc/ssh 2>&1; ls /etc/ssl")
    assert "No such file" in res.stdout
    assert res.stdout.strip().splitlines()[-1] == "certs" or "certs" in res.stdout
    for host_private in ("/etc/ssl/private", "/etc/ssh"):
        if os.path.isdir(host_private):
            names = os.listdir(host_private)
            if names:
                probe = sandbox.exec(f"ls {host_private}/{names[0]}")
                assert probe.exit_code != 0


def test_host_environment_is_invisible(make_sandbox, snapshot, monkeypatch) -> None:
    value = f"host-env-{uuid.uuid4().hex}"
    monkeypatch.setenv("ATELIER_HOST_SECRET", value)
    sb = make_sandbox(snapshot)
    res = sb.exec("env; for f in /proc/[0-9]*/environ; do tr '\\0' '\\n' < $f; done")
    assert res.ok and "PATH=" in res.stdout
    assert value not in res.stdout and "ATELIER_HOST_SECRET" not in res.stdout


def test_symlinks_made_inside_do_not_reach_the_host(sandbox, host_dir) -> None:
    secret = (host_dir / "secret").read_text()
    # Inside, the host path means the sandbox's own /tmp; make it exist there
    # too, so that the links resolve.
    results = [
        sandbox.exec(f"ln -s '{host_dir}' link && ln -s '{host_dir}/secret' leak && ln -s / root"),
        sandbox.exec(f"echo pwned > link/evil; cat link/secret leak; mkdir -p '{host_dir}';"
                     f" echo inside > '{host_dir}/secret'; echo pwned > link/evil2"),
    ]
    # The host-side API never follows a link out of the workspace.
    with pytest.raises(SandboxPathError):
        sandbox.write_file("link/evil3", "pwned")
    with pytest.raises(SandboxPathError):
        sandbox.write_file("leak", "pwned")
    for path in ("link/secret", "leak", f"root{host_dir}/secret", "root/etc/passwd"):
        try:
            data = sandbox.read_file(path)
        except SandboxPathError:
            continue
        assert data != secret
    patch = sandbox.diff()
    assert secret not in outputs(*results) + patch
    assert sorted(os.listdir(host_dir)) == ["secret"]
    assert (host_dir / "secret").read_text() == secret


def test_symlinks_in_the_snapshot_do_not_reach_the_host(make_sandbox, tmp_path, host_dir, host) -> None:
    secret = (host_dir / "secret").read_text()
    snap = host.write_tree(tmp_path / "snap", {
        "a.txt": "a\n", "hostlink": f"->{host_dir}", "hostfile": f"->{host_dir}/secret",
    })
    sb = make_sandbox(snap)
    results = [sb.exec("cat hostfile hostlink/secret; echo pwned > hostlink/evil; echo pwned > hostfile")]
    with pytest.raises(SandboxPathError):
        sb.write_file("hostlink/evil2", "pwned")
    with pytest.raises(SandboxPathError):
        sb.write_file("hostfile", "pwned")
    for path in ("hostlink/secret", "hostfile"):
        with pytest.raises(SandboxPathError):
            sb.read_file(path)
    child = make_sandbox.track(sb.fork())
    results.append(child.exec("cat hostfile hostlink/secret"))
    assert secret not in outputs(*results) + sb.diff() + child.diff()
    assert sorted(os.listdir(host_dir)) == ["secret"]
    assert (host_dir / "secret").read_text() == secret


def test_special_files_do_not_hang_the_host(sandbox) -> None:
    assert sandbox.exec("mkfifo fifo && ln -s fifo fifolink && mkdir d && ln -s d dirlink").ok
    for path in ("fifo", "fifolink", "d", "dirlink"):
        with pytest.raises(SandboxPathError):
            sandbox.read_file(path)
    for path in ("fifo", "fifolink", "d", "dirlink"):
        with pytest.raises(SandboxPathError):
            sandbox.write_file(path, "x")
    patch = sandbox.diff()  # a FIFO is not a file to diff; the links are
    assert "a/fifo b/fifo" not in patch and "b/fifolink\nnew file mode 120000" in patch
    # A hang here would be caught by the suite's per-test timeout; no wall-clock bound.


# -- processes -----------------------------------------------------------------

def sigkilled(pid: int) -> bool:
    """Whether `pid` is dying from a SIGKILL: pending (to the thread or the process) or already a zombie."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return fields["State"].strip()[:1] in "ZX" or bool(pending & (1 << (9 - 1)))


# A bomb that never gives up: a process whose fork fails retries. bash's
# `:(){ :|:& };:` is not one: each bash retries a failed fork a few times and
# exits, so where a pids cgroup and RLIMIT_NPROC both stop it the whole bomb
# can collapse within a second of reaching the cap, before the host looks;
# and while its last members are still retrying they hold the cap, so no
# command can start in that sandbox (a test that ran it first and then this
# one failed whenever the machine was slow).
PERSISTENT_BOMB = """
import os, time
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
"""


def test_fork_bomb_is_contained(make_sandbox, snapshot, host) -> None:
    sb = make_sandbox(snapshot, max_processes=64, timeout_s=5, ro_mounts=python_mounts())
    sb.write_file("bomb.py", PERSISTENT_BOMB)
    sb.exec(f"{PY} bomb.py > /dev/null 2>&1 &", timeout=5)
    counts: list[int] = []

    def filled() -> bool:  # every look is within the cap; done once the bomb has filled it
        counts.append(len(host.sandbox_procs(sb)))
        return counts[-1] >= 64 - 8

    assert host.wait_until(filled, timeout=30), f"the bomb never filled its cap: {counts[-5:]}"
    counts += [len(host.sandbox_procs(sb)) for _ in range(20)]  # and it keeps trying at the cap
    assert max(counts) <= 64 + 2, counts
    assert subprocess.run(["true"], timeout=5).returncode == 0  # the host still forks
    procs = host.sandbox_procs(sb)
    sb.close()
    assert host.wait_until(lambda: not host.alive(procs), timeout=30)


def test_memory_bomb_ends(make_sandbox, snapshot) -> None:
    sb = make_sandbox(snapshot, memory_mb=256, ro_mounts=python_mounts())
    res = sb.exec([python_executable(), "-c",
                   "x = []\nwhile True: x.append(bytearray(16 * 1024 * 1024))"], timeout=20)
    assert not res.timed_out and res.exit_code != 0
    assert "MemoryError" in res.stderr or res.exit_code == 137
    # The host can still allocate and fork; the sandbox still works.
    assert len(bytearray(256 * 1024 * 1024)) == 256 * 1024 * 1024
    assert subprocess.run(["true"], timeout=5).returncode == 0
    assert sb.exec("echo alive").stdout == "alive\n"


def test_sleep_past_timeout_is_killed(sandbox, host) -> None:
    res = sandbox.exec("sleep 30.5", timeout=0.5)
    assert res.timed_out and res.exit_code == 124

    def sleeping() -> bool:
        return any(host.cmdline(pid) == "sleep 30.5" for pid, _ in host.alive(host.sandbox_procs(sandbox)))

    assert host.wait_until(lambda: not sleeping(), timeout=3)


def test_no_process_survives_close(sandbox, host) -> None:
    res = sandbox.exec("sleep 300 & setsid sh -c 'sleep 301 & exit' & "
                       "nohup sleep 302 >/dev/null 2>&1 & "
                       "unshare -U -p -f sleep 303 >/dev/null 2>&1 & "
                       "echo ok")
    assert res.stdout == "ok\n"
    # 303 runs in a nested PID namespace of the sandbox's.
    expected = {"sleep 300", "sleep 301", "sleep 302", "sleep 303"}
    assert host.wait_until(lambda: expected <= {host.cmdline(p) for p, _ in host.sandbox_procs(sandbox)})
    procs = host.sandbox_procs(sandbox)
    sandbox.close()
    assert host.wait_until(lambda: not host.alive(procs)), \
        [host.cmdline(pid) for pid, _ in host.alive(procs)]


def test_host_processes_are_invisible_and_unsignalable(make_sandbox, snapshot) -> None:
    victim = subprocess.Popen(["sleep", "61.25"])
    try:
        sb = make_sandbox(snapshot)
        listed = sb.exec("ps ax; ls /proc")
        pids = [int(p) for p in sb.exec("ls /proc").stdout.split() if p.isdigit()]
        assert len(pids) < 10 and "61.25" not in listed.stdout
        assert os.getpid() not in pids and victim.pid not in pids
        assert sb.exec(f"kill -9 {victim.pid}").exit_code != 0
        assert sb.exec(f"kill -9 {os.getpid()}").exit_code != 0
        # Killing everything it can see takes the sandbox down with it, and
        # nothing else.
        sb.exec("kill -9 -1")
        # kill(2) had marked its targets before the exec returned: no wait needed to see it.
        assert victim.poll() is None and not sigkilled(victim.pid)
    finally:
        victim.kill()
        victim.wait()


def test_a_dead_sandbox_refuses_commands(make_sandbox, snapshot) -> None:
    """Once a command kills the holder, its host pid is free for reuse: a
    later exec must not enter whatever process gets it."""
    sb = make_sandbox(snapshot)
    sb.exec("echo kept > kept.txt; kill -9 -1")
    assert sb._proc.wait(timeout=5) is not None
    with pytest.raises(SandboxClosed):
        sb.exec("true")
    assert sb.read_file("kept.txt") == "kept\n"
    child = make_sandbox.track(sb.fork())
    assert child.exec("cat kept.txt").stdout == "kept\n"


# -- privileges ----------------------------------------------------------------

def test_root_filesystem_is_read_only(sandbox) -> None:
    tag = uuid.uuid4().hex
    targets = [f"/atelier-{tag}", f"/usr/atelier-{tag}", f"/etc/atelier-{tag}", f"/usr/bin/atelier-{tag}"]
    for target in targets:
        res = sandbox.exec(f"touch {target}")
        assert res.exit_code != 0 and "Read-only file system" in res.stderr
    assert sandbox.exec("mount -o remount,rw /").exit_code != 0
    assert sandbox.exec("chmod 755 /.atelier").exit_code != 0
    assert sandbox.exec("ls /.atelier").exit_code != 0
    for target in targets:
        assert not os.path.exists(target)


def test_no_capabilities(sandbox, host) -> None:
    status = sandbox.exec("grep -E '^(Cap|NoNewPrivs)' /proc/self/status").stdout
    caps = dict(line.split(":\t") for line in status.splitlines())
    assert set(caps) == {"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs"}
    assert all(v == "0000000000000000" for k, v in caps.items() if k != "NoNewPrivs")
    assert caps["NoNewPrivs"] == "1"
    # The same, read on the host from a process the sandbox left running.
    pid = background_pid(sandbox, host, "sleep 60.75")
    host_status = status_of(pid)
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(host_status[key], 16) == 0
    assert host_status["NoNewPrivs"] == "1"
    assert os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user")


def test_commands_are_not_host_root(sandbox, host) -> None:
    """Seen from the host, a sandbox's processes (the holder and every
    command) hold no id of root's: no uid, gid or supplementary group 0, when
    atelier runs as root as much as for an ordinary user."""
    status = status_of(background_pid(sandbox, host, "sleep 60.5"))
    for key in ("Uid", "Gid"):
        assert "0" not in status[key].split(), status[key]
    assert "0" not in status["Groups"].split(), status["Groups"]
    for pid in (sandbox._init_pid, sandbox._holder_pid):
        assert "0" not in status_of(pid)["Uid"].split()
    if os.geteuid() == 0:
        assert status["Uid"].split() == [str(sandbox.config.root_maps_to)] * 4
    inside = sandbox.exec("id -u; id -g").stdout.split()
    assert inside == ["0", "0"]  # still root inside, so tools behave as in a container


def background_pid(sb, host, command: str) -> int:
    """The host pid of `command`, started in the background in `sb`."""
    sb.exec(f"{command} >/dev/null 2>&1 &")

    def found() -> list[int]:
        return [pid for pid, _ in host.sandbox_procs(sb) if host.cmdline(pid) == command]

    assert host.wait_until(lambda: bool(found()))
    return found()[0]


def status_of(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_kernel_settings_are_read_only(sandbox) -> None:
    """When atelier runs as root, the sandbox's uid 0 is host uid 0, and the
    kernel lets uid 0 write sysctls without any capability: a `|program`
    core_pattern would run as root on the host. (The value tried here is
    inert, and put back if the attempt succeeds.)"""
    pattern = Path("/proc/sys/kernel/core_pattern").read_text()
    try:
        res = sandbox.exec("echo core.atelier-test > /proc/sys/kernel/core_pattern")
        assert res.exit_code != 0 and "Read-only file system" in res.stderr
        assert sandbox.exec("test -w /proc/sysrq-trigger || test -w /proc/sys/kernel").exit_code != 0
    finally:
        if Path("/proc/sys/kernel/core_pattern").read_text() != pattern:
            Path("/proc/sys/kernel/core_pattern").write_text(pattern)
            pytest.fail("the sandbox changed the host's kernel.core_pattern")
    assert Path("/proc/sys/kernel/core_pattern").read_text() == pattern
