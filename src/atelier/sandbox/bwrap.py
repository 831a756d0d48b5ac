"""The bubblewrap sandbox: what is isolated, and what is not.

A sandbox is a bubblewrap process holding a set of fresh Linux namespaces
(user, mount, PID, network, IPC, UTS, cgroup). Every `exec` enters those
namespaces with `nsenter`, drops every capability (`setpriv`), applies resource
limits (`prlimit`) and runs the command in `/workspace`.

Isolated:
- Filesystem. The root is an empty tmpfs that is remounted read-only. The
  host's `/usr` (and its top-level links), a short list of `/etc` entries and
  any `ro_mounts` are bound read-only; home directories, `/tmp`, `/root`, `/var`,
  `/run` and every other host path are absent (see `hostfs`). `/workspace` is an
  overlay: the snapshot is its read-only lower layer, writes go to an upper
  layer on a tmpfs of `disk_mb`, so the snapshot is never modified and creating
  a sandbox costs the same for 100 or 10,000 files. `/tmp` is a tmpfs of
  `disk_mb` too.
- Network. With `network="none"` (the default) the sandbox has its own
  network namespace with only a loopback: no route out, no DNS, and the host's
  loopback listeners are unreachable. `network="proxy"` keeps that namespace
  and adds one way out: an HTTP(S) proxy on the host, reached through a Unix
  socket bound in and a loopback port, that lets through only the
  `egress.allow` host:port pairs and logs every attempt (see `egress`).
  `network="host"` shares the host's network and logs a warning.
- Processes. Its own PID namespace: host processes are invisible and cannot be
  signalled. `close()` kills the namespace's init, and the kernel then kills
  every process in it, daemons that double-forked and called `setsid`
  included.
- Privileges. Commands run with no capabilities and `no_new_privs`; inside
  they are uid 0, which the host sees as:
  - for an ordinary user: that user (bwrap maps only that uid), with the
    user's supplementary groups (an unprivileged process cannot drop them);
    so a sandbox can read no more of the bound host files than its user can;
  - for root: the unprivileged host uid and gid `root_maps_to`, with no
    supplementary groups (see `rootmap`). Every process of the sandbox, its
    holder included, is that id: files only root may read in the bound
    system directories are unreadable, `/proc/sys` is not writable (it is
    also bound read-only), and no host process can be signalled. The
    snapshot is bound idmapped, so that its files appear to belong to the
    sandbox's root and the overlay can copy them up; without idmapped mounts
    (Linux < 5.19, or a filesystem that lacks them) the workspace is a copy.
- Environment. Commands get an explicit environment (PATH, HOME=/tmp,
  LANG, plus `env`); no host variable leaks in.
- Resources. Per sandbox: memory (`memory_mb`: a memory cgroup where one
  is writable, as root or with a delegated cgroup; else the host's memory
  watchdog over the sum of its processes, see `memory`), process count
  (RLIMIT_NPROC counts per user namespace; where writable, also a pids
  cgroup, see `cgroups`), bytes written (tmpfs size). Per process: address
  space (`memory_mb`, only without a memory cgroup), file size, open files
  and CPU time. Per `exec`: a wall-clock timeout that kills the process
  group, and an output cap.

Not isolated:
- The kernel is shared: a kernel exploit escapes, as from any container.
  Firecracker-class isolation needs a VM.
- Memory, as root (a memory cgroup): exact for the whole sandbox; RLIMIT_AS
  is not set (it counts reserved address space, not memory, and would fail
  allocations before the cgroup could act); a process killed for passing
  `memory_mb` sets `ExecResult.oom_killed` (compared `oom_kill` counts, see
  `cgroups`). As an ordinary user without a delegated cgroup: one process
  cannot pass `memory_mb` (RLIMIT_AS; its allocation fails inside it, which
  is not reported as a kill), and the watchdog kills the largest process
  once the sandbox's processes together pass it (reported as `oom_killed`),
  so the sum can pass the limit only by what is allocated within one
  interval of 50 ms; kernel memory and page cache are not counted (see
  `memory`).
- CPU time is limited per process, not shared fairly between sandboxes.
- `fork()` copies files, not running processes or their memory.
- Read-only host files that are bound (the system directories) can be read.

Snapshots: one directory tree on one filesystem. One that holds mount points
or lies on a kernel pseudo-filesystem is refused (`SnapshotUnusable`); sockets,
FIFOs, device files and unreadable files stay in the overlay as on the host;
a copy names what it cannot take (see `atelier.sandbox.snapshot`).

Fallback: where the kernel refuses an overlay mount inside a user namespace
(Linux < 5.11, or a filesystem without user xattrs), the workspace is a copy
of the snapshot in the sandbox's tmpfs. Creation, fork and diff then cost time
proportional to the repository's size, and a warning says so once. The same
copy is used when the snapshot belongs to another user or group: inside a user
namespace only your own ids are mapped, and an overlay cannot copy up a file
whose owner is unmapped (EOVERFLOW).
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any

from atelier.sandbox import diff as diffs
from atelier.sandbox import egress, fsutil, memory
from atelier.sandbox.base import (
    WORKDIR,
    Command,
    ExecResult,
    MiB,
    OutputCallback,
    Sandbox,
    SandboxClosed,
    SandboxConfig,
    SandboxError,
    SandboxLimitExceeded,
    SandboxPathError,
    SandboxUnavailable,
    SnapshotMissing,
    command_argv,
    workspace_relpath,
)
from atelier.sandbox.cgroups import SandboxCgroup
from atelier.sandbox.hostfs import SANDBOX_PATH, generated_etc_files, runtime_dir, system_bind_args
from atelier.sandbox.layers import Layer
from atelier.sandbox.process import run_process
from atelier.sandbox.rootmap import Stage, acting_as, check_mapped, running_as_root
from atelier.sandbox.snapshot import check_snapshot, copy_failure

log = logging.getLogger(__name__)

REQUIRED_TOOLS = ("bwrap", "nsenter", "setpriv", "prlimit")

# The sandbox's first process: mount the overlay (or fall back to a copy),
# keep the upper layer as its working directory so the host can reach it
# through /proc/PID/cwd, then wait on stdin with the shell's own `read` (no
# extra program to start): when the host closes the pipe or dies, it exits and
# the kernel ends the whole PID namespace.
COPY_FAILED = 97  # the holder's exit status when it cannot copy the snapshot
INSIDE_COPY = re.compile(r"^/\.atelier/(?:rw/upper|lower\d+)/(?:\./)?")  # the paths its cp names
HOLDER_SCRIPT = r"""
rw=/.atelier/rw
if [ "$2" = overlay ] && mount -t overlay overlay -o "lowerdir=$1,upperdir=$rw/upper,workdir=$rw/work,userxattr" /workspace 2>$rw/mount.err; then
  mode=overlay
else
  cp -a --no-preserve=ownership "${1%%:*}/." "$rw/upper/" || exit 97
  mount --bind "$rw/upper" /workspace || exit 98
  mode=copy
fi
cd "$rw/upper" || exit 96
echo "ready $mode"
read -r _ || true
"""  # noqa: E501 (a shell line)

_live: "weakref.WeakSet[BwrapSandbox]" = weakref.WeakSet()


def check_available() -> None:
    """Raise `SandboxUnavailable` naming what is missing and how to get it."""
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        raise SandboxUnavailable(
            f"bubblewrap sandboxes need {', '.join(missing)}, not found on PATH",
            hint="install them (Debian/Ubuntu: apt-get install bubblewrap util-linux), "
            "or use the `local` backend, which isolates nothing",
        )


class BwrapSandbox(Sandbox):
    def __init__(self, snapshot: str | os.PathLike, config: SandboxConfig | None = None,
                 *, _layers: list[Layer] | None = None) -> None:
        check_available()
        self.config = config or SandboxConfig()
        self.snapshot = Path(snapshot).resolve()
        if not self.snapshot.is_dir():
            raise SnapshotMissing(
                f"snapshot directory {str(snapshot)!r} does not exist",
                hint="pass the path of a repository checkout to create the sandbox from",
            )
        check_snapshot(self.snapshot)
        if self.config.network == "host":
            log.warning("sandbox over %s shares the HOST network (network='host')", self.snapshot)
        self.name = f"{self.snapshot.name}-{uuid.uuid4().hex[:8]}"
        self._proxy: egress.EgressProxy | None = None
        self._forwarder: egress.LoopbackForwarder | None = None
        # Layers frozen by fork(), topmost first; the snapshot is the bottom.
        self._layers = list(_layers or [])
        for layer in self._layers:
            layer.acquire()
        self._lock = threading.Lock()
        self._closed = False
        # Root's sandboxes run as this unprivileged host id (see `rootmap`).
        self._host_id = self.config.root_maps_to if running_as_root() else None
        if self._host_id is not None:
            check_mapped(self._host_id)
        # A cgroup wherever one is writable (root; a user with a delegated
        # cgroup); otherwise the memory watchdog (see `memory`).
        self._cgroup = SandboxCgroup(self.config.max_processes, self.config.memory_mb * MiB)
        self._watch: memory.Watch | None = None
        try:
            self._start()
        except BaseException:
            self._release()
            raise
        _live.add(self)

    # -- lifecycle -------------------------------------------------------
    def _bwrap_argv(self) -> list[str]:
        cfg = self.config
        stage = self._stage = Stage(self._host_id)
        size = str(cfg.disk_mb * MiB)
        argv = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--uid", "0", "--gid", "0",
                # For the holder only (mounting the overlay, entering /.atelier);
                # every exec drops all capabilities.
                "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_DAC_OVERRIDE",
                "--hostname", "sandbox", "--new-session", "--clearenv", "--setenv", "PATH", SANDBOX_PATH]
        if cfg.network != "host":
            argv.append("--unshare-net")
        argv += system_bind_args()
        for src, dest in generated_etc_files():
            argv += ["--ro-bind", stage.source(src), dest]
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--dir", WORKDIR]
        # bwrap covers /proc/sys only when the directory is writable, which it
        # never is; its files are writable by host uid 0. The sandbox's uid 0
        # is never host uid 0 (see `rootmap`); this is a second wall, should it
        # ever be (kernel.core_pattern would run a program as root on the host).
        argv += ["--ro-bind", "/proc/sys", "/proc/sys"]
        # Mode 000 on a read-only root: commands (no capabilities) cannot enter
        # the layers' directory or change its mode; only the holder can.
        argv += ["--perms", "0000", "--dir", "/.atelier"]
        lowers = []
        for i, path in enumerate([*(layer.path for layer in self._layers), self.snapshot]):
            # Layers belong to the sandbox's id already (copies of an upper
            # layer); the snapshot's owner is mapped to it.
            argv += ["--ro-bind", stage.source(path, idmap=path == self.snapshot), f"/.atelier/lower{i}"]
            lowers.append(f"/.atelier/lower{i}")
        argv += ["--size", size, "--tmpfs", "/.atelier/rw", "--dir", "/.atelier/rw/upper",
                 "--dir", "/.atelier/rw/work"]
        for spec in cfg.ro_mounts:
            src, _, dest = spec.partition(":")
            argv += ["--ro-bind", stage.source(src), dest or src]
        if self._proxy is not None:
            argv += ["--ro-bind", stage.source(self._proxy.path), egress.SOCKET_INSIDE]
        argv += ["--remount-ro", "/", "--chdir", "/",
                 "/bin/sh", "-c", HOLDER_SCRIPT, "atelier-holder", ":".join(lowers), self._requested_mode]
        argv = stage.launch(argv, copy_index=len(argv) - 1)
        return self._cgroup.wrap(argv) if self._cgroup else argv

    def _workspace_mode(self) -> str:
        if self.config.workspace == "copy":
            return "copy"
        if self._host_id is not None:
            return "overlay"  # the snapshot's owner is mapped (the stager falls back to copy)
        st = self.snapshot.stat()
        if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
            _warn_once(f"snapshot {self.snapshot} belongs to another user or group: its files "
                       "could not be changed through an overlay here, so sandboxes copy it "
                       "(cost grows with its size)")
            return "copy"
        return "overlay"

    def _start(self) -> None:
        self._requested_mode = self._workspace_mode()
        for spec in self.config.ro_mounts:
            if not os.path.exists(spec.partition(":")[0]):
                raise SandboxError(f"read-only mount source {spec.partition(':')[0]!r} does not exist",
                                   hint="fix the path in `ro_mounts`")
        if self.config.network == "proxy":
            sock = runtime_dir() / f"egress-{self.name[-8:]}.sock"
            self._proxy = egress.EgressProxy(self.config.egress, sock, self.name)
        argv = self._bwrap_argv()
        self._proc = self._stage.spawn(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env={"PATH": os.environ.get("PATH", SANDBOX_PATH)},
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        try:
            line = self._proc.stdout.readline().decode().split()
        finally:
            self._stage.release()  # bwrap has made its own mounts, or failed
        if not line or line[0] != "ready":
            self._proc.kill()
            err = self._proc.communicate()[1].decode(errors="replace").strip()
            if self._proc.returncode == COPY_FAILED:
                raise copy_failure(self.snapshot, err, self.config.disk_mb, INSIDE_COPY)
            raise SandboxUnavailable(
                f"bubblewrap could not create a sandbox: {err or 'no output'}",
                hint="unprivileged user namespaces must be enabled "
                "(sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ also "
                "kernel.apparmor_restrict_unprivileged_userns=0), or use the `local` backend",
            )
        self.mode = line[1]
        if self.mode == "copy" and self._requested_mode == "overlay":
            _warn_once("overlayfs is not available inside user namespaces here: sandboxes copy "
                       "the snapshot, so creating and forking cost time proportional to its size")
        # Host pids: bwrap (outside) -> bwrap as PID 1 (inside) -> holder.
        self._init_pid = _only_child(self._proc.pid)
        self._holder_pid = _only_child(self._init_pid)
        root_fd = os.open(f"/proc/{self._holder_pid}/root", os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._ws_fd = os.open("workspace", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        finally:
            os.close(root_fd)
        self._upper_fd = os.open(f"/proc/{self._holder_pid}/cwd", os.O_RDONLY | os.O_DIRECTORY)
        if not self._cgroup.limits_memory:
            self._watch = memory.WATCHDOG.watch(self.config.memory_mb * MiB, [self._init_pid])
        if self._proxy is not None:
            listener = egress.listen_inside(self._holder_pid, self.config.egress.port)
            self._forwarder = egress.LoopbackForwarder(listener, self._proxy.path, self.name)

    @property
    def memory_enforcement(self) -> str:
        """`cgroup` or `watchdog`: how `memory_mb` is enforced (see `memory`)."""
        return "cgroup" if self._cgroup.limits_memory else "watchdog"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            # Killing the namespace's PID 1 makes the kernel kill every process in it.
            os.kill(self._init_pid, signal.SIGKILL)
        except (ProcessLookupError, AttributeError):
            pass
        proc = getattr(self, "_proc", None)
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe:
                    pipe.close()
        for fd in (getattr(self, "_ws_fd", None), getattr(self, "_upper_fd", None)):
            if fd is not None:
                os.close(fd)
        self._release()
        _live.discard(self)

    def _release(self) -> None:
        for server in (self._forwarder, self._proxy):
            if server is not None:
                server.close()
        if self._proxy is not None:
            self._proxy.path.unlink(missing_ok=True)
        self._forwarder = self._proxy = None
        for layer in self._layers:
            layer.release()
        self._layers = []
        if self._watch is not None:
            memory.WATCHDOG.unwatch(self._watch)
            self._watch = None
        self._cgroup.remove()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed("the sandbox is closed", hint="create a new sandbox or fork before closing")

    # -- commands --------------------------------------------------------
    def exec(self, cmd: Command, timeout: float | None = None, *, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: bytes | None = None,
             on_output: OutputCallback | None = None) -> ExecResult:
        self._check_open()
        if self._proc.poll() is not None:
            # A command killed the holder (`kill -9 -1`, `pkill cat`): its host
            # pid may now belong to another process, whose namespaces nsenter
            # would enter.
            raise SandboxClosed("the sandbox has died: a command killed its processes",
                                hint="close it and create a new sandbox; its files can still be read")
        cfg = self.config
        argv = command_argv(cmd)
        if cwd is not None:
            rel = workspace_relpath(cwd)
            if rel:
                argv = ["/bin/sh", "-c", 'cd -- "$0" || exit 125; exec "$@"', f"{WORKDIR}/{rel}", *argv]
        # An ordinary user already is the sandbox's uid 0 and keeps its ids;
        # root lets nsenter drop its groups and become uid/gid 0 of the
        # sandbox's namespace, i.e. the unprivileged host id.
        keep_ids = ["--preserve-credentials"] if self._host_id is None else []
        cgroup_memory = self._cgroup.limits_memory
        full = [
            "nsenter", "-t", str(self._holder_pid), "-U", "-m", "-n", "-p", "-i", "-u", "-C",
            *keep_ids, "-r", f"--wd=/proc/{self._holder_pid}/root{WORKDIR}",
            "--",
            "setpriv", "--no-new-privs", "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all",
            "--",
            "prlimit", f"--as={'unlimited' if cgroup_memory else cfg.memory_mb * MiB}",
            f"--nproc={cfg.max_processes}",
            f"--fsize={cfg.max_file_mb * MiB}", f"--nofile={cfg.max_open_files}",
            f"--cpu={cfg.cpu_time_s}", "--",
            *argv,
        ]
        full = self._cgroup.wrap(full)
        proxy = egress.proxy_env(cfg.egress.port) if cfg.network == "proxy" else {}
        run_env = {"PATH": SANDBOX_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb",
                   "TMPDIR": "/tmp", **proxy, **cfg.env, **(env or {})}
        return self._run_counting_kills(full, env=run_env, timeout=timeout or cfg.timeout_s,
                                        output_limit=cfg.output_limit_bytes, stdin=stdin, on_output=on_output)

    def _run_counting_kills(self, argv: list[str], **run: Any) -> ExecResult:
        """`run_process`, and who killed a process of the sandbox for memory
        meanwhile, if anyone did (`memory.attribute_kill`)."""
        cgroup_memory, watch = self._cgroup.limits_memory, self._watch

        def counts() -> tuple[int | None, int | None, int | None]:
            kills, hits = self._cgroup.oom_counts() if cgroup_memory else (watch.kills if watch else None, None)
            return kills, hits, memory.host_oom_kills()

        if cgroup_memory:
            self._cgroup.reset_peak()
        before = counts()
        started: list[int] = []

        def on_start(pid: int) -> None:
            started.append(pid)
            if watch is not None:
                watch.add_root(pid)  # the command's processes are its descendants

        try:
            res = run_process(argv, cwd=None, on_start=on_start, **run)
        finally:
            if watch is not None and started:
                watch.discard_root(started[0])
        after = counts()
        who = memory.attribute_kill(res.exit_code, (before[0], after[0]),
                                    (before[1], after[1]) if cgroup_memory else None, (before[2], after[2]))
        if who is not None:
            res = dataclasses.replace(res, oom_killed=who == "sandbox", host_oom_killed=who == "host")
        return res

    # -- files -----------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        self._check_open()
        rel = workspace_relpath(path)
        try:
            return fsutil.read_beneath(self._ws_fd, rel)
        except FileNotFoundError:
            raise SandboxPathError(f"no such file in the workspace: {rel!r}",
                                   hint="list the directory to see what is there") from None
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise SandboxPathError(f"cannot read {rel!r}: {exc.strerror}") from None
            # A symlink on the path: resolve it inside the sandbox, never on the
            # host, then read the target without following links; it must be a
            # regular file in the workspace. (Reading through `cat` would block
            # on a FIFO and mangle binary or large files.)
            res = self.exec(["realpath", "-e", "--", f"{WORKDIR}/{rel}"], timeout=10)
            target = res.stdout.rstrip("\n")
            if res.exit_code != 0 or not target.startswith(WORKDIR + "/"):
                raise SandboxPathError(f"cannot read {rel!r}: no such file in the workspace "
                                       "(symlinks are resolved inside the sandbox)") from None
            try:
                return fsutil.read_beneath(self._ws_fd, workspace_relpath(target))
            except OSError as exc2:
                raise SandboxPathError(f"cannot read {rel!r}: {exc2.strerror}") from None

    def write_bytes(self, path: str, data: bytes) -> None:
        self._check_open()
        rel = workspace_relpath(path)
        if not rel:
            raise SandboxPathError("cannot write to the workspace directory itself", hint="name a file")
        try:
            with acting_as(self._host_id):
                fsutil.write_beneath(self._ws_fd, rel, data)
        except OSError as exc:
            if exc.errno == 28:  # ENOSPC
                raise SandboxLimitExceeded(
                    f"writing {rel!r} exceeds the workspace cap of {self.config.disk_mb} MiB",
                    hint="raise `disk_mb` or write less") from None
            raise SandboxPathError(f"cannot write {rel!r}: {exc.strerror}",
                                   hint="paths may not pass through symlinks or non-directories") from None

    # -- diff and fork ---------------------------------------------------
    def _changed_paths(self) -> set[str]:
        snap_fd = os.open(self.snapshot, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if self.mode == "copy":
                return diffs.all_files(snap_fd) | diffs.all_files(self._ws_fd)
            files, hidden = diffs.layer_changes(self._upper_fd)
            for layer in self._layers:
                with layer.open() as fd:
                    more_files, more_hidden = diffs.layer_changes(fd)
                files |= more_files
                hidden |= more_hidden
            return files | diffs.files_under(snap_fd, hidden)
        finally:
            os.close(snap_fd)

    def diff(self) -> str:
        self._check_open()
        snap_fd = os.open(self.snapshot, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return diffs.unified_diff(
                self._changed_paths(),
                old=lambda p: fsutil.entry_beneath(snap_fd, p),
                new=lambda p: fsutil.entry_beneath(self._ws_fd, p),
            )
        finally:
            os.close(snap_fd)

    def fork(self) -> "BwrapSandbox":
        """Freeze a copy of our upper layer (what changed: its cost does not
        depend on the repository's size) and start a sandbox over it. In the
        copy fallback the upper layer is the whole workspace."""
        self._check_open()
        # Through our descriptor, not the holder's pid, which may be reused.
        frozen = Layer.copy_of(f"/proc/{os.getpid()}/fd/{self._upper_fd}")
        try:
            return BwrapSandbox(self.snapshot, self.config, _layers=[frozen, *self._layers])
        finally:
            frozen.release()  # the child holds its own reference


def _only_child(pid: int) -> int:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = f.read().split()
    if len(kids) != 1:
        raise SandboxError(f"sandbox process {pid} has {len(kids)} children, expected 1")
    return int(kids[0])


@functools.lru_cache(maxsize=256)
def _warn_once(message: str) -> None:
    log.warning(message)


def close_all() -> None:
    """Close every live sandbox of this process (registered with atexit)."""
    for sandbox in list(_live):
        sandbox.close()
atexit.register(close_all)
