"""Local ranks under torchrun's elastic agent: torchrun's environment, per-rank logs, a failed
rank named and the others stopped, restarts."""

from __future__ import annotations

import json
import signal

import pytest

from atelier.train.launch import launch, root_failure
from atelier.train.ranks import LAUNCHER_PID, RankFailed
from tests.helpers import rank_env

ENV_PROBE = """
import json, os
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "{pid}", "MARK")
print(json.dumps({{k: os.environ.get(k) for k in keys}}))
"""


def test_ranks_get_torchruns_environment_and_each_its_own_logs(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(ENV_PROBE.format(pid=LAUNCHER_PID))
    done = launch([str(script)], 2, log_dir=tmp_path / "logs", env={**rank_env(), "MARK": "set"})
    assert sorted(done.logs) == [0, 1]
    seen = [json.loads((done.logs[r] / "stdout.log").read_text()) for r in (0, 1)]
    assert [s["RANK"] for s in seen] == ["0", "1"] and [s["LOCAL_RANK"] for s in seen] == ["0", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {s["LOCAL_WORLD_SIZE"] for s in seen} == {"2"}
    assert len({(s["MASTER_ADDR"], s["MASTER_PORT"]) for s in seen}) == 1 and seen[0]["MASTER_PORT"]
    assert {s["MARK"] for s in seen} == {"set"} and seen[0][LAUNCHER_PID].isdigit()


def test_a_rank_that_dies_stops_the_job_with_a_message(tmp_path):
    script = tmp_path / "die.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1': os._exit(3)\n"
                      "time.sleep(60)\n")
    with pytest.raises(RankFailed) as info:
        launch([str(script)], 2)
    assert "rank 1 of 2 exited with status 3" in str(info.value)


def test_the_failure_named_is_the_cause_not_the_ranks_that_followed_it():
    """A rank killed outright makes its peer fail with an error a moment later, and the agent
    stops the rest with SIGTERM: the one the signal killed is named."""
    assert root_failure({0: 2, 1: -signal.SIGKILL}) == (1, -signal.SIGKILL)
    assert root_failure({0: -signal.SIGTERM, 1: 3}) == (1, 3)
    assert root_failure({2: 1, 1: 1}) == (1, 1)
    assert root_failure({0: -signal.SIGTERM}) == (0, -signal.SIGTERM)


def test_with_restarts_the_agent_starts_the_ranks_again(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text("import os, sys\n"
                      "restart = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
                      "print('attempt', restart)\n"
                      "sys.exit(5 if restart == 0 and os.environ['RANK'] == '0' else 0)\n")
    with pytest.raises(RankFailed, match="rank 0 of 2 exited with status 5"):
        launch([str(script)], 2)
    done = launch([str(script)], 2, log_dir=tmp_path / "logs", max_restarts=1)
    assert (done.logs[0] / "stdout.log").read_text().strip() == "attempt 1"
