"""Fixtures for the bubblewrap sandbox tests: a small snapshot tree, sandboxes
that are always closed, and host-side views of a sandbox (its processes, a
tree's exact state) so that tests can check on the host what happened."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import Iterator

import pytest

from atelier.sandbox.base import SandboxConfig
from tests.helpers import wait_until

HostProc = tuple[int, int]
"""A host process as (pid, start time in clock ticks): a pid alone may be reused."""


def write_tree(root: Path, files: dict[str, bytes | str]) -> Path:
    """Create `files` under `root`; a value starting with "->" makes a symlink,
    a path ending in "*" an executable file."""
    for rel, content in files.items():
        executable = rel.endswith("*")
        path = root / rel.rstrip("*")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str) and content.startswith("->"):
            path.symlink_to(content[2:])
            continue
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        if executable:
            path.chmod(0o755)
    return root


SNAPSHOT_FILES: dict[str, bytes | str] = {
    "README.md": "# demo\n\nA small project.\n",
    "src/app.py": "def main():\n    return 1\n\n\nif __name__ == '__main__':\n    main()\n",
    "pkg/__init__.py": "",
    "pkg/mod.py": "VALUE = 1\n",
    "pkg/sub/deep.txt": "deep\n",
    "data.bin": bytes(range(256)) * 4,
    "run.sh*": "#!/bin/sh\necho run\n",
    "readme-link": "->README.md",
}


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    """A small repository checkout: text, binary, executable, symlink, nested dirs."""
    return write_tree(tmp_path / "snapshot", SNAPSHOT_FILES)


@pytest.fixture
def hello_repo(tmp_path: Path, bwrap_ready: None) -> Path:
    """The smallest repository: one text file."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "hello.txt").write_text("hello\n")
    return repo


def _mount_root(path: Path) -> str:
    """`path` as it appears in the root column of /proc/PID/mountinfo when
    bound: relative to the root of the filesystem that holds it."""
    best = ("", "/")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        root, point = fields[3], fields[4]
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, root)
    point, root = best
    return (root.rstrip("/") + "/" + str(path)[len(point):].lstrip("/")).rstrip("/") or "/"


def snapshot_processes(snapshot: Path) -> list[int]:
    """Running (not zombie) processes that have the snapshot mounted: the
    processes of sandboxes over it. (Their command lines need not name it:
    root's sandboxes bind it from a staging directory.)"""
    wanted = _mount_root(snapshot)
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            mounts = (proc / "mountinfo").read_text().splitlines()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z" and any(line.split()[3] == wanted for line in mounts):
            pids.append(int(proc.name))
    return pids


class Sandboxes:
    """Creates bubblewrap sandboxes and closes every one at the end of the test
    (forks too, once passed to `track`)."""

    def __init__(self) -> None:
        self.open: list = []

    def __call__(self, snapshot: Path, **config: object):
        from atelier.sandbox.bwrap import BwrapSandbox

        config.setdefault("timeout_s", 10)
        return self.track(BwrapSandbox(snapshot, SandboxConfig(**config)))

    def track(self, sandbox):
        self.open.append(sandbox)
        return sandbox

    def close_all(self) -> None:
        for sandbox in reversed(self.open):
            sandbox.close()


@pytest.fixture
def make_sandbox(bwrap_ready: None) -> Iterator[Sandboxes]:
    sandboxes = Sandboxes()
    try:
        yield sandboxes
    finally:
        sandboxes.close_all()


@pytest.fixture
def sandbox(make_sandbox: Sandboxes, snapshot: Path):
    return make_sandbox(snapshot)


# -- host-side views -----------------------------------------------------------

def tree_digest(root: Path) -> dict[str, tuple]:
    """Everything observable about a tree, seen from the host: each entry's
    type, mode, size, mtime, content hash or link target."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                what = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                what = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            else:
                what = ""
            out[os.path.relpath(path, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, what)
    st = os.lstat(root)
    out["."] = (st.st_mode, st.st_mtime_ns)
    return out


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def sandbox_host_procs(sb) -> set[HostProc]:
    """Every host process of a live sandbox: those in its PID namespace and
    all descendants of its init (which covers nested namespaces)."""
    ns = os.readlink(f"/proc/{sb._holder_pid}/ns/pid")
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    parents = {p: _parent(p) for p in pids}
    found: set[int] = set()
    for pid in pids:
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == ns:
                found.add(pid)
                continue
        except OSError:
            continue
        p = parents.get(pid)
        while p not in (None, 0, 1):
            if p == sb._init_pid:
                found.add(pid)
                break
            p = parents.get(p)
    return {(pid, t) for pid in found if (t := _start_time(pid)) is not None}


def alive(procs: set[HostProc]) -> set[HostProc]:
    """The processes of `procs` that still exist and are not zombies."""
    out = set()
    for pid, start in procs:
        if _start_time(pid) != start:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):  # it exited between the two reads
            continue
        if state not in ("Z", "X"):
            out.add((pid, start))
    return out


class Host:
    """The helpers above, for tests (a fixture, so no test imports conftest)."""

    write_tree = staticmethod(write_tree)
    tree_digest = staticmethod(tree_digest)
    sandbox_procs = staticmethod(sandbox_host_procs)
    alive = staticmethod(alive)
    cmdline = staticmethod(cmdline)
    wait_until = staticmethod(wait_until)
    snapshot_processes = staticmethod(snapshot_processes)


@pytest.fixture
def host() -> type[Host]:
    return Host


# -- running as an ordinary user -------------------------------------------------

NOBODY = 65534


def _readable_by_all(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [path, *path.parents])


class Nobody:
    """Runs a Python script as uid/gid `NOBODY` (the suite runs as root, as CI
    does), with an interpreter of this version and the project's sources,
    both readable by everyone; `prefix` runs first, as root (e.g. joining a
    cgroup), then `setpriv` drops. Skips where no such interpreter exists."""

    def __init__(self) -> None:
        import sys
        import sysconfig

        import atelier

        self.src = Path(atelier.__file__).resolve().parents[1]
        self.site = Path(sysconfig.get_paths()["purelib"])
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        candidates = [Path(sys.executable).resolve(), Path("/usr/bin") / version, Path("/usr/local/bin") / version]
        self.python = next((p for p in candidates if p.exists() and _readable_by_all(p.parent)), None)
        if self.python is None or not all(_readable_by_all(p) for p in (self.src, self.site)):
            pytest.skip("no interpreter and sources readable by an unprivileged user here")

    def run(self, work: Path, script: str, *, prefix: str = "", timeout: float = 120):
        import subprocess

        os.chmod(work, 0o755)
        (work / "run.py").write_text(script)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(work)], check=True)
        drop = f"exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups {self.python} run.py"
        return subprocess.run(
            ["/bin/sh", "-c", f"{prefix}\n{drop}"], cwd=work, capture_output=True, text=True, timeout=timeout,
            env={"PYTHONPATH": f"{self.src}:{self.site}", "PATH": "/usr/bin:/bin", "TMPDIR": str(work),
                 "HOME": str(work)},
        )


@pytest.fixture
def nobody() -> Nobody:
    if os.geteuid() != 0:
        pytest.skip("already unprivileged: the other tests cover it")
    if shutil.which("bwrap") is None or shutil.which("setpriv") is None:
        pytest.skip("bubblewrap or setpriv is not installed")
    return Nobody()
