"""`atelier simulate run` and `sweep` on the projection cluster files (shrunk to seconds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from atelier.config import load_config
from atelier.sim.cluster import SimConfig
from atelier.sim.sweep import with_split

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--set", "steps=2", "--set", "workload.turns=2", "--set", "rollout.groups_per_step=4"]


def _simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atelier.cli.main", "simulate", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("name", ["report-1t-moe", "coder-7b"])
def test_the_projection_files_load_and_run(name):
    path = ROOT / "recipes" / "clusters" / f"{name}.toml"
    cluster = load_config(SimConfig, path)
    assert cluster.sources and all(v.split(":")[0].split(" ")[0] in ("measured", "published", "assumed")
                                   for v in cluster.sources.values())
    done = _simulate("run", str(path), *SMALL, "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["steps"] == 2 and figures["samples"] == 2 * 4 * cluster.rollout.group_size


def test_a_sweep_writes_its_json_and_plots(tmp_path):
    out = tmp_path / "sweep"
    done = _simulate("sweep", "recipes/clusters/coder-7b.toml", "--out", str(out), "--gpus", "16",
                     "--inference-share", "0.5", "--staleness", "1", "--outage-s", "60", *SMALL)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "sweep.json").read_text())
    assert {r["outage"] for r in report["outages"]} == {"none", "inference replica down", "sandbox host down",
                                                        "trainer node lost"}
    assert [r["mode"] for r in report["staleness"]] == ["sync", "async"]
    assert report["split"][0]["ranks"] == 8 and report["split"][0]["replicas"] == 8
    assert all((out / p).stat().st_size > 1000 for p in report["plots"])
    assert json.loads(done.stdout)["best_split"]["16"]["inference_share"] == 0.5


def test_a_split_gives_each_side_whole_ranks_and_replicas():
    base = load_config(SimConfig, ROOT / "recipes" / "clusters" / "report-1t-moe.toml")
    cfg = with_split(base, 328, 0.6)
    assert (cfg.trainer.ranks, cfg.inference.replicas) == (17, 6)   # 6 x 32 + 17 x 8 = 328
    assert with_split(base, 20, 0.5) is None                         # no whole 32-GPU replica in 10 GPUs
    assert with_split(base, 328, 0.6, groups_per_gpu=0.5).rollout.groups_per_step == 164
