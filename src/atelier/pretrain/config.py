"""Recipe schema of `atelier pretrain`: data mixture, phases, optimiser, evals.

A recipe is one TOML file (`recipes/pretrain-*.toml`) validated by these
models; `--set phases[0]` cannot be addressed by a dotted key, so per-phase
values that one wants to override often (steps) also have run-wide knobs.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from atelier.config import AtelierConfig
from atelier.mtp.config import MTPConfig


class SourceConfig(AtelierConfig):
    """One weighted source of the pretraining mixture."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """The source's name (metrics and the data cache key)."""
    kind: Literal["code", "jsonl", "hf"] = "code"
    """code: files under `root` matching `include`; jsonl: one document per line; hf: a Hugging Face
    dataset (needs the optional `datasets` package)."""
    weight: float = Field(1.0, gt=0)
    """Relative share of training sequences drawn from this source."""
    root: Optional[str] = None
    """code: a directory, or "stdlib" / "site-packages" for this interpreter's sources. Each
    first-level entry under it is one repository (the unit of the held-out split)."""
    include: list[str] = ["**/*.py"]
    """code: files under `root` that are read (globs)."""
    exclude: list[str] = []
    """code: files left out (globs)."""
    max_file_bytes: int = Field(200_000, gt=0)
    """code: larger files are skipped."""
    path: Optional[str] = None
    """jsonl: a file or a glob of files; each line a JSON object holding `text_field`."""
    text_field: str = "text"
    """jsonl/hf: the field holding a document's text."""
    repo_field: Optional[str] = None
    """jsonl/hf: the field naming a document's repository; absent: each document is its own unit."""
    dataset: Optional[str] = None
    """hf: the dataset's name on the Hugging Face hub."""
    dataset_config: Optional[str] = None
    """hf: the dataset's config name."""
    split: str = "train"
    """hf: the dataset's split."""
    max_docs: Optional[int] = Field(None, gt=0)
    """At most this many documents from the source (after sorting); None: all."""

    @model_validator(mode="after")
    def _where(self) -> "SourceConfig":
        needed = {"code": "root", "jsonl": "path", "hf": "dataset"}[self.kind]
        if getattr(self, needed) is None:
            raise ValueError(f"a '{self.kind}' source needs '{needed}'")
        return self


class DataConfig(AtelierConfig):
    sources: list[SourceConfig] = []
    """The sources of the mixture, each a `[[data.sources]]` table."""
    heldout_fraction: float = Field(0.05, ge=0, lt=1)
    """Share of repositories (never of lines or files) held out for validation and evals."""
    seed: int = 0
    """Seeds the held-out split and the order rows are drawn in."""
    shard_tokens: int = Field(1 << 22, gt=0)
    """Tokens per memory-mapped shard file."""
    cache_dir: Optional[str] = None
    """Where packed shards live; default: <run dir>/data. Share it between runs to tokenize once."""


class PhaseConfig(AtelierConfig):
    """One phase: CPT at length L, a long-context extension, or SFT."""

    name: str
    """The phase's name (metrics, checkpoints)."""
    kind: Literal["pretrain", "sft"] = "pretrain"
    """pretrain: next-token loss on the mixture's packed rows; sft: loss on assistant or sampled tokens of
    `chat` files or `trajectories`."""
    steps: int = Field(gt=0)
    """Optimizer steps of the phase."""
    seq_len: int = Field(gt=1)
    """Tokens per row."""
    micro_batch: int = Field(1, gt=0)
    """Rows per forward and backward."""
    grad_accum: int = Field(1, gt=0)
    """Micro-batches per optimizer step."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The cosine ends at lr times this."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment coefficients."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradients are clipped to this global norm."""
    rope_theta_scale: float = Field(1.0, gt=0)
    """Long-context extension: multiply the rotary base (rope_theta) by this at the phase start."""
    chat: list[str] = []
    """sft: JSONL files of {"messages": [...]} (loss on assistant tokens only)."""
    trajectories: list[str] = []
    """sft: directories of harness trajectory JSON files (loss on their sampled tokens)."""
    min_reward: float = 1.0
    """Trajectories with a reward below this are not trained on (rejection sampling)."""

    @model_validator(mode="after")
    def _data(self) -> "PhaseConfig":
        if self.kind == "sft" and not (self.chat or self.trajectories):
            raise ValueError("an sft phase needs 'chat' files or 'trajectories' directories")
        if self.kind == "pretrain" and (self.chat or self.trajectories):
            raise ValueError("'chat' and 'trajectories' belong to an sft phase (kind = \"sft\")")
        return self


class BaseEvalConfig(AtelierConfig):
    """Base-model evals: codebase perplexity and state tracking."""

    enabled: bool = False
    """Run them on the held-out repositories at the end of `atelier pretrain`."""
    window: int = Field(512, gt=1)
    """Perplexity: tokens per window."""
    stride: int = Field(256, gt=0)
    """Perplexity: tokens between window starts; each window scores only the tokens no earlier one scored."""
    max_repo_tokens: Optional[int] = Field(20_000, gt=0)
    """Perplexity: at most this many tokens of each repository (None: all)."""
    include: list[str] = ["**/*.py"]
    """Perplexity: the repository's files that are read (globs)."""
    histories: int = Field(4, ge=0)
    """State tracking: file histories generated from real files."""
    diffs_per_history: int = Field(3, gt=0)
    """State tracking: diffs in each history."""
    max_file_chars: int = Field(1200, gt=0)
    """State tracking: a history starts from a file at most this long."""
    max_new_tokens: int = Field(512, gt=0)
    """State tracking: tokens the model may write to rebuild a file."""
    seed: int = 0
    """Seeds which files and edits the histories use."""


class PretrainConfig(AtelierConfig):
    model: str
    """A Hugging Face model directory, a known model name, or 'tiny' / 'tiny-moe' (a tiny random dense
    or mixture-of-experts model built once in the run directory)."""
    data: DataConfig = DataConfig()
    """The pretraining mixture (needed by pretrain phases)."""
    phases: list[PhaseConfig] = Field(min_length=1)
    """The phases, run in order on one model: each a `[[phases]]` table."""
    seed: int = 0
    """Seeds the tiny model's init, the data order and the RNGs."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: a GPU per rank when torch sees one, else the CPU."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 compute (fp32 masters) on a GPU that has it, fp32 elsewhere (set bf16 on a CPU with AMX
    or AVX512-BF16)."""
    threads: Optional[int] = Field(None, gt=0)
    """torch CPU threads per rank (default: torch's choice)."""
    ranks: int = Field(1, ge=1)
    """Data-parallel ranks (FSDP2); `atelier pretrain` starts them on this machine. 1: one process."""
    timeout_s: float = Field(600.0, gt=0)
    """Longest wait of any collective between ranks; a dead or hung rank stops the job after it."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward instead of keeping its activations."""
    logprob_chunk: int = Field(512, gt=0)
    """Tokens per chunk of the token-logprob computation, over the whole micro-batch (memory: a few
    fp32 [chunk, vocab] blocks)."""
    moe_precision: Literal["bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd"] = "bf16"
    """Expert matmuls of a mixture-of-experts model, as the RL trainer's `trainer.moe_precision`
    (atelier.moe.precision): "bf16" leaves them alone, "mxfp8", "nvfp4_fwd_mxfp8_bwd". On an MoE
    model every logged step also carries the router's load balance (tokens_per_expert,
    expert_imbalance)."""
    log_every: int = Field(1, gt=0)
    """A metrics line every this many optimizer steps (and at a phase's last)."""
    checkpoint_every: int = Field(100, gt=0)
    """A checkpoint every this many optimizer steps (and at a phase's last)."""
    keep_checkpoints: int = Field(2, gt=0)
    """Checkpoints kept; older ones are deleted."""
    eval_every: int = Field(0, ge=0)
    """Validation loss on the held-out split every this many steps (0: never)."""
    eval_batches: int = Field(2, gt=0)
    """Held-out batches each validation loss is taken over."""
    stop_after: Optional[int] = Field(None, gt=0)
    """Stop (as a kill would) after this many optimizer steps of the whole run: for resume tests."""
    evals: BaseEvalConfig = BaseEvalConfig()
    """The base-model evals at the end of the run."""
    mtp: MTPConfig = MTPConfig()
    """Multi-token-prediction heads trained by self-distillation in every phase (atelier.mtp)."""

    @model_validator(mode="after")
    def _sources(self) -> "PretrainConfig":
        if any(p.kind == "pretrain" for p in self.phases) and not self.data.sources:
            raise ValueError("a pretrain phase needs at least one [[data.sources]] entry")
        names = [s.name for s in self.data.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        return self
