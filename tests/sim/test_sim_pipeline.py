"""The simulated pipeline against closed forms: a fixed pipeline's wall time is its critical path."""

from __future__ import annotations

import pytest

from atelier.config import load_config
from atelier.rl.rules import breaker_limit
from atelier.sim.cluster import FaultSpec, SimConfig
from atelier.sim.pipeline import Pipeline
from atelier.sim.workload import ReplayedWorkload, RolloutProfile, Turn

SETUP, TOKENS, STEP_S, AFTER = 0.5, 10, 0.01, 1.0
LENGTH = 100
ROLLOUT_S = SETUP + TOKENS * STEP_S + AFTER
"""Each rollout: setup, one call of 10 tokens at 0.01 s a decode step (whatever the batch), the grade."""


def _workload(size: int) -> ReplayedWorkload:
    member = RolloutProfile(setup_s=SETUP, turns=(Turn(context=20, sampled=TOKENS, after_s=AFTER),), length=LENGTH,
                            reward=1.0)
    return ReplayedWorkload([tuple(member for _ in range(size))])


def _cluster(mode: str, steps: int, train_per_position: float, *extra: str) -> SimConfig:
    return load_config(SimConfig, None, [
        f"steps={steps}", f"rollout.mode={mode}", "rollout.group_size=3", "rollout.groups_per_step=2",
        "rollout.max_staleness=1", "rollout.workers=12", "trainer.startup_s=5", "trainer.shutdown_s=2",
        "trainer.step_fixed_s=0.2", f"trainer.step_s_per_position={train_per_position}", "trainer.step_overhead_s=0.05",
        "trainer.checkpoint_every=1", "trainer.checkpoint_s=0.1", f"inference.decode_step_s={STEP_S}",
        "inference.decode_step_s_per_seq=0", "inference.swap_s=0", "sync.kind=inprocess", "sync.publish_fixed_s=0.15",
        *extra])


def _train_s(cfg: SimConfig) -> float:
    t = cfg.trainer
    positions = cfg.rollout.groups_per_step * cfg.rollout.group_size * LENGTH
    return t.step_fixed_s + t.step_s_per_position * positions + t.checkpoint_s + cfg.sync.publish_fixed_s \
        + t.step_overhead_s


def test_a_synchronous_run_is_steps_times_generate_plus_train():
    cfg = _cluster("sync", 6, 1e-3)
    result = Pipeline(cfg, _workload(3)).run()
    T = _train_s(cfg)
    assert result.figures.wall_s == pytest.approx(5 + 6 * (ROLLOUT_S + T) + 2)
    assert [s.end_s for s in result.steps] == pytest.approx([5 + k * (ROLLOUT_S + T) for k in range(1, 7)])
    assert result.figures.staleness == {"0": 1.0}


@pytest.mark.parametrize("per_position", [1e-3, 5e-3], ids=["rollout-bound", "trainer-bound"])
def test_an_asynchronous_run_follows_its_critical_path(per_position):
    """Staleness 1, two batches admitted at once: step k trains the groups admitted at commit k - 2,
    so c_k = max(c_(k-1), c_(k-2) + R) + T (c_1 = R + T, c_2 = c_1 + T)."""
    cfg = _cluster("async", 7, per_position)
    result = Pipeline(cfg, _workload(3)).run()
    R, T = ROLLOUT_S, _train_s(cfg)
    commits = [5 + R + T, 5 + R + 2 * T]
    for _ in range(3, 8):
        commits.append(max(commits[-1], commits[-2] + R) + T)
    assert [s.end_s for s in result.steps] == pytest.approx(commits)
    assert result.figures.wall_s == pytest.approx(commits[-1] + 2)
    assert set(result.figures.staleness) <= {"0", "1"}


def test_async_beats_sync_only_where_generation_and_training_overlap():
    sync = Pipeline(_cluster("sync", 8, 1e-3), _workload(3)).run().figures
    both = Pipeline(_cluster("async", 8, 1e-3), _workload(3)).run().figures
    assert both.wall_s < sync.wall_s
    assert sync.trainer_idle_fraction > both.trainer_idle_fraction


def test_a_killed_replica_costs_retried_rollouts_never_the_run():
    cfg = _cluster("async", 6, 1e-3, "inference.restart_s=3")
    clean = Pipeline(cfg, _workload(3)).run().figures
    # the first batch's calls run from 5.5 to 5.6 s: a kill at 5.55 fails all 12 of them
    hit = Pipeline(cfg.model_copy(update={"faults": [FaultSpec(kind="inference_down", at_s=5.55)]}),
                   _workload(3)).run().figures
    assert hit.failures == 12 and hit.steps == 6 and hit.dropped_groups == 0 and not hit.stops
    assert hit.wall_s > clean.wall_s + 2


def test_a_long_sandbox_outage_trips_the_failure_breaker():
    """Every retry fails while the hosts are down: the breaker stops the run after
    `breaker_limit(workers)` failures in a row, as `atelier train` stops."""
    cfg = _cluster("async", 6, 1e-3, "rollout.retry_backoff_s=0.1")
    out = Pipeline(cfg.model_copy(update={"faults": [FaultSpec(kind="sandbox_down", at_s=12, duration_s=600)]}),
                   _workload(3)).run().figures
    assert out.stops and "in a row failed" in out.stops[0]
    assert out.failures >= breaker_limit(12) and out.steps < 6


def test_a_lost_trainer_resumes_from_its_checkpoint():
    cfg = _cluster("sync", 6, 1e-3, "trainer.checkpoint_every=4", "trainer.restart_s=10")
    clean = Pipeline(cfg, _workload(3)).run().figures
    at = 5 + 5.5 * (ROLLOUT_S + _train_s(cfg))   # during step 6: steps 5 is lost with it
    lost = Pipeline(cfg.model_copy(update={"faults": [FaultSpec(kind="trainer_lost", at_s=at)]}),
                    _workload(3)).run()
    assert lost.figures.steps == 6 and [s.step for s in lost.steps] == [1, 2, 3, 4, 5, 6]
    assert lost.figures.wall_s > clean.wall_s + 10 + 5   # the restart, the start-up, step 5 again


def test_the_admission_rule_is_the_reconcilers():
    """(S + 1) * G groups at most in flight: with S = 2 the trainer sees staleness up to 2."""
    cfg = _cluster("async", 8, 5e-3, "rollout.max_staleness=2", "rollout.workers=18")
    fig = Pipeline(cfg, _workload(3)).run().figures
    assert max(int(k) for k in fig.staleness) == 2
    one = Pipeline(_cluster("async", 8, 5e-3, "rollout.workers=18"), _workload(3)).run().figures
    assert max(int(k) for k in one.staleness) == 1


def test_an_outage_that_stops_the_run_costs_no_time_it_stops_it():
    """`outage_costs`: a sandbox outage long enough to trip the breaker ends the run early, which
    must not read as time saved (a negative cost): the row says the run stopped, and after which step."""
    from atelier.sim.sweep import outage_costs

    cfg = _cluster("async", 6, 1e-3, "rollout.retry_backoff_s=0.1", "workload.turns=1")
    rows = {r["outage"]: r for r in outage_costs(cfg, outage_s=3600)}
    stopped = rows["sandbox host down"]
    assert stopped["run_stopped"] and stopped["extra_wall_s"] is None and stopped["steps_done"] < 6
    assert not rows["none"]["run_stopped"] and rows["none"]["extra_wall_s"] == 0.0
