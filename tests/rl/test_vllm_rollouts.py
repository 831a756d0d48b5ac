"""RL with rollouts on vLLM: the tiny model learns the toy task, a `kill -9` of the vLLM server
mid-run costs retried rollouts, never the job, a `kill -9` of the trainer resumes with every sample
trained exactly once, and the Ray launcher's inference actor runs a vLLM server. Slow: each test
starts vLLM servers of its own (the run's weights change, so the session's server cannot be shared)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atelier.config import load_config
from atelier.inference.vllm_server import VLLMConfig, VLLMUnavailable, _group_members, find_vllm_python
from atelier.rl.config import TrainConfig
from atelier.rl.ledger import Ledger
from atelier.rl.run import run_training
from tests.rl.test_resume import _wait_for_running, _wait_for_steps, assert_trained_exactly_once

VLLM = ["inference.engine=vllm", "inference.vllm.enforce_eager=true", "inference.vllm.chunk_tokens=8",
        "inference.vllm.dtype=float32", "inference.vllm.max_model_len=512"]
LEARN = ["trainer.steps=14", "trainer.lr=1e-2", "trainer.norm_tokens=128", "rollout.group_size=8",
         "rollout.groups_per_step=2", "rollout.max_tokens=16", "rollout.workers=8", "rollout.max_staleness=1",
         "env.toy.tasks=64"]


def _need_vllm() -> None:
    try:
        find_vllm_python(VLLMConfig())
    except VLLMUnavailable as exc:
        pytest.skip(f"the vLLM environment is absent ({exc.message}); `make vllm-env` builds it")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _server_pid(run: Path) -> int:
    """The pid of the run's vLLM server: the first line of its pid file (the second names its
    socket directory)."""
    return int((run / "vllm" / "vllm-server.pid").read_text().split()[0])


def _vllm_servers_of(run: Path) -> set[int]:
    """Pids of vLLM API servers whose command line names a model under `run`."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmd and any(str(run).encode() in a for a in cmd):
            found.add(int(proc.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a server start and a restart, each minutes on a loaded 2-core machine
def test_tiny_model_learns_on_vllm_and_survives_kill_9_of_the_server(tmp_path):
    _need_vllm()
    run_dir = tmp_path / "run"
    config = load_config(TrainConfig, None, ["model=tiny", *LEARN, *VLLM])  # tiny: built in vLLM's shape
    killed = []

    def on_step(record):
        if record["step"] == 4:
            pid = _server_pid(run_dir)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    summary = run_training(config, run_dir, on_step=on_step)
    assert killed
    rewards = [m["reward_mean"] for m in summary.metrics]
    assert summary.steps == 14 and len(rewards) == 14
    assert sum(rewards[-3:]) / 3 > sum(rewards[:2]) / 2 + 0.15, rewards  # chance level is ~0.25
    assert _server_pid(run_dir) != killed[0]  # a new server ran the rest
    ledger = Ledger.load(run_dir / "ledger.jsonl")
    counts = ledger.counts()
    assert counts["trained"] == 14 * 2 * 8 and counts["dropped"] == 0
    assert all(m["staleness_max"] <= 1 for m in summary.metrics)
    # A rollout whose chunk met the dead server failed as infrastructure and was retried (never
    # scored, never dropped); chunks that started after the kill waited for the restart instead.
    infra: dict[str, int] = {}
    for m in summary.metrics:
        for name, n in m["infra_types"].items():
            infra[name] = infra.get(name, 0) + n
    assert set(infra) <= {"EngineUnavailable"}, infra
    assert sum(s.attempt for s in ledger.slots.values()) >= sum(infra.values())
    print(f"infrastructure failures retried after the kill: {infra}")


STEPS, GROUPS, SIZE = 4, 2, 2
RESUME = [f"trainer.steps={STEPS}", f"rollout.groups_per_step={GROUPS}", f"rollout.group_size={SIZE}",
          "rollout.workers=4", "rollout.max_tokens=8", "env.toy.tasks=40", "env.toy.env_latency_s=0.4",
          "trainer.lr=1e-3"]


def _train(*extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "atelier.cli.main", "train", *extra, "--quiet"]
    for a in [*RESUME, *VLLM]:
        argv += ["--set", a]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # two server starts (before and after the kill): minutes each here
def test_tiny_recipe_on_vllm_resumes_after_kill_9_of_the_trainer(tmp_path):
    """`atelier train` on vLLM killed with SIGKILL mid-run: its server group goes with it (the
    watchdog), and the same command again starts a new server from the last checkpoint's weights and trains
    every sample exactly once; the tokens sampled after the resume carry the checkpoint's version."""
    _need_vllm()
    run = tmp_path / "run"
    recipe = Path(__file__).parents[2] / "recipes" / "rl-tiny.toml"
    proc = _train(str(recipe), "--run-dir", str(run))
    _wait_for_steps(proc, run / "metrics.jsonl", 1, limit=1500)  # the server's start comes first
    _wait_for_running(proc, run / "ledger.jsonl", limit=600)
    server = _server_pid(run)
    assert _alive(server)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = Ledger.load(run / "ledger.jsonl")
    in_flight = {s.slot_id for s in before.in_state("running")}
    assert in_flight  # async: rollouts were running when the trainer died
    deadline = time.monotonic() + 120  # the watchdog polls every second; a loaded machine is slow
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(server), "the vLLM server outlived the trainer that started it"

    resumed = _train(str(recipe), "--run-dir", str(run))
    out, err = resumed.communicate(timeout=1800)
    assert resumed.returncode == 0, err[-3000:]
    assert _server_pid(run) != server  # a new server ran the rest
    assert_trained_exactly_once(run, STEPS, GROUPS, SIZE, in_flight)
    last = run / "checkpoints" / f"step-{STEPS:06d}" / "model" / "config.json"
    assert last.exists()
    # every sampled token carries a policy version the trainer had published by then
    for path in (run / "rollouts").glob("*.json"):
        for seg in json.loads(path.read_text())["segments"]:
            assert all(0 <= v < STEPS for v, k in zip(seg["versions"], seg["loss_mask"]) if k)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(2400)  # Ray's actors and a vLLM server start inside the inference actor
def test_ray_backend_samples_on_a_vllm_server_in_its_inference_actor(ray_instance, tmp_path):
    """launcher=ray with inference.engine=vllm: the inference actor starts (and owns) one vLLM server;
    weights reach it through the delta chain, and later groups sample at the new version."""
    _need_vllm()
    config = load_config(TrainConfig, None, [
        "model=tiny", "launcher=ray", "sync.kind=delta", "sync.full_every=2", "trainer.steps=3",
        "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.max_tokens=8", "rollout.workers=4",
        "env.toy.tasks=16", *VLLM])
    servers: set[int] = set()

    def on_step(record) -> None:  # the server runs the run's model, started by the actor
        servers.update(_vllm_servers_of(tmp_path / "run"))

    summary = run_training(config, tmp_path / "run", on_step=on_step)
    assert servers, "no vLLM server ran the run's model"
    # Closing the backend kills the actor, and Ray kills its direct children (the server's leader);
    # the watchdog then kills the rest of each server's group (vLLM's engine core and workers).
    def left() -> list[int]:
        return [p for leader in servers for p in _group_members(leader) if _alive(p)]

    deadline = time.monotonic() + 120
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left(), "processes of the actor's vLLM server outlived it"
    assert summary.steps == 3 and summary.ledger["trained"] == 3 * 2 * 2
    assert [m["sync_kind"] for m in summary.metrics] == ["delta", "full", "delta"]
    versions = set()
    for path in (tmp_path / "run" / "rollouts").glob("*.json"):
        for seg in json.loads(path.read_text())["segments"]:
            versions |= {v for v, k in zip(seg["versions"], seg["loss_mask"]) if k}
    assert versions >= {0, 1}  # the vLLM server took the published weights
