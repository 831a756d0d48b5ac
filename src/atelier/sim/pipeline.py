"""The simulated run: SimPy processes for the trainer, each rollout, the weight sync and faults.

One `Pipeline` is one `atelier train` run, in the order `atelier.rl.run` takes its steps:

    startup; then, while the reconciler has a batch (the trainer idles until it does):
        train (positions / ranks, plus the all-reduce), checkpoint every N steps,
        publish (the delta chain's `publish_kind`; a sharded upload), every replica reads what
        `chain_reads` says it lacks and swaps (a pause of its decoding), the metrics line,
        commit (the version moves, groups are admitted at it)
    shutdown.

Rollouts run beside it, at most `rollout.workers` at once, each a `RolloutProfile`: time
before its first call, then per turn a model call on its replica (network latency, a prefill of
the context not cached, the sampled tokens decoded in the replica's continuous batch) and the
environment's time on its host. A failure (a replica or host down) is an infrastructure
failure: retried after `retry_delay`, counted by the breaker, exactly as the reconciler does
(`atelier.sim.state`).

Faults (`[[faults]]`): `inference_down` kills a replica (its running calls fail, later calls
wait until it is back, as atelier's vLLM engine does, restarted at the weights it had);
`sandbox_down` takes hosts away (rollouts on them fail, new ones placed there fail at once);
`trainer_lost` ends the run's process and resumes it from its newest checkpoint after
`trainer.restart_s` and `startup_s`, as `atelier train` resumes (running rollouts run again,
steps after the checkpoint are trained again, the engine starts at the checkpoint's weights).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import simpy

from atelier.rl.chain import FULL, chain_reads, publish_kind
from atelier.sandbox.pool import least_loaded
from atelier.sandbox.pressure import CpuPressure, admission_wait_reason
from atelier.sim.cluster import SimConfig
from atelier.sim.fluid import Cores, ServerDown, SharedServer
from atelier.sim.results import SimResult, StepRecord
from atelier.sim.state import SimLedger, SimSlot
from atelier.sim.workload import Turn, Workload

DEFER_STEP_S = 0.1   # the pool's admission re-reads pressure this often (atelier.sandbox.pool)


class HostDown(Exception):
    """The sandbox host went away while a rollout used it."""


@dataclass
class Replica:
    server: SharedServer
    region: str
    held: int = 0                  # the weights' step it serves
    epoch: int = 0                 # bumped by every swap and restart: cached prefixes older than it are gone
    placed: int = 0                # rollouts placed on it
    warm: bool = False             # its first call paid the warm-up


@dataclass
class Host:
    cpu: SharedServer | None
    region: str
    up: bool = True
    down: simpy.Event | None = None
    placed: int = 0


@dataclass
class Clock:
    """The trainer's own account, for the result."""

    idle_s: float = 0.0
    busy_s: float = 0.0
    checkpoint_step: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)


class Pipeline:
    def __init__(self, cfg: SimConfig, workload: Workload) -> None:
        self.cfg, self.workload = cfg, workload
        self.env = simpy.Environment()
        self.rng = random.Random(cfg.seed)
        rollout = cfg.rollout.model_copy(update={"workers": cfg.workers()})
        self.ledger = SimLedger(rollout, steps=cfg.steps, tasks=cfg.tasks)
        self.clock = Clock()
        self.alive = False           # the run's process is up (not starting, not restarting)
        self.generation = 0          # bumped when the process dies: its rollouts' results are lost
        self.chain: list[tuple[int, str]] = [(0, FULL)] if cfg.sync.kind == "delta" else []
        inf = cfg.inference
        def rate(n: int) -> float:   # tokens per second of each of n sequences decoding together
            return 1.0 / (inf.decode_step_s + inf.decode_step_s_per_seq * n)

        self.replicas = [Replica(SharedServer(self.env, rate, max_jobs=inf.max_batch, capacity=inf.kv_tokens or None),
                                 cfg.replica_region(i)) for i in range(inf.replicas)]
        cores = cfg.sandboxes.cores_per_host
        self.hosts = [Host(SharedServer(self.env, (lambda n, c=cores: min(1.0, c / n))) if cores else None,
                           cfg.host_region(i), down=self.env.event()) for i in range(cfg.sandboxes.hosts)]
        self.trainer_cpu = SharedServer(self.env, lambda n: 1.0)
        if cfg.host.cores:
            cores = Cores(cfg.host.cores)
            cores.add(self.trainer_cpu, cfg.host.trainer_cores)
            for r in self.replicas:
                cores.add(r.server, cfg.host.engine_cores)
        self._turn = {"replica": 0, "host": 0}
        self._fired: list[int] = []      # steps whose after_step faults fired (a retrained step fires none)
        self._changed = self.env.event()
        self._trainer = self.env.process(self._trainer_lives())
        for fault in cfg.faults:
            if fault.at_s >= 0:
                self.env.process(self._fault(fault))

    def run(self) -> SimResult:
        self.env.run(until=self._trainer)
        return SimResult.build(self.cfg, self.env.now, self.ledger, self.clock)

    # -- the reconciler's pump ----------------------------------------------------------
    def _notify(self) -> None:
        if not self._changed.triggered:
            self._changed.succeed()

    def _pump(self) -> None:
        if not self.alive or self.ledger.fatal is not None:
            return
        while self.ledger.wants_group():
            self.ledger.admit(self.workload.draw_group(self.cfg.rollout.group_size, self.rng))
        for slot in self.ledger.launchable(self.env.now):
            slot.state, slot.started = "running", self.env.now
            self.ledger.running += 1
            self.env.process(self._rollout(slot, self.generation))

    def _wake_after(self, delay: float):
        yield self.env.timeout(delay)
        self._pump()

    # -- one rollout ------------------------------------------------------------------------
    def _place(self, kind: str, items: list) -> int:
        i = least_loaded([x.placed for x in items], self._turn[kind])
        self._turn[kind] = (i + 1) % len(items)
        return i

    def _rollout(self, slot: SimSlot, generation: int):
        replica = self.replicas[self._place("replica", self.replicas)]
        host = self.hosts[self._place("host", self.hosts)]
        replica.placed += 1
        host.placed += 1
        versions: Counter = Counter()
        failure = None
        try:
            yield from self._admit_sandbox(host)
            yield from self._env_time(host, slot.profile.setup_s + self.cfg.sandboxes.create_s)
            cached, epoch = 0, -1
            latency = self.cfg.link(host.region, replica.region).latency_s
            for turn in slot.profile.turns:
                hit = cached if (self.cfg.inference.prefix_cache and epoch == replica.epoch) else 0
                job = yield from self._model_call(replica, turn, hit, latency)
                for version, tokens in job.version_work.items():
                    versions[version] += tokens
                cached, epoch = turn.context + turn.sampled, replica.epoch
                yield from self._env_time(host, turn.after_s)
        except (ServerDown, HostDown) as exc:
            failure = type(exc).__name__
        finally:
            replica.placed -= 1
            host.placed -= 1
        if generation != self.generation:
            return   # the process that launched it is gone; the resumed run runs the slot again
        if failure is None:
            self.ledger.graded(slot, _whole_tokens(versions, slot.profile.sampled))
        else:
            delay = self.ledger.failed(slot, self.env.now, failure)
            if delay:
                self.env.process(self._wake_after(delay))
        self._pump()
        self._notify()

    def _model_call(self, replica: Replica, turn: Turn, cached: int, latency: float):
        inf = self.cfg.inference
        yield self.env.timeout(2 * latency + inf.call_s)
        if not replica.warm and inf.warmup_s:
            replica.server.stall(inf.warmup_s)
        replica.warm = True
        new = max(0, turn.context - cached)
        if new and inf.prefill_s_per_token and replica.server.up:
            replica.server.stall(new * inf.prefill_s_per_token)
        job = yield replica.server.submit(turn.sampled, size=turn.context + turn.sampled)
        return job

    def _admit_sandbox(self, host: Host):
        """The pool's admission (`admission_wait_reason`): wait in short steps while the host's load
        per CPU is over the threshold, at most `max_defer_s`."""
        spec = self.cfg.sandboxes
        if not host.up:
            raise HostDown("the sandbox host is down")
        if host.cpu is None:
            return
        waited = 0.0
        while waited < spec.max_defer_s:
            load = CpuPressure("loadavg", host.cpu.running / spec.cores_per_host)
            if admission_wait_reason(None, load, min_available_mb=0, max_load_per_cpu=spec.max_load_per_cpu,
                                     max_cpu_pressure=100.0) is None:
                return
            yield self.env.timeout(DEFER_STEP_S)
            waited += DEFER_STEP_S

    def _env_time(self, host: Host, seconds: float):
        if seconds <= 0:
            return
        if not host.up:
            raise HostDown("the sandbox host is down")
        cpu = self.cfg.sandboxes.cpu_fraction if host.cpu is not None else 0.0
        parts = [self.env.timeout(seconds * (1 - cpu))] if cpu < 1 else []
        if cpu > 0:
            parts.append(host.cpu.submit(seconds * cpu))
        down = host.down
        yield self.env.all_of(parts) | down
        if down.triggered:
            raise HostDown("the sandbox host went down")

    # -- the trainer ----------------------------------------------------------------------
    def _trainer_lives(self):
        """The run's process: started, and started again after each loss or stop."""
        delay = self.cfg.trainer.startup_s
        while True:
            try:
                yield self.env.timeout(delay)
                self.alive = True
                self._pump()
                ended = yield from self._train_loop()
            except simpy.Interrupt as lost:
                delay = lost.cause
                continue
            if ended == "finished" or self.cfg.resume_after_stop_s < 0:
                break
            self._die()
            delay = self.cfg.resume_after_stop_s + self.cfg.trainer.startup_s
        yield self.env.timeout(self.cfg.trainer.shutdown_s)

    def _train_loop(self):
        ledger, clock = self.ledger, self.clock
        while True:
            waited = self.env.now
            while True:
                if ledger.fatal is not None:
                    clock.stops.append(f"{self.env.now:.1f}s: {ledger.fatal.message}")
                    return "stopped"
                if ledger.finished():
                    return "finished"
                batch = ledger.batch()
                if batch is not None:
                    break
                self._changed = self.env.event()
                yield self._changed
            idle, began = self.env.now - waited, self.env.now
            step = ledger.version + 1
            slots = [s for g in batch for s in g.members if s.state == "ready"]
            stale = Counter()
            for s in slots:
                for version, tokens in s.versions.items():
                    stale[ledger.version - version] += tokens
            yield self.trainer_cpu.submit(self._train_s(sum(s.profile.length for s in slots)))
            t = self.cfg.trainer
            if step % t.checkpoint_every == 0:
                yield self.env.timeout(t.checkpoint_s)
                clock.checkpoint_step = step
            yield from self._publish(step)
            yield from self._swap_all(step)
            yield self.env.timeout(t.step_overhead_s)
            for fault in self.cfg.faults:
                if fault.after_step == step and step > len(self._fired):
                    self._fired.append(step)
                    self.env.process(self._fault(fault))
            ledger.commit(batch, step)
            clock.idle_s += idle
            clock.busy_s += self.env.now - began
            clock.steps.append(StepRecord(step, self.env.now, idle, self.env.now - began, len(slots), dict(stale),
                                          sum(s.profile.sampled for s in slots)))
            self._pump()

    def _train_s(self, positions: int) -> float:
        t = self.cfg.trainer
        n = t.ranks
        reduce = 0.0
        if n > 1 and t.grad_bytes:
            bw = t.collective_bytes_per_s or float("inf")
            reduce = 2 * (n - 1) / n * t.grad_bytes / bw + 2 * (n - 1) * t.collective_latency_s
        return t.step_fixed_s + t.step_s_per_position * positions / n + reduce

    def _publish(self, step: int):
        sync, t = self.cfg.sync, self.cfg.trainer
        if sync.kind != "delta":
            yield self.env.timeout(sync.publish_fixed_s)
            return
        kind = publish_kind(step, full_every=sync.full_every, has_previous=bool(self.chain))
        size = sync.full_bytes if kind == FULL else sync.delta_bytes
        link = self.cfg.link(t.region, sync.region)
        rate = _lowest(t.ranks * sync.upload_bytes_per_s, sync.storage_bytes_per_s, link.bytes_per_s)
        yield self.env.timeout(sync.publish_fixed_s + link.latency_s + size / rate)
        self.chain.append((step, kind))

    def _swap_all(self, step: int):
        yield self.env.all_of([self.env.process(self._swap(r, step, self.generation)) for r in self.replicas])

    def _swap(self, replica: Replica, step: int, generation: int):
        """Read what the replica lacks of the chain, then pause its decoding for the swap. A replica
        that is down is updated once it is back (the update waits behind the restart)."""
        while not replica.server.up:
            yield self.env.timeout(1.0)
        sync, inf = self.cfg.sync, self.cfg.inference
        if sync.kind == "delta":
            base, deltas = chain_reads(self.chain, replica.held)
            size = (sync.full_bytes if base is not None else 0.0) + sync.delta_bytes * len(deltas)
            link = self.cfg.link(sync.region, replica.region)
            same_region = sum(1 for r in self.replicas if r.region == replica.region)
            rate = _lowest(sync.read_bytes_per_s, sync.storage_bytes_per_s / same_region,
                           link.bytes_per_s / same_region)
            yield self.env.timeout(link.latency_s + size / rate)
        if generation != self.generation:
            return   # the run died meanwhile: the resumed engine starts at the checkpoint's weights
        replica.server.stall(inf.swap_s)
        yield self.env.timeout(inf.swap_s)
        if generation != self.generation:
            return
        replica.server.mark(step)
        replica.held, replica.epoch = step, replica.epoch + 1

    # -- faults -------------------------------------------------------------------------------
    def _fault(self, fault):
        yield self.env.timeout(max(fault.at_s, 0.0))
        if fault.kind == "inference_down":
            down = fault.duration_s if fault.duration_s >= 0 else self.cfg.inference.restart_s
            replicas = _targets(self.replicas, fault)
            for r in replicas:
                r.server.fail()
                r.epoch += 1
            self._notify()
            yield self.env.timeout(down)
            for r in replicas:
                r.server.restore()
        elif fault.kind == "sandbox_down":
            hosts = _targets(self.hosts, fault)
            for h in hosts:
                h.up = False
                h.down.succeed()
            yield self.env.timeout(fault.duration_s)
            for h in hosts:
                h.up, h.down = True, self.env.event()
            self._pump()
        else:
            down = fault.duration_s if fault.duration_s >= 0 else self.cfg.trainer.restart_s
            self._die()
            self.clock.stops.append(f"{self.env.now:.1f}s: trainer lost")
            if self._trainer.is_alive:
                self._trainer.interrupt(down + self.cfg.trainer.startup_s)

    def _die(self) -> None:
        """The run's process is gone: its rollouts' results with it; the resumed run starts from
        the newest checkpoint (steps after it trained again, the chain cut back to it)."""
        self.alive = False
        self.generation += 1
        ckpt = self.clock.checkpoint_step
        self.ledger.restart(ckpt)
        self.chain = [(s, k) for s, k in self.chain if s <= ckpt]
        del self.clock.steps[ckpt:]
        for r in self.replicas:
            r.server.fail()
            r.server.restore()
            r.server.mark(ckpt)
            r.held, r.epoch = ckpt, r.epoch + 1


def _targets(items: list, fault) -> list:
    """The replicas or hosts a fault takes down: one by index, a region's, or all."""
    chosen = [x for x in items if not fault.region or x.region == fault.region]
    return chosen if fault.target < 0 else [items[fault.target % len(items)]]


def _lowest(*rates: float) -> float:
    """The narrowest of several bandwidths (0: unbounded)."""
    bounded = [r for r in rates if r > 0]
    return min(bounded) if bounded else float("inf")


def _whole_tokens(versions: Counter, sampled: int) -> Counter:
    """Per-version token counts rounded to whole tokens that add up to `sampled`."""
    out = Counter({v: int(n) for v, n in versions.items()})
    left = sampled - sum(out.values())
    if left > 0 and versions:
        out[max(versions)] += left
    return out
