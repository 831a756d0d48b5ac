"""The cluster file: what `atelier simulate` simulates, one pydantic model per component.

A cluster file is TOML, read like a recipe (`--set key=value` overrides, typos named). Its
`[rollout]` section is RL's own `atelier.rl.config.RolloutConfig`, so the group size, the
staleness bound, the workers, the retries and `mode` mean here what they mean in
`atelier train`. Every other section describes a component by the few numbers its model
needs; `atelier simulate calibrate RUN_DIR` writes them from a real run, and `[sources]` says
for each number whether it was measured (and where), is a published figure, or an assumption.

Units: seconds, bytes, tokens. A bandwidth of 0 means unbounded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from atelier.config import AtelierConfig
from atelier.rl.config import RolloutConfig


class TrainerSpec(AtelierConfig):
    """Trainer ranks: a step's time from the positions it trains, the collectives, checkpoints."""

    region: str = "local"
    ranks: int = Field(1, ge=1)
    """Data-parallel ranks; the step's positions are balanced across them (global packing)."""
    gpus_per_rank: int = Field(1, ge=1)
    """GPUs behind one rank (tensor/expert parallel inside it): what `atelier simulate sweep` counts."""
    startup_s: float = Field(0.0, ge=0)
    """From the run's start to the trainer's first wait for a batch (model, engine, sandboxes up)."""
    shutdown_s: float = Field(0.0, ge=0)
    """After the last step: the final checkpoint and summary."""
    step_fixed_s: float = Field(0.0, ge=0)
    """A step's time whatever its batch (optimizer step, launch overheads)."""
    step_s_per_position: float = Field(0.0, ge=0)
    """One rank's seconds per position it runs forward and backward."""
    grad_bytes: float = Field(0.0, ge=0)
    """Bytes of gradient each rank reduces per step (a ring all-reduce moves 2 (N-1)/N of them)."""
    collective_bytes_per_s: float = Field(0.0, ge=0)
    collective_latency_s: float = Field(0.0, ge=0)
    step_overhead_s: float = Field(0.0, ge=0)
    """Per step besides training, publishing and the swap: bookkeeping, the metrics line."""
    checkpoint_every: int = Field(1, ge=1)
    checkpoint_s: float = Field(0.0, ge=0)
    restart_s: float = Field(60.0, ge=0)
    """A lost trainer node back (a warm standby takes over, or the job is restarted); `startup_s`
    then runs again before the resumed run's first step."""


class InferenceSpec(AtelierConfig):
    """Inference replicas: continuous batching, prefill, prefix cache, the weight swap."""

    region: str = "local"
    regions: list[str] = Field(default_factory=list)
    """Replica i is in regions[i % len(regions)] (empty: all in `region`)."""
    replicas: int = Field(1, ge=1)
    gpus_per_replica: int = Field(1, ge=1)
    workers_per_replica: int = Field(0, ge=0)
    """Rollouts at once per replica, so the workers follow the replicas in a sweep (0: `rollout.workers`)."""
    max_batch: int = Field(32, ge=1)
    """Sequences decoded at once per replica; more wait."""
    kv_tokens: int = Field(0, ge=0)
    """KV memory of a replica in token positions (0: unbounded); a call that does not fit waits."""
    decode_step_s: float = Field(0.01, gt=0)
    """A decode step's time with one sequence."""
    decode_step_s_per_seq: float = Field(0.0, ge=0)
    """What each further running sequence adds to a decode step."""
    prefill_s_per_token: float = Field(0.0, ge=0)
    """Prefill time per context token not found in the prefix cache (every running sequence
    waits for it)."""
    call_s: float = Field(0.0, ge=0)
    """Per model call outside the engine's steps: the client, tokenizing, the network stack."""
    prefix_cache: bool = True
    """A rollout's earlier context is reused by its next call on the same replica, until a weight
    swap clears the cache (as both engines do)."""
    warmup_s: float = Field(0.0, ge=0)
    """A one-off pause at a replica's first call (kernels built on the first steps)."""
    swap_s: float = Field(0.0, ge=0)
    """The pause of a weight swap: every sequence on the replica waits."""
    restart_s: float = Field(60.0, ge=0)
    """A killed replica back up (a server start); it then loads the newest weights."""


class HostSpec(AtelierConfig):
    """One machine whose CPU cores the trainer and the engine share (a laptop, a CPU box)."""

    cores: float = Field(0.0, ge=0)
    """0: trainer and inference have their own hardware. Otherwise, while a training step and a
    decoding engine together keep more than `cores` busy, both run at `cores` / their demand."""
    trainer_cores: float = Field(1.0, gt=0)
    """Cores a training step keeps busy (its threads, times the ranks on this machine)."""
    engine_cores: float = Field(1.0, gt=0)
    """Cores a decoding engine keeps busy."""


class SandboxSpec(AtelierConfig):
    """Environment hosts: placement, admission by pressure, the environment's time."""

    region: str = "local"
    regions: list[str] = Field(default_factory=list)
    """Host i is in regions[i % len(regions)] (empty: all in `region`)."""
    hosts: int = Field(1, ge=1)
    cores_per_host: float = Field(0.0, ge=0)
    """0: environment time is replayed as measured (no contention model). Otherwise
    `cpu_fraction` of it is CPU work shared by the host's running sandboxes."""
    cpu_fraction: float = Field(0.0, ge=0, le=1)
    max_load_per_cpu: float = Field(4.0, gt=0)
    """The pool's admission threshold (`atelier.sandbox.pool.SandboxPool`): a creation waits while the
    host's load per CPU is above it, for at most `max_defer_s`."""
    max_defer_s: float = Field(5.0, ge=0)
    create_s: float = Field(0.0, ge=0)
    """Creating a sandbox, on top of what the workload's rollouts measured before their first call."""


class SyncSpec(AtelierConfig):
    """Weight sync: what a publish writes, how fast it is uploaded and read back."""

    kind: Literal["inprocess", "delta"] = "delta"
    full_every: int = Field(10, ge=1)
    full_bytes: float = Field(0.0, ge=0)
    delta_bytes: float = Field(0.0, ge=0)
    publish_fixed_s: float = Field(0.0, ge=0)
    """The trainer's time to diff and compress (or, in process, copy), apart from moving bytes."""
    upload_bytes_per_s: float = Field(0.0, ge=0)
    """One rank's upload to the shared storage; each of N ranks uploads 1/N of a publish."""
    storage_bytes_per_s: float = Field(0.0, ge=0)
    """The storage's whole ingress and egress."""
    read_bytes_per_s: float = Field(0.0, ge=0)
    """One replica's download from the storage."""
    region: str = "local"
    """Where the storage is."""


class LinkSpec(AtelierConfig):
    """Two regions: a one-way latency and the bandwidth between them."""

    a: str
    b: str
    latency_s: float = Field(0.0, ge=0)
    bytes_per_s: float = Field(0.0, ge=0)


class WorkloadSpec(AtelierConfig):
    """The rollouts: replayed from a real run's trajectories, or drawn from distributions."""

    run_dir: str = ""
    """Replay the groups of this run (each admitted group draws one of them at random)."""
    turns: float = Field(1.0, ge=1)
    turns_cv: float = Field(0.0, ge=0)
    prompt_tokens: float = Field(100.0, ge=0)
    sampled_tokens_per_turn: float = Field(100.0, ge=1)
    sampled_cv: float = Field(0.0, ge=0)
    tool_tokens_per_turn: float = Field(0.0, ge=0)
    """Tokens a tool's output adds to the context after each turn."""
    tool_s_per_turn: float = Field(0.0, ge=0)
    tool_cv: float = Field(0.0, ge=0)
    setup_s: float = Field(0.0, ge=0)
    grade_s: float = Field(0.0, ge=0)
    task_cv: float = Field(0.0, ge=0)
    """Spread of a task's length factor, shared by the members of its group (hard tasks are long
    for every member)."""
    pass_rate: float = Field(0.5, ge=0, le=1)
    """Each member passes (reward 1) with this probability, else scores 0."""


class FaultSpec(AtelierConfig):
    kind: Literal["inference_down", "sandbox_down", "trainer_lost"]
    at_s: float = Field(-1.0)
    """When, from the run's start (negative: see `after_step`)."""
    after_step: int = Field(0, ge=0)
    """Or: once step k's metrics line is written, before its commit (where a test's `on_step`
    callback runs)."""
    duration_s: float = Field(-1.0)
    """How long the component stays down; negative: the component's own restart time
    (`inference.restart_s`, `trainer.restart_s`). A sandbox outage needs it."""
    target: int = Field(-1)
    """Which replica or host (-1: all of them, or all of `region`'s)."""
    region: str = ""
    """Only the replicas or hosts of this region (a whole region down)."""

    @model_validator(mode="after")
    def _outage_has_a_length(self) -> "FaultSpec":
        if (self.at_s < 0) == (self.after_step == 0):
            raise ValueError("a fault needs exactly one of at_s (seconds from the start) and after_step")
        if self.kind == "sandbox_down" and self.duration_s < 0:
            raise ValueError("a sandbox_down fault needs duration_s (how long the hosts stay down)")
        return self


class SimConfig(AtelierConfig):
    name: str = ""
    seed: int = 0
    steps: int = Field(10, ge=1)
    """Optimizer steps to simulate (each trains `rollout.groups_per_step` groups)."""
    tasks: int = Field(0, ge=0)
    """Tasks in the epoch (a task is admitted once); 0: as many as the steps need (at most 20
    times as many groups as the steps train, so that a run whose groups are all dropped ends)."""
    resume_after_stop_s: float = -1.0
    """When the failure breaker stops the run: restart it after this many seconds (a supervisor's
    `atelier train` again); negative: the run stays stopped, as `atelier train` leaves it."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    inference: InferenceSpec = Field(default_factory=InferenceSpec)
    sandboxes: SandboxSpec = Field(default_factory=SandboxSpec)
    host: HostSpec = Field(default_factory=HostSpec)
    sync: SyncSpec = Field(default_factory=SyncSpec)
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    links: list[LinkSpec] = Field(default_factory=list)
    faults: list[FaultSpec] = Field(default_factory=list)
    sources: dict[str, str] = Field(default_factory=dict)
    """For each input (a dotted key), where it comes from: "measured: ...", "published: ...",
    "assumed: ..."."""

    def replica_region(self, i: int) -> str:
        regions = self.inference.regions or [self.inference.region]
        return regions[i % len(regions)]

    def host_region(self, i: int) -> str:
        regions = self.sandboxes.regions or [self.sandboxes.region]
        return regions[i % len(regions)]

    def workers(self) -> int:
        per = self.inference.workers_per_replica
        return per * self.inference.replicas if per else self.rollout.workers

    def link(self, a: str, b: str) -> LinkSpec:
        """The link between two regions (a region to itself: no latency, unbounded)."""
        for link in self.links:
            if {link.a, link.b} == {a, b}:
                return link
        return LinkSpec(a=a, b=b)
