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
    # code: files under `root` matching `include`; jsonl: one document per line;
    # hf: a Hugging Face dataset (needs the optional `datasets` package).
    kind: Literal["code", "jsonl", "hf"] = "code"
    # Relative share of training sequences drawn from this source.
    weight: float = Field(1.0, gt=0)
    # code: a directory, or "stdlib" / "site-packages" for this interpreter's sources.
    # Each first-level entry under it is one repository (the unit of the held-out split).
    root: Optional[str] = None
    include: list[str] = ["**/*.py"]
    exclude: list[str] = []
    max_file_bytes: int = Field(200_000, gt=0)
    # jsonl: a file or a glob of files; each line a JSON object holding `text_field`.
    path: Optional[str] = None
    text_field: str = "text"
    # jsonl/hf: the field naming a document's repository; absent: each document is its own unit.
    repo_field: Optional[str] = None
    # hf: dataset name, its config and split.
    dataset: Optional[str] = None
    dataset_config: Optional[str] = None
    split: str = "train"
    # At most this many documents from the source (after sorting); None: all.
    max_docs: Optional[int] = Field(None, gt=0)

    @model_validator(mode="after")
    def _where(self) -> "SourceConfig":
        needed = {"code": "root", "jsonl": "path", "hf": "dataset"}[self.kind]
        if getattr(self, needed) is None:
            raise ValueError(f"a '{self.kind}' source needs '{needed}'")
        return self


class DataConfig(AtelierConfig):
    sources: list[SourceConfig] = []
    # Share of repositories (never of lines or files) held out for validation and evals.
    heldout_fraction: float = Field(0.05, ge=0, lt=1)
    seed: int = 0
    # Tokens per memory-mapped shard file.
    shard_tokens: int = Field(1 << 22, gt=0)
    # Where packed shards live; default: <run dir>/data. Share it between runs to tokenize once.
    cache_dir: Optional[str] = None


class PhaseConfig(AtelierConfig):
    """One phase: CPT at length L, a long-context extension, or SFT."""

    name: str
    kind: Literal["pretrain", "sft"] = "pretrain"
    steps: int = Field(gt=0)
    seq_len: int = Field(gt=1)
    micro_batch: int = Field(1, gt=0)
    grad_accum: int = Field(1, gt=0)
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, gt=0)
    # Long-context extension: multiply the rotary base (rope_theta) by this at the phase start.
    rope_theta_scale: float = Field(1.0, gt=0)
    # sft: JSONL files of {"messages": [...]} (loss on assistant tokens only) ...
    chat: list[str] = []
    # ... and directories of harness trajectory JSON files (loss on their sampled tokens).
    trajectories: list[str] = []
    # Trajectories with a reward below this are not trained on (rejection sampling).
    min_reward: float = 1.0

    @model_validator(mode="after")
    def _data(self) -> "PhaseConfig":
        if self.kind == "sft" and not (self.chat or self.trajectories):
            raise ValueError("an sft phase needs 'chat' files or 'trajectories' directories")
        if self.kind == "pretrain" and (self.chat or self.trajectories):
            raise ValueError("'chat' and 'trajectories' belong to an sft phase (kind = \"sft\")")
        return self


class BaseEvalConfig(AtelierConfig):
    """Base-model evals: codebase perplexity and state tracking."""

    # Run them on the held-out repositories at the end of `atelier pretrain`.
    enabled: bool = False
    window: int = Field(512, gt=1)
    stride: int = Field(256, gt=0)
    max_repo_tokens: Optional[int] = Field(20_000, gt=0)
    include: list[str] = ["**/*.py"]
    # State tracking: file histories generated from real files.
    histories: int = Field(4, ge=0)
    diffs_per_history: int = Field(3, gt=0)
    max_file_chars: int = Field(1200, gt=0)
    max_new_tokens: int = Field(512, gt=0)
    seed: int = 0


class PretrainConfig(AtelierConfig):
    # A Hugging Face model directory, a known model name, or 'tiny' / 'tiny-moe' (a tiny random dense
    # or mixture-of-experts model built once in the run directory).
    model: str
    data: DataConfig = DataConfig()
    phases: list[PhaseConfig] = Field(min_length=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: bf16 compute (fp32 masters) on a GPU that has it, fp32 elsewhere (CPU bf16 is slow on most CPUs).
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    threads: Optional[int] = Field(None, gt=0)
    # Data-parallel ranks (FSDP2); `atelier pretrain` starts them on this machine. 1: one process.
    ranks: int = Field(1, ge=1)
    # Longest wait of any collective between ranks; a dead or hung rank stops the job after it.
    timeout_s: float = Field(600.0, gt=0)
    # Recompute each decoder layer in the backward instead of keeping its activations.
    activation_checkpointing: bool = False
    # Tokens per chunk of the token-logprob computation, over the whole micro-batch (memory: a few
    # fp32 [chunk, vocab] blocks).
    logprob_chunk: int = Field(512, gt=0)
    # Expert matmuls of a mixture-of-experts model, as the RL trainer's `trainer.moe_precision`
    # (atelier.moe.precision): "bf16" leaves them alone, "mxfp8", "nvfp4_fwd_mxfp8_bwd". On an MoE
    # model every logged step also carries the router's load balance (tokens_per_expert, expert_imbalance).
    moe_precision: Literal["bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd"] = "bf16"
    log_every: int = Field(1, gt=0)
    checkpoint_every: int = Field(100, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    # Validation loss on the held-out split every this many steps (0: never).
    eval_every: int = Field(0, ge=0)
    eval_batches: int = Field(2, gt=0)
    # Stop (as a kill would) after this many optimizer steps of the whole run: for resume tests.
    stop_after: Optional[int] = Field(None, gt=0)
    evals: BaseEvalConfig = BaseEvalConfig()
    # Multi-token-prediction heads trained by self-distillation in every phase (atelier.mtp).
    mtp: MTPConfig = MTPConfig()

    @model_validator(mode="after")
    def _sources(self) -> "PretrainConfig":
        if any(p.kind == "pretrain" for p in self.phases) and not self.data.sources:
            raise ValueError("a pretrain phase needs at least one [[data.sources]] entry")
        names = [s.name for s in self.data.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        return self
