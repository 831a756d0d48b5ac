"""Run one process to completion with a deadline, capped output and streaming.

Shared by every backend. Two details matter:

- The process is started in a new session, so a timeout kills its whole process
  group (children included), not just the direct child.
- A command may leave background processes that keep stdout/stderr open (e.g.
  `server &`). We therefore stop waiting when the direct child exits, take what
  is already in the pipes, and close them, instead of waiting for EOF forever.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from typing import Callable, Sequence

from atelier.sandbox.base import ExecResult, OutputCallback

TIMEOUT_EXIT_CODE = 124


class _Capture:
    """Keeps the first `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: list[bytes] = []
        self.kept = 0
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - self.kept
        if room > 0:
            self.chunks.append(chunk[:room])
            self.kept += min(room, len(chunk))
        self.dropped += max(0, len(chunk) - max(room, 0))

    def text(self) -> str:
        out = b"".join(self.chunks).decode("utf-8", errors="replace")
        if self.dropped:
            out += f"\n[... output truncated: {self.dropped} more bytes not shown ...]\n"
        return out


def _exit_code(returncode: int) -> int:
    # Killed by signal N: report it the way shells do (128 + N).
    return 128 - returncode if returncode < 0 else returncode


class _ProcessIO:
    """One child's pipes under one selector loop: stdin written as the pipe takes it, stdout and
    stderr captured (and handed to `on_output`) as they arrive, and a pidfd that wakes the loop
    the moment the child exits, even while background processes keep the output pipes open."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes | None, output_limit: int,
                 on_output: OutputCallback | None) -> None:
        self.captures = {"stdout": _Capture(output_limit), "stderr": _Capture(output_limit)}
        self.on_output = on_output
        self.sel = selectors.DefaultSelector()
        assert proc.stdout is not None and proc.stderr is not None
        for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self.sel.register(pipe, selectors.EVENT_READ, name)
        self.pidfd = os.pidfd_open(proc.pid)
        self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
        self.pending_stdin = memoryview(stdin) if stdin is not None else None
        if self.pending_stdin is not None:
            assert proc.stdin is not None
            os.set_blocking(proc.stdin.fileno(), False)
            self.sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")

    def pump(self, timeout_s: float) -> None:
        for key, _ in self.sel.select(timeout_s):
            if key.data == "exit":
                continue
            if key.data == "stdin":
                self._feed(key)
                continue
            self._drain(key)

    def _feed(self, key: selectors.SelectorKey) -> None:
        try:
            written = os.write(key.fd, self.pending_stdin[:65536])  # type: ignore[index]
            self.pending_stdin = self.pending_stdin[written:]  # type: ignore[index]
        except (BrokenPipeError, BlockingIOError) as exc:
            if isinstance(exc, BlockingIOError):
                return
            self.pending_stdin = self.pending_stdin[:0]  # type: ignore[index]
        if not self.pending_stdin:
            self.sel.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]

    def _drain(self, key: selectors.SelectorKey) -> None:
        while True:
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                self.sel.unregister(key.fileobj)
                return
            self.captures[key.data].add(chunk)
            if self.on_output is not None:
                self.on_output(key.data, chunk)

    def drain_output(self) -> None:
        for key in list(self.sel.get_map().values()):
            if key.data in ("stdout", "stderr"):
                self._drain(key)

    def close(self, proc: subprocess.Popen) -> None:
        self.sel.close()
        os.close(self.pidfd)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()


def run_process(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    cwd: str | None,
    timeout: float,
    output_limit: int,
    stdin: bytes | None = None,
    on_output: OutputCallback | None = None,
    on_start: Callable[[int], None] | None = None,
) -> ExecResult:
    """Run `argv`; `on_start` receives the pid (= process group id) once it
    runs, for owners that must kill leftovers later."""
    start = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    if on_start is not None:
        on_start(proc.pid)
    io = _ProcessIO(proc, stdin, output_limit, on_output)
    deadline = start + timeout
    timed_out = False
    try:
        while proc.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                _kill_group(proc)
                break
            io.pump(remaining)
        proc.wait()
        # Take what the command wrote before it exited; background children
        # that still hold the pipes do not keep us waiting.
        io.drain_output()
    finally:
        io.close(proc)
    captures = io.captures
    return ExecResult(
        exit_code=TIMEOUT_EXIT_CODE if timed_out else _exit_code(proc.returncode),
        stdout=captures["stdout"].text(),
        stderr=captures["stderr"].text(),
        timed_out=timed_out,
        duration_s=time.monotonic() - start,
        truncated=any(c.dropped for c in captures.values()),
    )


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
