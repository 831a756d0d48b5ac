"""`atelier sandbox run` and `atelier sandbox bench` through the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

ATELIER = [sys.executable, "-m", "atelier.cli"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ATELIER, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("x = 1\n")
    (root / "README").write_text("hello\n")
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_run_streams_output_and_exit_code_and_never_changes_dir(repo: Path) -> None:
    before = tree(repo)
    res = run_cli("sandbox", "run", "--workspace", str(repo), "--diff", "--",
                  "sh", "-c", "echo out; echo err >&2; echo y = 2 >> pkg/mod.py; rm README; exit 3")
    assert res.returncode == 3
    assert res.stdout.startswith("out\n")
    assert "err" in res.stderr
    assert "+y = 2" in res.stdout and "deleted file mode 100644" in res.stdout
    assert tree(repo) == before


def test_run_diff_applies_with_git(repo: Path, tmp_path: Path) -> None:
    res = run_cli("sandbox", "run", "-w", str(repo), "--diff", "--",
                  "sh", "-c", "echo new > added.txt && printf 'x = 2\\n' > pkg/mod.py")
    assert res.returncode == 0
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    applied = subprocess.run(["git", "apply", "-"], cwd=copy, input=res.stdout, text=True, capture_output=True)
    assert applied.returncode == 0, applied.stderr
    assert (copy / "added.txt").read_text() == "new\n"
    assert (copy / "pkg" / "mod.py").read_text() == "x = 2\n"


def test_run_timeout_exits_124(repo: Path) -> None:
    res = run_cli("sandbox", "run", "-w", str(repo), "--timeout", "0.5", "--", "sleep", "30")
    assert res.returncode == 124
    assert "timed out" in res.stderr


def test_run_says_a_process_was_killed_for_memory(repo: Path) -> None:
    """Four processes of 120 MiB under --memory-mb 256: each fits the
    per-process limit, together they pass the sandbox's, which holds as a
    cgroup or through the watchdog alike."""
    hog = "import time; b = bytearray(120 * 1024**2); time.sleep(5)"
    res = run_cli("sandbox", "run", "-w", str(repo), "--memory-mb", "256", "--", "sh", "-c",
                  f"for i in 1 2 3 4; do python3 -c '{hog}' & done; wait")
    assert "killed for passing the sandbox's memory limit of 256 MiB (enforced by " in res.stderr, res.stderr


def test_run_is_sealed_from_the_network_by_default(repo: Path) -> None:
    res = run_cli("sandbox", "run", "-w", str(repo), "--", "sh", "-c", "cat /proc/net/dev | tail -n +3")
    interfaces = [line.split(":")[0].strip() for line in res.stdout.splitlines()]
    assert interfaces == ["lo"]


def test_bad_input_is_a_clear_error_without_traceback(repo: Path, tmp_path: Path) -> None:
    missing = run_cli("sandbox", "run", "-w", str(tmp_path / "nope"), "--", "true")
    assert missing.returncode == 2
    assert "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    bad = run_cli("sandbox", "run", "-w", str(repo), "--timeout", "-1", "--", "true")
    assert bad.returncode == 2
    assert "timeout_s" in bad.stderr and "Traceback" not in bad.stderr
    choice = run_cli("sandbox", "run", "-w", str(repo), "--network", "hots", "--", "true")
    assert choice.returncode == 2 and "'none'" in choice.stderr


def test_host_environment_does_not_leak(repo: Path) -> None:
    env = {**os.environ, "ATELIER_TEST_SECRET": "s3cret"}
    res = subprocess.run([*ATELIER, "sandbox", "run", "-w", str(repo), "--", "env"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0
    assert "s3cret" not in res.stdout


@pytest.mark.slow
def test_bench_prints_one_json_object() -> None:
    res = run_cli("sandbox", "bench", "--json", "--quick", timeout=600)
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    for key in ("create_p50_ms", "create_p99_ms", "exec_p50_ms", "fork_p50_ms_100_files",
                "fork_p50_ms_10000_files", "copy_p50_ms_100_files", "copy_p50_ms_10000_files",
                "docker_run_p50_ms", "sandboxes_per_s", "max_live"):
        assert key in result
    assert result["max_live"] > 0
