"""Trainer ranks as Ray actors on a two-node local Ray cluster (one machine, two raylets)."""

from __future__ import annotations

import pytest

from atelier.config import load_config
from atelier.rl.config import TrainConfig


@pytest.mark.ray
@pytest.mark.slow   # two raylets, two rank actors and the rollout actors: minutes on 2 cores
@pytest.mark.timeout(1200)
def test_two_node_ray_cluster_trains_with_ranks_on_different_nodes(tiny_model_dir, tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'atelier-rl[ray]'")
    from ray.cluster_utils import Cluster

    from atelier.cli.rank import start_ranks
    from atelier.rl.ledger import Ledger

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    try:
        ray.init(address=cluster.address, include_dashboard=False)
        config = load_config(TrainConfig, None, [
            f"model={tiny_model_dir}", "launcher=ray", "sync.kind=delta", "trainer.steps=2", "trainer.ranks=2",
            "trainer.timeout_s=300", "rollout.group_size=2", "rollout.groups_per_step=2", "rollout.max_tokens=8",
            "rollout.workers=2", "env.toy.tasks=8"])
        run = tmp_path / "run"   # the "shared file system": both nodes are this machine
        result = start_ranks("train", config, run, world=2, strategy="STRICT_SPREAD")
        assert len(set(result["rank_nodes"])) == 2        # the two ranks ran on different nodes
        assert result["steps"] == 2 and result["ledger"]["trained"] == 2 * 2 * 2
        assert Ledger.load(run / "ledger.jsonl").counts()["trained"] == 8
        assert (run / "checkpoints" / "step-000002" / "sharded" / ".metadata").exists()
    finally:
        ray.shutdown()
        cluster.shutdown()
