"""`atelier agent` driven by a script over a real sandbox."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from atelier.cli import main as cli
from atelier.harness.parsing import format_call as fc
from atelier.harness.trajectory import Trajectory
from tests.harness.conftest import TEST_COMMAND, write_repo

SCRIPT = ["Let me look.\n" + fc("read_file", {"path": "pkg/calc.py"}),
          fc("edit_file", {"path": "pkg/calc.py", "old_string": "return a - b", "new_string": "return a + b"})
          + fc("run_terminal", {"command": TEST_COMMAND}),
          fc("submit", {"message": "add adds"})]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "script.json"
    path.write_text(json.dumps(SCRIPT))
    return path


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["agent", *args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_agent_shows_calls_prints_diff_and_leaves_repo_alone(tmp_path, script, capsys, bwrap_ready):
    repo = write_repo(tmp_path / "repo")
    traj_path = tmp_path / "t.json"
    code, out, err = run_cli(capsys, "fix add", "--repo", str(repo), "--script", str(script), "--out", str(traj_path))
    assert code == 0, err
    assert "-    return a - b\n+    return a + b" in out
    assert "read_file(path='pkg/calc.py')" in err and "run_terminal(" in err and "submitted: 3 turns" in err
    assert "return a - b" in (repo / "pkg/calc.py").read_text()  # no --apply: untouched
    traj = Trajectory.load(traj_path)
    assert traj.exit_reason == "submitted" and traj.final_diff == out


def test_agent_apply_changes_a_plain_directory_inside_another_git_repo(tmp_path, script, capsys, bwrap_ready):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)  # an enclosing repository must not matter
    repo = write_repo(tmp_path / "plain")
    code, _, err = run_cli(capsys, "fix add", "-r", str(repo), "--script", str(script), "-o", str(tmp_path / "t.json"),
                           "--apply", "-q")
    assert code == 0, err
    assert "return a + b" in (repo / "pkg/calc.py").read_text() and "applied the diff" in err
    assert "turn 1" not in err  # --quiet


def test_agent_limits_and_bad_input(tmp_path, script, capsys, bwrap_ready):
    repo = write_repo(tmp_path / "repo")
    code, _, err = run_cli(capsys, "fix", "-r", str(repo), "--script", str(script), "--max-turns", "1",
                           "-o", str(tmp_path / "t.json"))
    assert code == 1 and "max_turns: 1 turns" in err
    assert Trajectory.load(tmp_path / "t.json").limits["max_turns"] == 1
    code, _, err = run_cli(capsys, "fix", "-r", str(tmp_path / "missing"), "--script", str(script))
    assert code == 2 and "is not a directory" in err
    code, _, err = run_cli(capsys, "fix", "-r", str(repo))
    assert code == 2 and "no model given" in err and "--script" in err
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    code, _, err = run_cli(capsys, "fix", "-r", str(repo), "--script", str(tmp_path / "bad.json"))
    assert code == 2 and "must be a JSON list of strings" in err
    code, _, err = run_cli(capsys, "fix", "-r", str(repo), "--script", str(script), "--set", "max_turn=3")
    assert code == 2 and "max_turn" in err
