"""Slot ledger replay, resume rules, curriculum ordering and staleness admission (no model)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from atelier.errors import InfraError
from atelier.harness.trajectory import Segment, Trajectory
from atelier.rl.config import CurriculumConfig, RolloutConfig
from atelier.rl.curriculum import Curriculum
from atelier.rl.ledger import Ledger
from atelier.rl.reconciler import Reconciler


def test_ledger_replays_and_ignores_a_torn_tail(tmp_path):
    path = tmp_path / "ledger.jsonl"
    led = Ledger(path)
    led.add_group("g0", "t0", 2, version=0)
    led.set("g0/0", "running", start_version=0)
    led.set("g0/0", "graded", reward=1.0, passed=True)
    led.set("g0/1", "running", start_version=0)
    led.close()
    with open(path, "a") as f:
        f.write('{"event": "slot", "slot_id": "g0/1", "sta')  # kill -9 mid-write
    again = Ledger.load(path)
    assert again.slots["g0/0"].state == "graded" and again.slots["g0/0"].reward == 1.0
    assert again.slots["g0/1"].state == "running"
    assert again.groups["g0"].index == 0


def test_trained_events_after_the_committed_step_are_undone(tmp_path):
    led = Ledger(tmp_path / "l.jsonl")
    led.add_group("g0", "t0", 1, version=0)
    led.add_group("g1", "t1", 1, version=0)
    led.set("g0/0", "trained", step=1)
    led.set("g1/0", "trained", step=2)
    led.close()
    again = Ledger.load(tmp_path / "l.jsonl", committed_step=1)
    assert again.slots["g0/0"].state == "trained"
    assert again.slots["g1/0"].state == "ready"
    assert [g.group_id for g in again.untrained_groups()] == ["g1"]


def test_curriculum_puts_hard_categories_first_once_easy_ones_saturate():
    cur = Curriculum(CurriculumConfig(saturation=0.8, window=2))
    tasks = ["easy-1", "hard-1", "easy-2", "hard-2"]
    cat = lambda t: t.split("-")[0]  # noqa: E731
    assert cur.next_task(tasks, cat) == "easy-1"
    cur.observe_group("easy", [1, 1], [10, 12], [True, True])
    cur.observe_group("hard", [5, 7], [300, 200], [True, False])
    assert cur.saturated is False  # mean of 1.0 and 0.5 < 0.8
    cur.observe_group("easy", [1, 1], [10, 10], [True, True])
    cur.observe_group("easy", [1, 1], [10, 10], [True, True])
    assert cur.saturated  # the window now holds two fully passed groups
    assert cur.next_task(["easy-2", "hard-2"], cat) == "hard-2"
    assert cur.next_task([], cat) is None


def test_curriculum_window_follows_admission_order_not_completion_order():
    """Groups 0-2 finishing in any order (or observed again by a resumed run) leave the same window."""
    groups = {0: [False, False], 1: [True, True], 2: [True, True]}
    windows = set()
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        cur = Curriculum(CurriculumConfig(saturation=0.8, window=2))
        for index in order:
            cur.observe_group("all", [1, 1], [5, 5], groups[index], order=index)
        windows.add((tuple(cur.recent), cur.saturated))
    assert windows == {(((1, 1.0), (2, 1.0)), True)}


# --- reconciler with a scripted backend: staleness admission, retries -----
@dataclass(frozen=True)
class T:
    id: str


class ScriptedBackend:
    """Runs nothing by itself: the test finishes rollouts in the order it chooses."""

    def __init__(self) -> None:
        self.version = 0
        self.pending: dict[str, tuple] = {}

    def submit(self, slot_id, task, seed, done) -> None:
        self.pending[slot_id] = (task, seed, done)

    def finish(self, slot_id, reward=None, error=None) -> None:
        task, seed, done = self.pending.pop(slot_id)
        if error is not None:
            done(slot_id, None, error)
            return
        seg = Segment()
        seg.extend_prompt([1, 2])
        seg.extend_sampled([3], [-0.5], [self.version])
        traj = Trajectory(task_id=task.id, segments=[seg], turns=1, reward=reward,
                          reward_parts={"total": reward, "pass": float(reward >= 1)})
        done(slot_id, traj, None)

    def update_weights(self, version):
        self.version = version

    def close(self):
        pass


def _reconciler(tmp_path, negative_scale: float = 1.0, **cfg):
    backend = ScriptedBackend()
    rc = Reconciler(ledger=Ledger(tmp_path / "l.jsonl"), tasks=[T(f"t{i}") for i in range(8)],
                    category=lambda t: "all", backend=backend,
                    cfg=RolloutConfig(**{"group_size": 2, "groups_per_step": 1, "workers": 16, **cfg}),
                    curriculum=Curriculum(CurriculumConfig(enabled=False)), rollouts_dir=tmp_path / "r",
                    seed=0, version=0, negative_scale=negative_scale)
    rc.start()
    return rc, backend


def test_admission_bounds_untrained_groups_and_the_guard_waits_for_old_ones(tmp_path):
    rc, backend = _reconciler(tmp_path, max_staleness=1)
    # (S + 1) * G = 2 groups admitted at version 0, nothing more
    assert sorted(backend.pending) == ["g00000-t0/0", "g00000-t0/1", "g00001-t1/0", "g00001-t1/1"]
    backend.finish("g00001-t1/0", 1.0)
    backend.finish("g00001-t1/1", 0.0)
    batch = rc.next_batch(timeout=1)   # group 1 may go first: group 0 can still be trained at v = 1
    assert [g.group_id for g in batch.groups] == ["g00001-t1"]
    assert sorted(rc.ledger.slots[s].advantage for s in batch.slot_ids) == [-0.5, 0.5]
    assert sorted(batch.trajectories[s].reward for s in batch.slot_ids) == [0.0, 1.0]
    assert sorted(s.advantage for s in batch.samples()) == [-0.5, 0.5]   # what the trainer eats
    backend.update_weights(1)
    rc.commit(batch, 1)
    assert {s for s in backend.pending if s.startswith("g00002")} == {"g00002-t2/0", "g00002-t2/1"}
    backend.finish("g00002-t2/0", 1.0)
    backend.finish("g00002-t2/1", 1.0)
    # group 2 is ready, but training it would leave group 0 (admitted at v0) beyond S = 1
    with pytest.raises(TimeoutError):
        rc.next_batch(timeout=0.2)
    backend.finish("g00000-t0/0", 0.0)
    backend.finish("g00000-t0/1", 1.0)
    assert [g.group_id for g in rc.next_batch(timeout=1).groups] == ["g00000-t0"]


def test_sync_mode_admits_one_batch_at_a_time(tmp_path):
    rc, backend = _reconciler(tmp_path, mode="sync", max_staleness=3)
    assert {s.split("/")[0] for s in backend.pending} == {"g00000-t0"}


def test_infra_failures_are_retried_then_excluded_never_scored(tmp_path):
    rc, backend = _reconciler(tmp_path, max_staleness=0, max_retries=1, min_valid=1, retry_backoff_s=0)
    seed = backend.pending["g00000-t0/0"][1]
    backend.finish("g00000-t0/0", error=InfraError("sandbox died"))
    assert rc.ledger.slots["g00000-t0/0"].state == "running"  # re-queued and relaunched (no backoff here)
    assert rc.ledger.slots["g00000-t0/0"].attempt == 1
    assert backend.pending["g00000-t0/0"][1] == seed   # the same draw (rollout_seed says why)
    backend.finish("g00000-t0/0", error=InfraError("sandbox died again"))
    assert rc.ledger.slots["g00000-t0/0"].state == "dropped"
    backend.finish("g00000-t0/1", 0.25)
    batch = rc.next_batch(timeout=1)
    assert batch.slot_ids == ["g00000-t0/1"]
    assert rc.ledger.slots["g00000-t0/1"].advantage == 0.0  # alone in its group: mean is its own reward
    assert rc.ledger.slots["g00000-t0/0"].reward is None


def test_resume_reruns_in_flight_rollouts_and_keeps_graded_ones(tmp_path):
    rc, backend = _reconciler(tmp_path, max_staleness=0)
    first_seed = backend.pending["g00000-t0/1"][1]
    backend.finish("g00000-t0/0", 1.0)
    rc.close()
    rc.ledger.close()
    ledger = Ledger.load(tmp_path / "l.jsonl", committed_step=0)
    backend2 = ScriptedBackend()
    rc2 = Reconciler(ledger=ledger, tasks=[T(f"t{i}") for i in range(8)], category=lambda t: "all",
                     backend=backend2, cfg=RolloutConfig(group_size=2, groups_per_step=1, max_staleness=0),
                     curriculum=Curriculum(CurriculumConfig(enabled=False)), rollouts_dir=tmp_path / "r",
                     seed=0, version=0)
    rc2.start()
    assert list(backend2.pending) == ["g00000-t0/1"]   # only the lost one runs again
    # at the same attempt and seed: a kill is not the rollout's failure, and the re-run samples what
    # the lost one would have (so a resumed run can equal an uninterrupted one)
    assert ledger.slots["g00000-t0/1"].attempt == 0
    assert backend2.pending["g00000-t0/1"][1] == first_seed
    backend2.finish("g00000-t0/1", 0.0)
    batch = rc2.next_batch(timeout=1)
    assert sorted(batch.slot_ids) == ["g00000-t0/0", "g00000-t0/1"]
    # the slot graded before the restart comes back from its file, the other from memory
    assert batch.trajectories["g00000-t0/0"].reward == 1.0 and batch.trajectories["g00000-t0/1"].reward == 0.0


def test_deferred_sync_still_hands_each_event_to_the_os_at_once(tmp_path):
    ledger = Ledger(tmp_path / "l.jsonl")
    with ledger.deferred_sync():
        ledger.add_group("g0", "t0", 2, 0)
        ledger.set("g0/0", "running", start_version=0)
        seen = Ledger.load(tmp_path / "l.jsonl")   # what a kill -9 now would leave
        assert seen.slots["g0/0"].state == "running"
    ledger.close()


@pytest.mark.parametrize("skip", [False, True])
def test_tied_groups_are_trained_or_replaced_by_another_task(tmp_path, skip):
    """A group whose members all scored the same has no advantage. By default it is trained
    anyway; with skip_tied_groups it is dropped with its reason, another task is admitted in its
    place, the next batch is a group with signal, and the counters say how many were skipped."""
    rc, backend = _reconciler(tmp_path, max_staleness=0, skip_tied_groups=skip)
    backend.finish("g00000-t0/0", 0.5)
    backend.finish("g00000-t0/1", 0.5)
    if not skip:
        assert [g.group_id for g in rc.next_batch(timeout=1).groups] == ["g00000-t0"]
        assert rc.take_counters().tied_groups == 0
        return
    assert rc.ledger.groups["g00000-t0"].dropped.startswith("tied: every member scored 0.5")
    assert {s.split("/")[0] for s in backend.pending} == {"g00001-t1"}
    with pytest.raises(TimeoutError):
        rc.next_batch(timeout=0.2)
    backend.finish("g00001-t1/0", 0.0)
    backend.finish("g00001-t1/1", 1.0)
    batch = rc.next_batch(timeout=1)
    assert [g.group_id for g in batch.groups] == ["g00001-t1"]
    assert rc.take_counters().tied_groups == 1
    # a resumed run sees the same: the tied group stays dropped, nothing is admitted twice
    rc.close()
    rc.ledger.close()
    rc2 = Reconciler(ledger=Ledger.load(tmp_path / "l.jsonl"), tasks=[T(f"t{i}") for i in range(8)],
                     category=lambda t: "all", backend=ScriptedBackend(),
                     cfg=RolloutConfig(group_size=2, groups_per_step=1, workers=16, skip_tied_groups=True),
                     curriculum=Curriculum(CurriculumConfig(enabled=False)), rollouts_dir=tmp_path / "r",
                     seed=0, version=0)
    rc2.start()
    assert rc2.ledger.groups["g00000-t0"].dropped.startswith("tied")
    assert [g.group_id for g in rc2.next_batch(timeout=1).groups] == ["g00001-t1"]


def test_a_batchs_samples_carry_their_final_advantage(tmp_path):
    """The ledger records each member's final advantage (`negative_advantage_scale` applied to those
    below the group's mean), and the batch's samples carry it: the trainer changes none."""
    rc, backend = _reconciler(tmp_path, negative_scale=0.25, max_staleness=0)
    backend.finish("g00000-t0/0", 1.0)
    backend.finish("g00000-t0/1", 0.0)
    batch = rc.next_batch(timeout=1)
    assert [rc.ledger.slots[sid].advantage for sid in batch.slot_ids] == [0.5, -0.125]
    assert [s.advantage for s in batch.samples()] == [0.5, -0.125]
