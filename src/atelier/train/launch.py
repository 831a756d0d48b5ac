"""N trainer ranks on this machine, started and watched by torchrun's elastic agent.

`launch(argv, world)` runs `world` copies of `python argv...` under the agent
that `torchrun` (`torch.distributed.run`) itself runs: each rank gets
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, a c10d rendezvous on a free local port), so a rank
program is a plain torchrun program and runs unchanged under `torchrun
--nproc-per-node N` or a cluster scheduler that sets the same variables.

- Per-rank logs: with `log_dir`, each rank's stdout and stderr are also kept
  in `log_dir/<run id>_<suffix>/attempt_<n>/<rank>/{stdout,stderr}.log`
  (`Launched.logs` names the last attempt's); on the console every line is
  prefixed `[rank N]:`.
- Exit propagation: when one rank fails (an exception, a `kill -9`, the OOM
  killer) the agent stops the others (SIGTERM, then SIGKILL after
  `shutdown_timeout`) and `launch` raises `RankFailed`, naming the rank that
  failed and how it ended: the job stops with a message, never a hang. When
  several ranks ended at once, the one a signal killed is named before one
  that exited with an error, which is what a survivor does when its peer
  dies.
- Restarts: with `max_restarts = k` the agent starts every rank again, up to
  k times, before it gives up; a restarted rank runs the same command, which
  continues the run from its last commit (the rule every run directory
  follows: `atelier.rundir`).
- Orphans: the agent starts each rank in a session of its own; the ranks
  call `atelier.train.ranks.die_with_parent`, so a `kill -9` of the launcher
  leaves no rank behind holding the run directory.

Independently, every collective inside the ranks has a timeout
(`trainer.timeout_s`), so a rank that hangs without exiting also ends the job.
Against the hand-written launcher it replaces, it costs a second or so of
start-up, most of it importing torch in the launcher; the ranks of a real run
import it anyway and run for minutes (docs/log/2026-12-03-figures-from-the-code.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from atelier.train.ranks import LAUNCHER_PID, RankFailed

SHUTDOWN_TIMEOUT_S = 10
"""How long the ranks left get after SIGTERM, once one failed, before SIGKILL."""


@dataclass
class Launched:
    """What a launch that ended well leaves: the agent's run id and, with a `log_dir`, each
    rank's log directory of the last attempt (stdout.log, stderr.log)."""

    run_id: str
    logs: dict[int, Path] = field(default_factory=dict)


def launch(argv: Sequence[str], world: int, *, log_dir: str | Path | None = None, max_restarts: int = 0,
           env: Mapping[str, str] | None = None, what: str = "training") -> Launched:
    """Run `python argv...` as `world` ranks until every one exits 0; raise `RankFailed` on the
    first failure that is past `max_restarts`. `env`: variables the ranks get on top of this
    process's environment."""
    run_id = f"atelier-{uuid.uuid4().hex[:12]}"
    streams = Std.ALL if log_dir is not None else Std.NONE
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=run_id, role="rank",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=max_restarts, monitor_interval=0.1,
        log_line_prefix_template="[rank${rank}]:", shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logs_specs=DefaultLogsSpecs(log_dir=None if log_dir is None else str(log_dir), redirects=streams,
                                    tee=streams))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    try:
        with _environment({**(env or {}), LAUNCHER_PID: str(os.getpid())}):
            elastic_launch(config, sys.executable)(*argv)
    except ChildFailedError as exc:
        rank, code = root_failure({r: f.exitcode for r, f in exc.failures.items()})
        raise RankFailed(f"{what}: rank {rank} of {world} {describe_exit(code)}; the other ranks were stopped",
                         hint="fix the cause shown above, then run the same command again to continue") from None
    except SignalException as exc:   # the agent turns a Ctrl-C into this, once the ranks are stopped
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise
    return Launched(run_id, _last_logs(Path(log_dir), run_id) if log_dir is not None else {})


def root_failure(codes: Mapping[int, int]) -> tuple[int, int]:
    """The rank to name among those that failed together, with its exit code: one killed by a
    signal other than the agent's own SIGTERM first, then one that exited with an error, then
    any; the lowest rank among equals."""
    def order(rank: int) -> tuple[int, int]:
        code = codes[rank]
        return (0 if code < 0 and code != -signal.SIGTERM else 1 if code > 0 else 2), rank
    rank = min(codes, key=order)
    return rank, codes[rank]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in this process's environment for the block (the agent's ranks inherit it)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _last_logs(log_dir: Path, run_id: str) -> dict[int, Path]:
    attempts = sorted(log_dir.glob(f"{run_id}_*/attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if not attempts:
        return {}
    return {int(p.name): p for p in attempts[-1].iterdir() if p.name.isdigit()}
