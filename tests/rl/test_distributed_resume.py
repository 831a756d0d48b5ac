"""`atelier train --set trainer.ranks=2`: the CLI starts both ranks; `kill -9` of one stops the job
with a message naming it; the same command again restarts both and every sample is trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from atelier.rl.ledger import Ledger
from tests.helpers import wait_until

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
    assert wait_until(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip(),
                      400, interval=0.05, process=proc), "no step was ever trained"
    os.kill(_rank_pid(proc.pid, victim), signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    assert f"rank {victim} of 2 was killed by SIGKILL" in err

    resumed = _train(str(ROOT / "recipes" / "rl-tiny.toml"), "--run-dir", str(run))
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


EXACT = ["rollout.mode=sync", "rollout.batch_invariant=true", f"trainer.steps={STEPS}",
         f"rollout.groups_per_step={GROUPS}", f"rollout.group_size={SIZE}", "rollout.workers=2",
         "rollout.max_tokens=8", "env.toy.tasks=20", "trainer.lr=1e-3", "trainer.ranks=2", "trainer.threads=1",
         "trainer.timeout_s=120"]
"""Sync mode with a batch-invariant sampler: which samples each step trains, and their sampler
logprobs, do not depend on timing, so a resumed run can be compared with an uninterrupted one bit
for bit (tests/rl/test_crash_points.py says what else that takes)."""


def _train_exact(run: Path, *, resume: bool = False, crash_at: str | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "atelier.cli.main", "train"]
    argv += [str(ROOT / "recipes" / "rl-tiny.toml"), "--run-dir", str(run)]   # the same command continues
    for a in EXACT:
        argv += ["--set", a]
    env = {k: v for k, v in os.environ.items() if k != "ATELIER_CRASH_AT"}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    if crash_at:
        env["ATELIER_CRASH_AT"] = crash_at
    return subprocess.run([*argv, "--quiet"], capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("two-ranks") / "run"
    done = _train_exact(run)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a hang guard only: three runs of two ranks on a loaded 2-core machine
@pytest.mark.parametrize("victim", [1, 0])
def test_one_rank_killed_mid_step_resumes_to_the_uninterrupted_runs_weights(tmp_path, uninterrupted, victim):
    """Rank `victim` dies by SIGKILL in step 2, after its backward (gradients reduced, no optimizer
    step yet); the other rank is then inside the step's next collective. The job stops with a message
    naming the dead rank; the same command again restarts both from step 1's checkpoint and ends with the
    uninterrupted run's ledger, metrics (timings aside) and final weights, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from tests.rl.test_crash_points import MEASURED, ledger_state, trained_by_step

    run = tmp_path / "run"
    crashed = _train_exact(run, crash_at=f"trainer.after_backward:2@{victim}")
    assert crashed.returncode == 2, crashed.stderr[-3000:]
    assert f"rank {victim} of 2 was killed by SIGKILL" in crashed.stderr
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]

    resumed = _train_exact(run, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ledger_state(run) == ledger_state(uninterrupted)
    by_step = trained_by_step(run)
    assert sorted(by_step) == list(range(1, STEPS + 1)) and by_step == trained_by_step(uninterrupted)

    def rows(r: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if k not in MEASURED}
                for x in (r / "metrics.jsonl").read_text().splitlines()]
    assert rows(run) == rows(uninterrupted)
    last = Path("checkpoints") / f"step-{STEPS:06d}"
    got, want = (load_file(r / last / "model" / "model.safetensors") for r in (run, uninterrupted))
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs by up to {(got[k] - want[k]).abs().max()}"
    assert (run / last / "sharded" / ".metadata").exists()

