"""Host pressure readings that decide whether a new sandbox may start now.

Pure parsers of /proc text first (tests feed them strings), then the readers
that feed them from this machine.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal


@dataclasses.dataclass(frozen=True)
class CpuPressure:
    source: Literal["psi", "loadavg"]
    value: float
    """`psi`: percent of the last 10 s in which some runnable task waited for a
    CPU (`some avg10`). `loadavg`: the 1-minute load average per CPU."""


def parse_mem_available_mb(meminfo: str) -> float | None:
    """MemAvailable in MiB from the text of /proc/meminfo (which counts kB)."""
    for line in meminfo.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "MemAvailable:":
            return float(fields[1]) / 1024
    return None


def parse_psi_some_avg10(text: str) -> float | None:
    """`some avg10` from the text of /proc/pressure/cpu."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "some":
            for field in fields[1:]:
                name, _, value = field.partition("=")
                if name == "avg10":
                    return float(value)
    return None


def parse_load_per_cpu(loadavg: str, ncpu: int) -> float | None:
    """The 1-minute load average from the text of /proc/loadavg, per CPU."""
    fields = loadavg.split()
    return float(fields[0]) / max(1, ncpu) if fields else None


def admission_wait_reason(mem_available_mb: float | None, cpu: CpuPressure | None, *,
                          min_available_mb: float, max_load_per_cpu: float,
                          max_cpu_pressure: float) -> str | None:
    """Why a new sandbox should wait, or None to go ahead. Unknown readings
    (None) never hold a creation back."""
    if mem_available_mb is not None and mem_available_mb < min_available_mb:
        return f"MemAvailable is {mem_available_mb:.0f} MiB, below {min_available_mb} MiB"
    if cpu is not None:
        limit = max_cpu_pressure if cpu.source == "psi" else max_load_per_cpu
        if cpu.value > limit:
            what = "CPU pressure (some avg10, %)" if cpu.source == "psi" else "load per CPU"
            return f"{what} is {cpu.value:.2f}, above {limit}"
    return None


def read_mem_available_mb() -> float | None:
    try:
        return parse_mem_available_mb(Path("/proc/meminfo").read_text())
    except (OSError, ValueError):
        return None


def read_cpu_pressure() -> CpuPressure | None:
    """PSI where the kernel has it (Linux >= 4.20, not booted with psi=0),
    else the load average divided by the number of CPUs."""
    try:
        psi = parse_psi_some_avg10(Path("/proc/pressure/cpu").read_text())
        if psi is not None:
            return CpuPressure("psi", psi)
    except (OSError, ValueError):
        pass
    try:
        load = parse_load_per_cpu(Path("/proc/loadavg").read_text(), os.cpu_count() or 1)
    except (OSError, ValueError):
        return None
    return None if load is None else CpuPressure("loadavg", load)
