"""`atelier.fsio`: whole files and directories or none, and crash points that
kill exactly where and when they are named."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from atelier.fsio import append_line, atomic_dir, atomic_write, parse_crash_at


def test_atomic_write_replaces_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "state.json"
    atomic_write(target, "old\n")
    atomic_write(target, b"new\n")
    assert target.read_text() == "new\n"
    assert os.listdir(target.parent) == ["state.json"]
    assert target.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    atomic_write(target, "old\n")

    with pytest.raises(TypeError):
        atomic_write(target, 12345)  # type: ignore[arg-type]
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["state.json"]


def test_concurrent_writers_never_share_a_temporary(tmp_path: Path) -> None:
    """The hand-rolled `path.with_suffix('.tmp')` let two writers of one file
    rename each other's half-written temporary."""
    target = tmp_path / "index.json"
    payloads = [(str(i) * 100_000).encode() for i in range(8)]
    threads = [threading.Thread(target=atomic_write, args=(target, p)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_bytes() in payloads
    assert os.listdir(tmp_path) == ["index.json"]


def test_append_line(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    append_line(log, '{"a": 1}')
    append_line(log, '{"a": 2}\n')
    assert log.read_text() == '{"a": 1}\n{"a": 2}\n'


def test_atomic_dir_replaces_whole_and_cleans_up(tmp_path: Path) -> None:
    target = tmp_path / "ckpt" / "step-000001"
    with atomic_dir(target) as tmp:
        (tmp / "meta.json").write_text("1")
        assert not target.exists() and not tmp.name.startswith("step-")  # a glob for step-* never sees it
    assert os.listdir(target) == ["meta.json"]
    assert target.stat().st_mode & 0o777 == 0o777 & ~_umask()
    with atomic_dir(target) as tmp:  # written again (a resumed run): the old copy goes
        (tmp / "model").mkdir()
        (tmp / "model" / "w").write_bytes(b"2")
    assert sorted(os.listdir(target)) == ["model"] and os.listdir(target.parent) == ["step-000001"]
    with pytest.raises(ValueError), atomic_dir(target) as tmp:
        (tmp / "half").write_text("x")
        raise ValueError("killed halfway")
    assert os.listdir(target) == ["model"] and os.listdir(target.parent) == ["step-000001"]


def test_atomic_dir_removes_a_killed_writers_temporary(tmp_path: Path) -> None:
    script = ("import sys\nfrom atelier.fsio import atomic_dir, crash_point\n"
              "with atomic_dir(sys.argv[1]) as tmp:\n"
              "    (tmp / 'a').write_text('x')\n    crash_point('inside')\n")
    env = {**os.environ, "ATELIER_CRASH_AT": "inside"}
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "d")], env=env, timeout=60)
    assert res.returncode == -9
    (left,) = os.listdir(tmp_path)
    assert left.startswith(".d.") and left.endswith(".tmp")
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "b").write_text("y")
    assert os.listdir(tmp_path) == ["d"] and os.listdir(tmp_path / "d") == ["b"]


def test_parse_crash_at() -> None:
    assert parse_crash_at("") is None and parse_crash_at("  ") is None
    assert parse_crash_at("after_metrics") == ("after_metrics", 1, None)
    assert parse_crash_at("after_metrics:3") == ("after_metrics", 3, None)
    assert parse_crash_at("trainer.after_backward:2@1") == ("trainer.after_backward", 2, 1)
    for bad in ("x:0", "x:-1", "x:two", "x:1@", "x:1@one"):
        with pytest.raises(ValueError):
            parse_crash_at(bad)


SCRIPT = """
from atelier.fsio import crash_point
for i in range(1, 6):
    crash_point("other")
    print(i, flush=True)
    crash_point("here")
print("done")
"""


@pytest.mark.parametrize("setting, printed, killed", [
    (None, "1\n2\n3\n4\n5\ndone\n", False),
    ("here:3", "1\n2\n3\n", True),
    ("here", "1\n", True),
    ("elsewhere:1", "1\n2\n3\n4\n5\ndone\n", False),
    ("here:2@0", "1\n2\n", True),            # no RANK: rank 0
    ("here:2@1", "1\n2\n3\n4\n5\ndone\n", False),
    ("here:2@1 RANK=1", "1\n2\n", True),
])
def test_crash_point_kills_on_the_nth_visit_only(setting, printed, killed) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ATELIER_CRASH_AT", "RANK")}
    if setting and " RANK=" in setting:
        setting, rank = setting.split(" RANK=")
        env["RANK"] = rank
    if setting:
        env["ATELIER_CRASH_AT"] = setting
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    assert res.stdout == printed
    assert res.returncode == (-9 if killed else 0)
