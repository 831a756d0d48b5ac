"""The `local` backend: unisolated, but the same contract and honest about it."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

import pytest

from atelier.sandbox import SandboxConfig, SandboxPathError, create_sandbox


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "a.txt").write_text("one\n")
    return root


def local(repo: Path, **kw) -> object:
    return create_sandbox(repo, SandboxConfig(backend="local", **kw))


def test_warns_that_it_isolates_nothing(repo: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        sb = local(repo)
    sb.close()
    assert any("UNISOLATED" in r.getMessage() for r in caplog.records)


def test_contract_state_diff_fork_and_snapshot_untouched(repo: Path) -> None:
    with local(repo) as sb:
        assert sb.exec("echo two >> a.txt && echo new > b.txt").exit_code == 0
        assert sb.read_file("a.txt") == "one\ntwo\n"
        sb.write_file("d/c.txt", "c\n")
        child = sb.fork()
        child.exec("rm b.txt")
        assert sb.read_file("b.txt") == "new\n"
        diff = sb.diff()
        child.close()
    assert (repo / "a.txt").read_text() == "one\n" and not (repo / "b.txt").exists()
    assert "+two" in diff and "b/b.txt" in diff and "b/d/c.txt" in diff
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    assert subprocess.run(["git", "apply", "-"], cwd=repo, input=diff, text=True).returncode == 0
    assert (repo / "d" / "c.txt").read_text() == "c\n"


def test_timeout_kills_the_process_group_and_close_kills_background(repo: Path) -> None:
    with local(repo) as sb:
        res = sb.exec("sleep 30 & sleep 30", timeout=0.5)
        assert res.timed_out and res.exit_code == 124
        sb.exec("sleep 300 & echo $! > pid")
        pid = int(sb.read_file("pid"))
    def state() -> str:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "gone"

    # SIGKILL is sent by close(); the kernel may take a moment to finish the exit.
    for _ in range(500):
        if state() in ("gone", "Z", "X"):
            break
        time.sleep(0.01)
    assert state() in ("gone", "Z", "X")


def test_paths_cannot_leave_the_workspace(repo: Path) -> None:
    with local(repo) as sb:
        with pytest.raises(SandboxPathError):
            sb.read_file("../outside")
        with pytest.raises(SandboxPathError):
            sb.write_file("/etc/evil", "x")
