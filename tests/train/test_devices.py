"""CPU memory a trainer frees goes back to the OS; bf16 on the CPU is found from its flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atelier.train.devices import bf16_in_flags, cpu_has_bf16, resolve_precision, return_freed_memory
from tests.helpers import rank_env


def test_bf16_is_found_in_the_cpu_flags_and_auto_precision_is_fp32_on_the_cpu():
    assert bf16_in_flags(["fpu", "avx512f", "avx512_bf16"]) and bf16_in_flags(["amx_tile", "amx_bf16"])
    assert not bf16_in_flags(["fpu", "avx2", "avx512f"])
    assert isinstance(cpu_has_bf16(), bool)
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"


def test_large_freed_cpu_tensors_go_back_to_the_os():
    """What keeps the trainer's peak resident memory down: after `return_freed_memory`, a freed
    activation-sized tensor leaves the resident set at once (glibc's heaps kept it before)."""
    def rss_mib() -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    if not return_freed_memory():
        pytest.skip("not glibc")
    for _ in range(3):   # what a step does: the same sizes allocated and freed again
        x = torch.ones(16 << 18)   # 16 MiB, under glibc's 32 MiB dynamic ceiling
        held = rss_mib()
        del x
        assert held - rss_mib() >= 15


# What the memory probes below start with: run in a fresh process, each reads its own resident set.
PROBE_HEAD = """
import json
from pathlib import Path
import torch
from atelier.train.devices import return_freed_memory, trim_freed_memory
from atelier.train.ranks import init_ranks

def rss_mib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
"""


TRIM_PROBE = PROBE_HEAD + """
return_freed_memory()
small = [torch.ones(1 << 16) for _ in range(1024)]   # 256 KiB each: from the heap, under the threshold
top = torch.ones(1 << 16)                            # still alive, above them
before = rss_mib()
del small
freed = rss_mib()
trim_freed_memory()
print(json.dumps([before - freed, before - rss_mib()]))
"""


def test_trimming_returns_what_the_heap_holds_freed():
    """What kept the RL stage's resident set growing step after step: small tensors freed beneath
    a live one stay resident in glibc's heap until `trim_freed_memory` (which the trainer calls
    after every step on the CPU) hands them back. A fresh process: heap state is process-wide."""
    if not return_freed_memory():
        pytest.skip("not glibc")
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True,
                         timeout=120)
    kept_free, after_trim = json.loads(out.stdout.strip().splitlines()[-1])
    assert kept_free < 32, "glibc returned the freed heap memory without a trim (the behaviour being fixed)"
    assert after_trim >= 200   # of the 256 MiB freed


FREED_PROBE = PROBE_HEAD + """
def returned():
    drops = []
    for _ in range(3):
        x = torch.ones(16 << 18)
        held = rss_mib()
        del x
        drops.append(held - rss_mib())
    return drops[-1]

before = returned()
init_ranks("cpu")
print(json.dumps([before, returned()]))
"""


def test_every_cpu_trainer_process_returns_freed_memory():
    """`init_ranks`, where the RL and the pretrain/SFT trainers both start, applies
    `return_freed_memory` on the CPU (a fresh process: the setting is process-wide)."""
    if not return_freed_memory():
        pytest.skip("not glibc")
    env = {k: v for k, v in {**os.environ, **rank_env()}.items() if not k.startswith(("MALLOC_", "WORLD_SIZE", "RANK"))}
    out = subprocess.run([sys.executable, "-c", FREED_PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    before, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert before < 5, "glibc kept the freed tensor before init_ranks (the behaviour being fixed)"
    assert after >= 15
