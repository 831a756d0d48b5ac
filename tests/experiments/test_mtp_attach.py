"""experiments/mtp_attach at smoke scale: a tiny model, a few steps, two arms, the results file it writes."""

from __future__ import annotations

import json

from tests.helpers import load_experiment

run = load_experiment("mtp_attach")


def test_arm_recipes_change_only_what_the_arm_names(tmp_path) -> None:
    from atelier.compat import tomllib

    base = tomllib.loads(run.RECIPE.read_text())
    joint = run.arm_recipe(base, run.ARMS["joint"], False, tmp_path)
    assert joint["mtp"]["trunk"] == "joint" and joint["phases"][0]["lr"] == 2e-5
    assert joint["phases"][0]["steps"] == round(base["phases"][0]["steps"] / 2)
    full = run.arm_recipe(base, run.ARMS["full-vocab"], False, tmp_path)
    assert "draft_vocab" not in full["mtp"] and base["mtp"]["draft_vocab"] == 8192
    frozen = run.arm_recipe(base, run.ARMS["frozen"], False, tmp_path)
    assert frozen["phases"][0].pop("chat") == [str(tmp_path / "replies.jsonl")]
    assert {**base, "phases": [{k: v for k, v in base["phases"][0].items() if k != "chat"}]} == frozen


def test_smoke_run_writes_results_and_a_plot(tmp_path) -> None:
    # One arm: the joint arm is `atelier pretrain` with joint heads, which test_mtp_pretrain runs
    run.main(["--out", str(tmp_path), "--smoke", "--arms", "frozen", "--eval-tokens", "256"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["arms"]) == {"frozen"}
    for arm in results["arms"].values():
        assert arm["tokens"] == arm["eval"]["tokens_seen"] > 0
        assert [p["step"] for p in arm["history"]][-1] == arm["steps"]
        assert all(p["train_s"] > 0 for p in arm["history"])
        assert 1.0 <= arm["eval"]["greedy"]["mean_accepted_length"] <= 4.0
        assert arm["eval"]["chat"]["conversations"] == 5   # the held-out replies: 4 chats, 1 agent
    assert results["arms"]["frozen"]["recipe"]["mtp"]["trunk"] == "frozen"
    assert results["corpus"]["replies_s"] > 0 and (tmp_path / "replies-heldout.jsonl").is_file()
    assert (tmp_path / "mtp_attach.png").stat().st_size > 0
