"""Start N trainer ranks on this machine and watch them: torchrun's contract, no extra process.

`run_ranks(argv, world)` starts `world` copies of `python argv...`, each with
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free local port), so a rank program is a
plain torchrun program and runs unchanged under `torchrun` or a cluster
scheduler that sets the same variables.

Supervision: the launcher polls its ranks. When one exits with a failure
(an exception, a `kill -9`, the OOM killer) it stops the others (SIGTERM,
then SIGKILL after a grace period) and raises `RankFailed`, naming the rank
and how it ended: the job stops with a message, never a hang. The ranks die
with the launcher too (Linux parent-death signal), so a `kill -9` of the
launcher leaves no orphan holding the run directory. Independently, every
collective inside the ranks has a timeout (`trainer.timeout_s`), so a rank
that hangs without exiting also ends the job.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from atelier.errors import AtelierError

GRACE_S = 10.0


class RankFailed(AtelierError):
    """A trainer rank exited with a failure; the others were stopped."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def start_ranks(argv: Sequence[str], world: int, *, env: dict[str, str] | None = None,
                stdout=None, stderr=None) -> list[subprocess.Popen]:
    port = free_port()
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return [subprocess.Popen([sys.executable, *argv], env=rank_env(r, world, port, env),
                             stdout=stdout, stderr=stderr, preexec_fn=preexec)
            for r in range(world)]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def stop_ranks(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_ranks(procs: list[subprocess.Popen], poll_s: float = 0.2, what: str = "training") -> None:
    """Return when every rank exited 0; on the first failure stop the rest and raise `RankFailed`."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                stop_ranks(procs)
                raise RankFailed(f"{what}: rank {rank} of {len(procs)} {describe_exit(code)}; "
                                 "the other ranks were stopped",
                                 hint="fix the cause shown above, then continue with --resume RUN_DIR")
            if all(c == 0 for c in codes):
                return
            time.sleep(poll_s)
    except KeyboardInterrupt:
        stop_ranks(procs)
        raise


def run_ranks(argv: Sequence[str], world: int, *, env: dict[str, str] | None = None, what: str = "training") -> None:
    wait_ranks(start_ranks(argv, world, env=env), what=what)


def launch_job(kind: str, config, run_dir: Path, *, resume: bool, quiet: bool, world: int) -> dict | None:
    """Run `atelier.cli.rank KIND` as `world` local ranks; return rank 0's result (a JSON object).

    The resolved config travels as JSON in a private temporary directory, so
    every rank validates the very config the user's command resolved.
    """
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="atelier-ranks-") as tmp:
        spec = Path(tmp) / "config.json"
        result = Path(tmp) / "result.json"
        spec.write_text(config.model_dump_json())
        argv = ["-m", "atelier.cli.rank", kind, str(spec), str(run_dir), "--result", str(result)]
        argv += ["--resume"] if resume else []
        argv += ["--quiet"] if quiet else []
        run_ranks(argv, world, what=f"atelier {kind} with {world} ranks")
        return json.loads(result.read_text()) if result.exists() else None
