"""The shared server against queueing theory's closed forms and its own contract."""

from __future__ import annotations

import random

import pytest
import simpy

from atelier.sim.fluid import ServerDown, SharedServer


def _mm1_mean_sojourn(lam: float, mu: float, jobs: int, shared: bool, seed: int = 0) -> float:
    rng = random.Random(seed)
    env = simpy.Environment()
    server = SharedServer(env, (lambda n: mu / n) if shared else (lambda n: mu), max_jobs=None if shared else 1)
    sojourns: list[float] = []

    def customer():
        arrived = env.now
        yield server.submit(rng.expovariate(1.0))
        sojourns.append(env.now - arrived)

    def arrivals():
        for _ in range(jobs):
            yield env.timeout(rng.expovariate(lam))
            env.process(customer())

    env.process(arrivals())
    env.run()
    return sum(sojourns) / len(sojourns)


@pytest.mark.parametrize("shared", [False, True], ids=["one at a time (FCFS)", "processor sharing"])
@pytest.mark.parametrize("load", [0.5, 0.8])
def test_a_single_queue_has_the_mean_time_in_system_of_mm1(shared, load):
    """M/M/1 (and M/M/1-PS, whose mean is the same): E[T] = 1 / (mu - lambda)."""
    mu = 1.0
    got = _mm1_mean_sojourn(load * mu, mu, jobs=40_000, shared=shared)
    assert got == pytest.approx(1 / (mu - load * mu), rel=0.06)


def test_jobs_decoding_together_share_each_step():
    """n sequences in one batch: a step of n takes a + c n, so k tokens take k (a + c n)."""
    env = simpy.Environment()
    a, c = 0.01, 0.002
    server = SharedServer(env, lambda n: 1 / (a + c * n))
    done = {}

    def job(name, tokens, start):
        yield env.timeout(start)
        yield server.submit(tokens)
        done[name] = env.now

    env.process(job("short", 10, 0.0))
    env.process(job("long", 30, 0.0))
    env.run()
    assert done["short"] == pytest.approx(10 * (a + 2 * c))                  # 10 steps of two
    assert done["long"] == pytest.approx(10 * (a + 2 * c) + 20 * (a + c))   # then 20 alone


def test_a_stall_delays_every_running_job_and_versions_split_the_work():
    env = simpy.Environment()
    server = SharedServer(env, lambda n: 1.0)
    out = {}

    def job():
        out["job"] = yield server.submit(10.0)
        out["t"] = env.now

    def swap():
        yield env.timeout(4.0)
        server.stall(2.0)
        yield env.timeout(2.0)
        server.mark(1)

    env.process(job())
    env.process(swap())
    env.run()
    assert out["t"] == pytest.approx(12.0)
    assert out["job"].version_work == pytest.approx({0: 4.0, 1: 6.0})


def test_an_outage_fails_running_jobs_and_holds_new_ones_until_it_is_back():
    env = simpy.Environment()
    server = SharedServer(env, lambda n: 1.0, max_jobs=1)
    seen = {}

    def running():
        try:
            yield server.submit(5.0)
        except ServerDown:
            seen["running"] = ("failed", env.now)

    def later():
        yield env.timeout(2.0)
        yield server.submit(1.0)
        seen["later"] = env.now

    def outage():
        yield env.timeout(1.0)
        assert server.fail() == 1
        yield env.timeout(3.0)
        server.restore()

    for p in (running, later, outage):
        env.process(p())
    env.run()
    assert seen == {"running": ("failed", 1.0), "later": 5.0}


def test_kv_capacity_holds_a_call_that_does_not_fit():
    env = simpy.Environment()
    server = SharedServer(env, lambda n: 1.0, capacity=100)
    ends = []

    def job(size):
        yield server.submit(3.0, size=size)
        ends.append((size, env.now))

    env.process(job(80))
    env.process(job(40))
    env.run()
    assert ends == [(80, 3.0), (40, 6.0)]


def test_servers_sharing_cores_slow_each_other_only_while_both_are_busy():
    """Two cores, a trainer keeping 2 busy and an engine 1: together each runs at 2/3."""
    from atelier.sim.fluid import Cores

    env = simpy.Environment()
    trainer, engine = SharedServer(env, lambda n: 1.0), SharedServer(env, lambda n: 1.0)
    cores = Cores(2)
    cores.add(trainer, 2)
    cores.add(engine, 1)
    ends = {}

    def run(name, server, start, work):
        yield env.timeout(start)
        yield server.submit(work)
        ends[name] = env.now

    env.process(run("trainer", trainer, 0.0, 2.0))
    env.process(run("engine", engine, 1.0, 2.0))
    env.run()
    # trainer: 1 s alone, then its last unit at 2/3 (1.5 s); the engine did 1 unit meanwhile, 1 more alone
    assert ends == pytest.approx({"trainer": 2.5, "engine": 3.5})
