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


# --- a full disk is told, not traced ---------------------------------------

def _on_a_small_disk(tmp_path: Path, script: str, size: str, **env: str) -> subprocess.CompletedProcess:
    """Run the shell `script` (`$DISK` is the mount point, `$PYTHON` this interpreter, `env` more
    variables) with a fresh tmpfs of `size` mounted at tmp_path/disk, in a user and mount
    namespace of its own (no root needed)."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare")
    disk = tmp_path / "disk"
    disk.mkdir()
    namespace = ["unshare", "--user", "--map-root-user", "--mount"]
    probe = subprocess.run([*namespace, "mount", "-t", "tmpfs", "tmpfs", str(disk)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    return subprocess.run([*namespace, "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "$DISK" && {script}'],
                          env={**os.environ, "DISK": str(disk), "PYTHON": sys.executable, **env},
                          capture_output=True, text=True, timeout=600)


def _python_on_a_small_disk(tmp_path: Path, program: str, size: str) -> dict:
    """Run the Python `program` (`DISK` bound to the mount point) on a small disk; the JSON it prints last."""
    import json

    opening = "from os import environ\nfrom pathlib import Path\nDISK = Path(environ['DISK'])\n"
    proc = _on_a_small_disk(tmp_path, '"$PYTHON" -c "$PROGRAM"', size, PROGRAM=opening + program)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_TELL = """
import json, os
from atelier.fsio import DiskFullError

def tell(write):
    try:
        write()
    except DiskFullError as exc:
        return {"error": exc.message, "hint": exc.hint, "cause": type(exc.__cause__).__name__}
    except Exception as exc:
        return {"untyped": repr(exc)}
    return {"written": True}
"""


def test_writes_that_fill_the_disk_raise_a_typed_error_and_leave_nothing(tmp_path: Path) -> None:
    """Disk full used to reach the user as torch's own error ("[enforce fail at
    inline_container.cc:672] unexpected pos ...", no errno) with a traceback, in
    the middle of a checkpoint. Each writer's form of it (torch.save's
    RuntimeError, a plain OSError ENOSPC, safetensors' own error) becomes one
    typed error naming the disk and the fix; the partial files are removed."""
    told = _python_on_a_small_disk(tmp_path, _TELL + """
import torch
from safetensors.torch import save_file
from atelier.fsio import atomic_dir, atomic_write, told_when_disk_full

def torch_checkpoint():
    with atomic_dir(DISK / "step-000001") as tmp:
        torch.save({"optimizer": torch.zeros(1 << 20)}, tmp / "optimizer.pt")

def safetensors_weights():
    with told_when_disk_full(DISK / "weights", "writing the weights"):
        save_file({"w": torch.zeros(1 << 20)}, str(DISK / "model.safetensors"))

out = {"torch": tell(torch_checkpoint),
       "plain": tell(lambda: atomic_write(DISK / "records.json", b"x" * (2 << 20))),
       "safetensors": tell(safetensors_weights)}
out["left"] = sorted(os.listdir(DISK))
out["not_full"] = tell(lambda: atomic_write(DISK / "small.json", "{}"))
print(json.dumps(out))
""", size="1m")
    for writer, cause in (("torch", "RuntimeError"), ("plain", "OSError"), ("safetensors", "SafetensorError")):
        assert "error" in told[writer], (writer, told[writer])
        assert told[writer]["error"].startswith("the disk is full"), told[writer]
        assert str(tmp_path / "disk") in told[writer]["error"] and "MiB free" in told[writer]["error"]
        assert "free space" in told[writer]["hint"] and "same command again" in told[writer]["hint"]
        assert told[writer]["cause"] == cause
    assert told["left"] == []            # no temporary outlived its failed write
    assert told["not_full"] == {"written": True}


def test_other_write_errors_pass_unchanged(tmp_path: Path) -> None:
    """Only a full disk is re-told: a bug in what is being written keeps its own error."""
    from atelier.fsio import DiskFullError, told_when_disk_full

    with pytest.raises(RuntimeError, match="not a disk problem"):
        with told_when_disk_full(tmp_path / "x", "writing x"):
            raise RuntimeError("not a disk problem")
    with pytest.raises(DiskFullError, match="the disk is full: writing x"):
        with told_when_disk_full(tmp_path / "x", "writing x"):
            raise OSError(28, os.strerror(28))


@pytest.mark.timeout(900)  # a hang guard only
def test_a_run_that_fills_the_disk_stops_with_the_fix_and_resumes_once_there_is_room(tmp_path: Path,
                                                                                     tiny_model_dir) -> None:
    """`atelier pretrain` on a disk that fills up at its second checkpoint: the user reads "error:
    the disk is full ..." and a hint, exit status 2, no traceback; with room made, the same run
    directory continues from the checkpoint that was written and finishes."""
    import json

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "pretrain-tiny.toml"
    cli = '"$PYTHON" -m atelier.cli.main pretrain'
    proc = _on_a_small_disk(
        tmp_path,
        f'{cli} {recipe} --set model={tiny_model_dir} --set evals.max_repo_tokens=300 '
        '--set evals.max_new_tokens=8 --run-dir "$DISK/run"; echo "status $?"; '
        f'mount -o remount,size=64m "$DISK" && {cli} --run-dir "$DISK/run" --json && cat "$DISK/run/metrics.jsonl"',
        size="2m")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: the disk is full: writing the checkpoint at "), proc.stderr
    assert "\nhint: free space on the disk holding" in proc.stderr
    lines = proc.stdout.splitlines()
    assert "status 2" in lines, proc.stdout[-2000:]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    summary = next(r for r in records if "final_model" in r)
    assert not summary["stopped"] and summary["global_step"] == 8
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps)) and len(steps) == 8, steps   # every step once: none lost, none twice


def test_a_killed_owners_temp_dir_is_removed_by_the_next_one(tmp_path: Path) -> None:
    """A process killed before it cleans up leaves its scratch directory (a vLLM engine's
    weight updates, 269 MB each for the demo's model); the next `owned_temp_dir` of that
    prefix removes it, and keeps one whose owner runs and one that records no owner."""
    from atelier.fsio import OWNER_FILE, owned_temp_dir

    program = ("import os, sys, signal\nfrom atelier.fsio import owned_temp_dir\n"
               "d = owned_temp_dir('scratch-', sys.argv[1])\n(d / 'weights').write_bytes(b'0' * 4096)\n"
               "print(d, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.run([sys.executable, "-c", program, str(tmp_path)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert killed.returncode == -9
    left = Path(killed.stdout.strip())
    assert (left / "weights").exists()
    live = owned_temp_dir("scratch-", tmp_path)
    foreign = tmp_path / "scratch-not-ours"
    foreign.mkdir()
    mine = owned_temp_dir("scratch-", tmp_path)
    assert not left.exists()
    assert live.is_dir() and foreign.is_dir() and mine.is_dir() and live != mine
    assert (mine / OWNER_FILE).read_text().split()[0] == str(os.getpid())


def test_proc_stat_fields_start_after_a_command_name_with_spaces_and_parentheses():
    from atelier.fsio import proc_stat_fields

    stat = "4242 (a (b) c) S 17 4242 4242 0 -1 4194560 " + " ".join(str(i) for i in range(10, 53))
    fields = proc_stat_fields(stat)
    assert fields[0] == "S" and fields[1] == "17"   # state, parent pid
    assert fields[19] == "22"                        # start time, field 22 of proc(5)
    assert proc_stat_fields(Path("/proc/self/stat").read_text())[1] == str(os.getppid())
