"""The device a rank computes on, its precision, and how it hands CPU memory back.

- `pick_device(choice, local_rank)`: "auto" takes the GPU when torch sees
  one; rank r uses GPU r of its node.
- `resolve_precision(precision, device)`: the trainers' "auto" is bf16 on a
  GPU that has it and fp32 on the CPU; "bf16" is bf16 compute with fp32
  master weights (`atelier.train.fsdp`).
- `cpu_has_bf16()`: whether this CPU multiplies bf16 in hardware (AMX-BF16 or
  AVX512-BF16), where bf16 is the fast choice on a CPU too.
- `return_freed_memory()` / `trim_freed_memory()`: glibc settings and a trim
  that keep a trainer's resident set from growing with the holes its freed
  activations leave (every trainer process calls the first in
  `atelier.train.ranks.init_ranks`; the RL trainer the second after each step).
"""

from __future__ import annotations

import ctypes
import functools
import resource
from typing import Any

import torch

from atelier.errors import AtelierError


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """'auto' takes the GPU when torch sees one; rank r uses GPU r of its node."""
    if choice not in ("auto", "cpu", "cuda"):
        raise AtelierError(f"unknown device {choice!r}", hint="use auto, cpu or cuda")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise AtelierError('device = "cuda" but torch sees no GPU', hint='use device = "auto" or "cpu"')
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def resolve_precision(precision: str, device: torch.device) -> str:
    """'auto' is bf16 on a GPU that has it and fp32 on the CPU (ask for "bf16" explicitly on a CPU
    with `cpu_has_bf16`, where the built-in engine samples in bf16 too)."""
    if precision in ("fp32", "bf16"):
        return precision
    if precision != "auto":
        raise AtelierError(f"unknown precision {precision!r}", hint="use auto, fp32 or bf16")
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def bf16_in_flags(flags: list[str]) -> bool:
    """Whether /proc/cpuinfo `flags` name a bf16 matrix unit: AMX-BF16 or AVX512-BF16."""
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (from /proc/cpuinfo, else torch's probes)."""
    try:
        with open("/proc/cpuinfo") as f:
            if bf16_in_flags(next((line for line in f if line.startswith("flags")), "").split()):
                return True
    except OSError:
        pass
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, p, lambda: False)() for p in probes)


HEAP_MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc serves an allocation with its own mmap (see `return_freed_memory`)."""


def return_freed_memory() -> bool:
    """Have glibc hand large freed CPU tensors back to the OS at once; False where it is not glibc.

    glibc serves allocations under its mmap threshold from its heaps and keeps
    what is freed there for reuse. The threshold starts at 128 KiB but rises to
    the size of every mmapped block freed, up to 32 MiB, so after the first
    step a trainer's activations (tens of MiB each at thousands of tokens)
    come from the heaps, and their freed holes stay resident beside the next
    ones. Fixing the threshold (and the heap trim threshold) at 1 MiB maps
    every large tensor and unmaps it when freed: a lower peak for the same step time
    (docs/log/2026-12-03-figures-from-the-code.md). Process-wide, like the
    MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ variables it stands for.
    """
    libc = _glibc()
    if libc is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3   # glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, HEAP_MMAP_THRESHOLD)
                and libc.mallopt(m_trim_threshold, HEAP_MMAP_THRESHOLD))


def trim_freed_memory() -> bool:
    """Hand back to the OS what glibc's heaps hold freed (`malloc_trim`); False where it is not glibc.

    `return_freed_memory` maps large tensors on their own, but a step also frees many
    allocations under its threshold, in the heaps of every thread that made them (the RL
    stage's engine and rollout workers share the trainer's process). glibc trims a heap
    only from its top, so what is freed beneath a live allocation stays resident and the
    resident set grew step after step; with this called after each step it rests at one level
    (docs/log/2026-12-04-rl-epoch.md).
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)   # its result only says whether it found pages to return
    return True


@functools.cache
def _glibc() -> Any:
    """The C library when it is glibc (it has `mallopt` and `malloc_trim`), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated by this process, or its peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB on Linux
