"""`atelier train --set trainer.ranks=2`: the CLI starts both ranks; `kill -9` of one stops the job
with a message naming it; `--resume` restarts both and every sample is trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from atelier.rl.ledger import Ledger

ROOT = Path(__file__).parents[2]
STEPS, GROUPS, SIZE = 3, 2, 2
ARGS = [f"trainer.steps={STEPS}", f"rollout.groups_per_step={GROUPS}", f"rollout.group_size={SIZE}",
        "rollout.workers=4", "rollout.max_tokens=8", "env.toy.tasks=30", "env.toy.env_latency_s=0.3",
        "trainer.lr=1e-3", "trainer.ranks=2", "trainer.timeout_s=120"]


def _train(*extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "atelier.cli.main", "train", *extra, "--quiet"]
    for a in ARGS:
        argv += ["--set", a]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _rank_pid(launcher: int, rank: int) -> int:
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in children:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no rank {rank} among {children}")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # a hang guard only: two runs of two ranks on a loaded 2-core machine
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the rank processes")
@pytest.mark.parametrize("victim", [0, 1])
def test_kill_9_of_one_rank_stops_the_job_then_resume_trains_every_sample_once(tmp_path, victim):
    run = tmp_path / "run"
    proc = _train(str(ROOT / "recipes" / "rl-tiny.toml"), "--run-dir", str(run))
    deadline = time.monotonic() + 400   # tells a hang from progress; no timing is asserted
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no step was ever trained"
        time.sleep(0.05)
    os.kill(_rank_pid(proc.pid, victim), signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert f"rank {victim} of 2 was killed by SIGKILL" in err

    resumed = _train("--resume", str(run))
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    ledger = Ledger.load(run / "ledger.jsonl")
    counts = ledger.counts()
    assert counts["trained"] == STEPS * GROUPS * SIZE, counts
    assert counts["queued"] == counts["running"] == counts["graded"] == counts["ready"] == 0
    assert max(Counter(g.task_id for g in ledger.groups.values()).values()) == 1
    trained_at: dict[str, set[int]] = defaultdict(set)
    for line in (run / "ledger.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("state") == "trained":
            trained_at[event["slot_id"]].add(event["step"])
    assert all(len(steps) == 1 for steps in trained_at.values()), trained_at
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    last = run / "checkpoints" / f"step-{STEPS:06d}"
    assert (last / "model" / "config.json").exists() and (last / "sharded" / ".metadata").exists()
