"""The configuration of one RL run (`atelier train RECIPE.toml`).

One pydantic model per component, composed into `TrainConfig`; every field
is documented where it is declared. Recipes live in `recipes/rl-*.toml`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from atelier.config import AtelierConfig
from atelier.harness.config import AgentConfig
from atelier.inference.config import InferenceConfig
from atelier.inference.types import DEFAULT_KV_CACHE_TOKENS, DEFAULT_PREFIX_CACHE_TOKENS
from atelier.rl.shaping import ShapingConfig


class RolloutConfig(AtelierConfig):
    mode: Literal["async", "sync"] = "async"
    """async: rollouts keep running while the trainer steps; sync: generate a batch, then train it."""
    group_size: int = Field(4, ge=1)
    """Samples per task; a group is trained only once all of its members are graded."""
    groups_per_step: int = Field(2, ge=1)
    """Groups in one optimizer step."""
    max_staleness: int = Field(1, ge=0)
    """Most policy versions between the oldest token of a sample and the weights that train on it."""
    workers: int = Field(4, ge=1)
    """Rollouts running at once (threads in one process, or Ray actors)."""
    prefix_cache_tokens: int = Field(DEFAULT_PREFIX_CACHE_TOKENS, ge=0)
    """The local engine's prefix-cache budget: earlier turns' keys and values kept for reuse (0: off)."""
    kv_cache_tokens: int = Field(DEFAULT_KV_CACHE_TOKENS, ge=64)
    """The local engine's whole KV memory in token positions; rollouts wait when it is full."""
    batch_invariant: bool = False
    """The local engine runs each rollout's forwards alone (a batch of one) with no prefix cache, so
    a rollout's tokens and logprobs depend only on its prompt, seed and weights, never on what ran
    beside it. With mode = "sync" that makes a run reproducible bit for bit: two runs with the same
    seed, or a run killed and resumed, train the same samples to the same weights
    (tests/rl/test_crash_points.py). Costs the throughput of batching."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The local engine's precision. auto: bf16 on GPUs and on CPUs with AMX or AVX512-BF16, else
    fp32. The sampler's logprobs are those of the distribution it sampled from; the trainer
    recomputes its own, and the importance weights absorb the difference."""
    max_tokens: int = Field(64, ge=1)
    """Tokens per model turn."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of every rollout; the trainer's logprobs are taken at it too."""
    max_retries: int = Field(2, ge=0)
    """Re-runs of a rollout lost to an infrastructure failure before it is left out of its group."""
    retry_backoff_s: float = Field(1.0, ge=0)
    """Delay before the first re-run of such a rollout; it doubles with each retry (at most 60 s).
    A bug (any other exception) is never retried: it stops the run (atelier.failures)."""
    min_valid: int = Field(2, ge=1)
    """Fewest valid members a group needs to be trained; fewer: dropped with a reason."""
    skip_tied_groups: bool = False
    """Drop a group whose valid members all got the same reward (every advantage is 0: with
    kl_beta = 0 it changes nothing) and admit another task in its place, so every step trains
    `groups_per_step` groups with signal (DAPO's dynamic sampling). Costs the tied groups'
    rollouts; the epoch's tasks bound it. The summary counts the skipped groups."""


class TrainerConfig(AtelierConfig):
    lr: float = Field(1e-5, gt=0)
    """AdamW's learning rate."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment coefficients."""
    eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon. Where a weight's gradient is far above it, an update moves that weight by
    about the learning rate whatever the gradient's size (sign descent: in a short run every
    weight moves alike); where far below, by lr * gradient / eps (plain SGD at lr / eps), so
    weights with small, noisy gradients barely move."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradients are clipped to this global norm."""
    is_cap: float = Field(2.0, gt=0)
    """C in the truncated importance weight min(pi/mu, C)."""
    kl_beta: float = Field(0.0, ge=0)
    """k1 KL coefficient; 0 never loads the reference model."""
    negative_advantage_scale: float = Field(1.0, ge=0, le=1)
    """What a sample whose reward is below its group's mean is trained with: its advantage times
    this (atelier.rl.advantages.final_advantages, which the reconciler records for every member of
    a group). 1 is the reference's reward minus the group mean; 0 trains only the samples that beat
    their group (with kl_beta = 0 the others are not run), each still weighted by how far it beat
    the mean. Samples above the mean are never scaled."""
    norm_tokens: float = Field(1024.0, gt=0)
    """The constant the summed token loss is divided by."""
    micro_batch: int = Field(8, ge=1)
    """Sequences per forward/backward (gradients accumulate over a step)."""
    steps: int = Field(0, ge=0)
    """Stop after this many steps (0: when the tasks run out; single epoch either way)."""
    checkpoint_every: int = Field(1, ge=1)
    """Write a checkpoint every this many steps (and after the last)."""
    threads: int = Field(1, ge=1)
    """torch CPU threads of the run, per rank (process-wide: the engine shares them in the
    one-process launcher); `run_training` sets them at its start and restores them at its end."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The weights' storage type. Keep float32 and use `precision` for bf16 compute (fp32 masters)."""
    ranks: int = Field(1, ge=1)
    """Data-parallel trainer ranks (FSDP2). `atelier train` starts them itself on this machine
    (or as Ray actors with launcher = "ray"); 1 is the single-process trainer."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: a GPU per rank when torch sees one, else the CPU (gloo)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """bf16: bf16 compute, fp32 master weights and gradient reduction. auto: bf16 on a GPU that has
    it, fp32 on the CPU. The built-in engine samples in bf16 on a CPU with AMX or AVX512-BF16
    (`rollout.dtype = "auto"`), so a recipe for such a CPU may set bf16 here to train in the
    sampler's precision; either way the importance weights absorb the difference."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward instead of keeping its activations (with
    share_prefix too: the continuations read the prefix's keys and values from a cache that a
    recompute cannot grow, atelier.train.prefix.ReadOnlyKVCache)."""
    moe_precision: Literal["bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd"] = "bf16"
    """Expert matmuls of a mixture-of-experts model (atelier.kernels): "bf16" leaves them in the
    model's dtype; "mxfp8" runs forward and backward in MXFP8; "nvfp4_fwd_mxfp8_bwd" the forward
    in the NVFP4 variant (per-token FP32 scale) and both backward GEMMs in MXFP8. The PyTorch
    reference on a CPU, Triton kernels on a GPU."""
    router_replay: bool = False
    """MoE: route every trained token to the experts the sampler chose (Sample.routes, recorded by
    the built-in engine for every position it fed); the gate values are recomputed, so the router
    still learns (atelier.moe.replay). Positions without a record route freely (see
    atelier.harness.trajectory). Needs inference.engine = "builtin"."""
    share_prefix: bool = True
    """Run each run of tokens that several samples of a step share forward and backward once
    (atelier.train.prefix): the system prompt once a step, a group's task and the turns its
    members sampled alike once a group, each member's own tokens after them. The same step up to
    rounding, on a fraction of the positions (docs/log/2026-12-06-prefix-tree-trainer.md).
    One rank without a MoE router; elsewhere every sample runs whole."""
    recompute_prefix: bool = True
    """With share_prefix: run each shared run forward without keeping its activations, and again
    for its backward once its continuations are done (activation checkpointing of the runs alone).
    The same step, up to rounding; lowers the step's peak by the runs' activations for one more
    forward of each (benchmarks/train.py --shared-prefix). Not with activation_checkpointing,
    under which a run's graph holds only its layers' inputs."""
    logprob_chunk: int = Field(512, ge=1)
    """Tokens per chunk of the logprob/entropy computation, counted over the whole micro-batch
    (atelier.kernels.logprobs; memory: a few fp32 [chunk, V] blocks, whatever the micro-batch)."""
    timeout_s: float = Field(600.0, gt=0)
    """Longest wait of any collective between ranks; a dead or hung rank stops the job after it."""


class SyncConfig(AtelierConfig):
    kind: Literal["inprocess", "delta"] = "inprocess"
    """inprocess: a detached copy handed to the engine in this process; delta: an XOR delta chain of files on
    storage every node mounts (`dir`)."""
    full_every: int = Field(10, ge=1)
    """Delta chain: a full snapshot every N publishes."""
    dir: str = ""
    """Delta chain directory (shared storage); empty: RUN_DIR/weights."""
    dtype: Literal["same", "bfloat16"] = "same"
    """Precision of the published weights. "bfloat16": the trainer keeps fp32 weights and
    Adam state, inference gets bf16 copies; most bf16 values do not change in a small step,
    so deltas shrink (the sampler's rounding is corrected by the importance weights)."""


class ToyEnvConfig(AtelierConfig):
    """A single-turn, harness-free task with a dense reward (tests, benchmarks, smoke runs)."""

    tasks: int = Field(256, ge=1)
    """Tasks in the toy epoch."""
    target_fraction: float = Field(0.25, gt=0, le=1)
    """Rewarded tokens: the lowest `target_fraction` of the vocabulary by id."""
    env_latency_s: float = Field(0.0, ge=0)
    """Seconds of environment time per rollout (a sandboxed tool run or grade costs this)."""
    env_latency_spread: float = Field(0.0, ge=0, le=1)
    """Each rollout's environment time is env_latency_s * (1 + spread * u), u uniform in [-1, 1]
    drawn from the rollout's seed: real rollouts differ in length."""
    prompt_words: int = Field(4, ge=1)
    """Words in each toy prompt."""


def check_rl_sampling(agent: AgentConfig, key: str) -> AgentConfig:
    """RL rollouts sample with top_p = 1: the trainer cannot recompute truncated probabilities."""
    if agent.sampling.top_p != 1.0:
        raise ValueError(f"RL rollouts sample with top_p = 1 (the trainer cannot recompute truncated "
                         f"probabilities), and {key}.sampling.top_p is {agent.sampling.top_p}; "
                         f"remove {key}.sampling.top_p")
    return agent


class TasksEnvConfig(AtelierConfig):
    """Real tasks through the agent harness, sandboxes and grader."""

    suite: str
    """A suite directory (atelier.tasks.load_suite) or a single task directory."""
    split: Optional[str] = None
    """Only the suite's tasks of this split (e.g. "train", so held-out test tasks are never trained on)."""
    tasks: Optional[list[str]] = None
    """Only these task ids (of the split, when one is given); an id not in the suite is an error."""
    backend: Literal["bwrap", "local"] = "bwrap"
    """Sandbox backend; `local` isolates nothing."""
    env_cache: str = ""
    """Where task venvs are built and shared (empty: atelier's cache)."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """The agent's budgets, tools and prompt options; its sampling temperature, turn
    max_tokens and seed come from [rollout] (the trainer must know them)."""

    @field_validator("agent")
    @classmethod
    def _untruncated_sampling(cls, agent: AgentConfig) -> AgentConfig:
        return check_rl_sampling(agent, "env.tasks.agent")


class PythonEnvConfig(AtelierConfig):
    """An environment of your own: `factory(rollout=, shaping=, seed=, **args)` returns an
    `atelier.rl.env.Environment`. Named in the config, so the run directory's config.toml
    says what ran and Ray actors build the same environment."""

    factory: str
    """'package.module:callable' or 'path/to/file.py:callable' (a relative path is taken from the
    working directory at load time and stored absolute, so resumes and Ray workers find it)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the factory (plain TOML values: paths, numbers, strings)."""

    @model_validator(mode="after")
    def _absolute_file(self) -> "PythonEnvConfig":
        target, sep, name = self.factory.rpartition(":")
        if sep and target.endswith(".py"):
            self.factory = f"{Path(target).resolve()}:{name}"
        return self


class EnvConfig(AtelierConfig):
    kind: Literal["toy", "tasks", "python"] = "toy"
    """toy: a single-turn task with a dense reward (tests, benchmarks); tasks: real tasks through the harness,
    sandboxes and grader; python: an environment of your own (`[env.python]`)."""
    toy: ToyEnvConfig = Field(default_factory=ToyEnvConfig)
    """The toy environment's settings (kind = "toy")."""
    tasks: TasksEnvConfig | None = None
    """The real tasks (kind = "tasks")."""
    python: PythonEnvConfig | None = None
    """An environment of your own (kind = "python")."""

    @model_validator(mode="after")
    def _kind_needs_its_section(self) -> "EnvConfig":
        if self.kind == "tasks" and self.tasks is None:
            raise ValueError("env.kind = 'tasks' needs an [env.tasks] section with suite = '...'")
        if self.kind == "python" and self.python is None:
            raise ValueError("env.kind = 'python' needs an [env.python] section with "
                             "factory = 'module:callable' (or 'file.py:callable')")
        return self


class CurriculumConfig(AtelierConfig):
    enabled: bool = True
    """Reorder the epoch's remaining tasks by difficulty once the easy ones saturate (atelier.rl.curriculum);
    false: the suite's order."""
    saturation: float = Field(0.8, ge=0, le=1)
    """Once the recent pass rate reaches this, harder tasks come first."""
    window: int = Field(8, ge=1)
    """Groups the recent pass rate is taken over."""


class RlOptions(AtelierConfig):
    """Every option of an RL run but what names the run's inputs (model, seed, inference engine,
    environment): `TrainConfig` adds those, and `atelier run`'s [rl] stage (atelier.pipeline.config.RlStage)
    is this model, so an option means the same in both and exists in both."""

    launcher: Literal["local", "ray"] = "local"
    """local: every service in this process (threads); ray: rollouts and inference as Ray actors (needs the
    `ray` extra)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """How rollouts are sampled, grouped and admitted."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The optimizer, the objective's constants, and how the trainer runs."""
    sync: SyncConfig = Field(default_factory=SyncConfig)
    """How the trainer's weights reach the engine."""
    shaping: ShapingConfig = Field(default_factory=ShapingConfig)
    """The reward: correctness plus the shaping terms."""
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    """The order the epoch's tasks are admitted in."""
    loggers: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    """Extra metric sinks besides RUN_DIR/metrics.jsonl (each needs its package installed)."""


class TrainConfig(RlOptions):
    model: str = "tiny"
    """A model directory, a known model name, a hub id, or 'tiny' / 'tiny-moe' (a tiny random dense or
    mixture-of-experts model built in the run dir)."""
    seed: int = 0
    """Seeds everything random in a run: the tiny model's init, each rollout's sampling
    (`atelier.rl.reconciler.rollout_seed`) and each trainer rank's RNGs, e.g. dropout
    (`atelier.rl.checkpoint.start_rng`)."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """The rollout engine: built-in, or vLLM servers the trainer pushes weights into."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """What rollouts run in: a toy task, real tasks, or an environment of your own."""

    @model_validator(mode="after")
    def _replay_needs_routes(self) -> "TrainConfig":
        if self.trainer.router_replay and self.inference.engine == "vllm":
            raise ValueError("trainer.router_replay = true needs a sampler that returns the experts it chose "
                             "for every token; the vLLM backend does not (see atelier.inference.vllm_engine): "
                             "use inference.engine = \"builtin\", or router_replay = false")
        return self

    @model_validator(mode="after")
    def _batch_invariance_is_the_built_in_engines(self) -> "TrainConfig":
        if self.rollout.batch_invariant and self.inference.engine == "vllm":
            raise ValueError("rollout.batch_invariant = true is a switch of the built-in engine; vLLM has its "
                             "own (its batch-invariant kernels, on GPUs): set it to false with "
                             "inference.engine = 'vllm'")
        return self
