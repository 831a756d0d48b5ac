"""The sandbox benchmark: start-up, exec, fork and density on this machine.

Baselines run in the same process and the same minute: a plain copy
(`cp -a` of the repository, then a subprocess), and `docker run` where a Docker
daemon answers. Targets (issue #2, checked here, never in tests):
create p50 <= 20 ms; fork at 10,000 files <= 2x fork at 100 files and >= 10x
faster than the copy baseline; >= 100 sandboxes/s on 2 cores; >= 500 idle
sandboxes held at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from atelier.sandbox import SandboxConfig, create_sandbox
from atelier.sandbox.pressure import read_mem_available_mb

Progress = Callable[[str], None]


def make_repo(root: Path, n_files: int) -> Path:
    """A synthetic repository of `n_files` small Python files in nested packages."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        d = root / f"pkg{i // 500}" / f"mod{(i // 50) % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"file_{i}.py").write_text(f"def f_{i}(x):\n    return x + {i}\n")
    return root


def _ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def _timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _lifecycle(repo: Path, config: SandboxConfig) -> None:
    sb = create_sandbox(repo, config)
    try:
        sb.exec(["true"])
    finally:
        sb.close()


def _fork_samples(repo: Path, config: SandboxConfig, n: int) -> list[float]:
    with create_sandbox(repo, config) as sb:
        sb.exec("echo changed >> pkg0/mod0/file_0.py && echo new > NEW.txt")
        samples = []
        for _ in range(n):
            t = time.perf_counter()
            child = sb.fork()
            samples.append(time.perf_counter() - t)
            child.close()
        return samples


def _copy_baseline(repo: Path, n: int) -> list[float]:
    samples = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            dest = Path(tmp) / f"copy{i}"
            t = time.perf_counter()
            subprocess.run(["cp", "-a", str(repo), str(dest)], check=True)
            subprocess.run(["true"], cwd=dest, check=True)
            samples.append(time.perf_counter() - t)
            shutil.rmtree(dest)
    return samples


def _docker_p50_ms(n: int) -> float | None:
    if shutil.which("docker") is None:
        return None
    try:
        if subprocess.run(["docker", "info"], capture_output=True, timeout=5).returncode != 0:
            return None
        image = "busybox"
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=10).returncode:
            return None
        samples = _timed(lambda: subprocess.run(["docker", "run", "--rm", "--network", "none", image, "true"],
                                                capture_output=True, timeout=60), n)
        return _ms(samples, 0.5)
    except (subprocess.TimeoutExpired, OSError):
        return None


def _rate(repo: Path, config: SandboxConfig, seconds: float, workers: int) -> float:
    stop = time.monotonic() + seconds
    count = 0
    lock = threading.Lock()

    def worker() -> None:
        nonlocal count
        while time.monotonic() < stop:
            _lifecycle(repo, config)
            with lock:
                count += 1

    start = time.monotonic()
    with ThreadPoolExecutor(workers) as ex:
        for f in [ex.submit(worker) for _ in range(workers)]:
            f.result()
    return round(count / (time.monotonic() - start), 1)


def _max_live(repo: Path, config: SandboxConfig, cap: int, progress: Progress) -> int:
    live = []
    try:
        while len(live) < cap and (read_mem_available_mb() or float('inf')) > 2048:
            try:
                live.append(create_sandbox(repo, config))
            except Exception as exc:  # the point is to find where creation stops
                progress(f"max_live stopped at {len(live)}: {type(exc).__name__}: {exc}")
                break
            if len(live) % 100 == 0:
                progress(f"{len(live)} idle sandboxes live")
        return len(live)
    finally:
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda s: s.close(), live))


def run(quick: bool = False, progress: Progress = lambda msg: None) -> dict:
    """Measure everything and return the benchmark's JSON object."""
    config = SandboxConfig()
    n = 10 if quick else 50
    with tempfile.TemporaryDirectory(prefix="atelier-bench-") as tmp:
        small = make_repo(Path(tmp) / "repo100", 100)
        big = make_repo(Path(tmp) / "repo10000", 10_000)
        progress("create + exec + close")
        _lifecycle(small, config)  # warm caches
        create = _timed(lambda: _lifecycle(small, config), n)
        progress("exec")
        with create_sandbox(small, config) as sb:
            mode = getattr(sb, "mode", "copy")
            execs = _timed(lambda: sb.exec(["true"]), n)
        progress("fork at 100 and 10,000 files")
        fork_small = _fork_samples(small, config, n // 2)
        fork_big = _fork_samples(big, config, n // 2)
        progress("copy baseline")
        copy_small = _copy_baseline(small, max(3, n // 5))
        copy_big = _copy_baseline(big, 3 if quick else 5)
        progress("docker baseline")
        docker = _docker_p50_ms(5)
        progress("sustained rate")
        workers = 2 * (os.cpu_count() or 1)  # creation waits on the kernel as much as it computes
        rate = _rate(small, config, 2.0 if quick else 5.0, workers)
        progress("idle sandboxes held at once")
        max_live = _max_live(small, config, 100 if quick else 1000, progress)
    result = {
        "backend": config.backend,
        "workspace_mode": mode,
        "cpus": os.cpu_count(),
        "create_p50_ms": _ms(create, 0.5),
        "create_p99_ms": _ms(create, 0.99),
        "exec_p50_ms": _ms(execs, 0.5),
        "fork_p50_ms_100_files": _ms(fork_small, 0.5),
        "fork_p50_ms_10000_files": _ms(fork_big, 0.5),
        "copy_p50_ms_100_files": _ms(copy_small, 0.5),
        "copy_p50_ms_10000_files": _ms(copy_big, 0.5),
        "docker_run_p50_ms": docker,
        "sandboxes_per_s": rate,
        "max_live": max_live,
        "max_live_cap": 100 if quick else 1000,
    }
    result["fork_10000_over_100"] = round(result["fork_p50_ms_10000_files"] / result["fork_p50_ms_100_files"], 2)
    result["copy_over_fork_10000"] = round(result["copy_p50_ms_10000_files"] / result["fork_p50_ms_10000_files"], 1)
    result["targets_met"] = {
        "create_p50_ms<=20": result["create_p50_ms"] <= 20,
        "fork_10000<=2x_fork_100": result["fork_10000_over_100"] <= 2,
        "fork_10000>=10x_faster_than_copy": result["copy_over_fork_10000"] >= 10,
        "sandboxes_per_s>=100": rate >= 100,
        "max_live>=500": max_live >= 500 if not quick else None,
    }
    return result
