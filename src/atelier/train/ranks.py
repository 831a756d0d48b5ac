"""A trainer rank's lifecycle: join the process group, leave it, end the process.

- `init_ranks(device, timeout_s)` reads torchrun's environment contract
  (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and joins the
  process group: NCCL on CUDA, gloo on the CPU. Every collective inherits
  `timeout_s`: a rank that dies or hangs makes the others raise instead of
  waiting forever (docs/pitfalls.md: collectives with no timeout hung the job). With
  WORLD_SIZE unset or 1 nothing is initialised and the model is left
  unwrapped: one rank is exactly the single-process trainer.
- A rank's whole run sits inside `joined_ranks(...)`, which first checks that
  the ranks started are the ranks the recipe asks for, and leaves the group
  when the run ends.
- A rank's process ends with `exit_rank(code)`, without the interpreter's
  teardown, where gloo's threads can abort a finished rank; a rank started by
  a launcher calls `die_with_parent()` first, so that a `kill -9` of the
  launcher leaves no rank holding the run directory.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Iterator, NoReturn

import torch
import torch.distributed as dist

from atelier.errors import AtelierError
from atelier.train.devices import pick_device, return_freed_memory

DEFAULT_TIMEOUT_S = 600.0
LAUNCHER_PID = "ATELIER_LAUNCHER_PID"
"""The launcher's process id, which `atelier.train.launch` gives its ranks (see `die_with_parent`)."""


class DistributedError(AtelierError):
    """A rank died, a collective timed out, or the ranks were set up wrong."""


class RankFailed(AtelierError):
    """A trainer rank ended with a failure and a launcher stopped the others."""


@dataclass(frozen=True)
class Ranks:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1


ONE_CPU_RANK = Ranks(0, 1, 0, torch.device("cpu"))
"""The plain case: one process on the CPU, no process group."""


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_ranks(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> Ranks:
    """Join the process group named by torchrun's environment variables (none: one rank).

    Every trainer process (RL, pretrain/SFT) starts here, so on the CPU this is also where
    it calls `return_freed_memory`, before any weight or activation is allocated.
    """
    world = env_world()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    dev = pick_device(device, local_rank)
    if dev.type == "cpu":
        return_freed_memory()   # activations' freed memory does not stay resident
    if world > 1 and not dist.is_initialized():
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise DistributedError(f"WORLD_SIZE={world} but {key} is not set",
                                       hint="start the ranks with `atelier train --set trainer.ranks=N` "
                                            "or torchrun, which set the rendezvous")
        backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if dev.type == "cuda":
            kwargs["device_id"] = dev
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return Ranks(rank, world, local_rank, dev)


def close_ranks() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def check_world(wanted: int, key: str, command: str) -> None:
    """Refuse a run whose recipe asks for `wanted` ranks (its option `key`) in a process that is
    one of another number of ranks: `command` starts the right number itself."""
    world = env_world()
    if world != wanted and (world > 1 or wanted > 1):
        raise DistributedError(
            f"{key} = {wanted} but this process is one of {world} rank(s)",
            hint=f"let `{command}` start the ranks (it reads {key}), or give torchrun "
                 f"--nproc-per-node equal to {key}")


@contextlib.contextmanager
def joined_ranks(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S, *, wanted: int | None = None,
                 key: str = "ranks", command: str = "atelier") -> Iterator[Ranks]:
    """`init_ranks` for the length of a run (after `check_world`, when `wanted` is given); the
    group is left when the block ends, as PyTorch asks of every process once its collectives are
    done (so a process that runs again, a Ray actor, joins a new group instead of finding a
    finished one)."""
    if wanted is not None:
        check_world(wanted, key, command)
    ranks = init_ranks(device, timeout_s)
    try:
        yield ranks
    finally:
        close_ranks()


def exit_rank(code: int) -> NoReturn:
    """End a rank's process with `code`, skipping the interpreter's teardown (as
    multiprocessing's children end): atexit handlers run and output is flushed first.

    gloo's worker threads free each finished collective's tensors after the collective has
    returned; one that does so once the interpreter is tearing down cannot take the GIL and
    aborts the process ("terminate called without an active exception", SIGABRT), so a rank
    that had finished its work read as failed: 5 of about 200 two-rank test runs here (gdb:
    gloo's run-loop thread in `~AsyncAllgatherCoalescedWork`, the main thread in
    `Py_FinalizeEx`). Leaving the group does not stop those threads: DTensor's caches keep the
    group alive.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def die_with_parent() -> None:
    """Have Linux kill this process when the process that started it dies (PR_SET_PDEATHSIG),
    so a `kill -9` of a launcher leaves no orphaned rank; elsewhere, nothing. torchrun's agent
    starts its workers in sessions of their own, which no signal to the launcher reaches."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        return
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is not None and os.getppid() != int(launcher):   # it died before the request took effect
        os._exit(1)
