"""`MTPConfig`: the `[mtp]` section of a pretrain recipe."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from atelier.config import AtelierConfig


class MTPConfig(AtelierConfig):
    """Multi-token-prediction heads trained by self-distillation (atelier.mtp)."""

    heads: int = Field(0, ge=0, le=16)
    """D: how many sequential heads (head k predicts the token k+1 places after the next). 0: none are
    trained; heads a starting model already has are then carried into the checkpoints unchanged."""
    weight: float = Field(0.3, ge=0)
    """Multiplies the heads' mean distillation loss (mean over heads and target tokens) in the step's
    loss; DeepSeek-V3 used 0.3, then 0.1. With a frozen trunk only the heads learn, so it only scales
    their step."""
    trunk: Literal["frozen", "joint"] = "joint"
    """frozen: only the heads train (the trunk runs without gradients; the run's weights stay the
    base's). joint: the trunk trains on its own loss plus weight x the heads' loss; the teacher is
    detached."""
    init: Literal["scratch", "last_layer"] = "scratch"
    """scratch: every head's weights drawn as the base model initialises its own; last_layer: each
    head's decoder layer starts as a copy of the trunk's last layer (projection and norms still fresh)."""
    lr_scale: float = Field(1.0, gt=0)
    """The heads' learning rate is the phase's times this (fresh heads learn faster than a trained
    trunk)."""
    draft_vocab: Optional[int] = Field(None, gt=0)
    """Distil over the first this many token ids only (p and q renormalised there); None: the whole
    vocabulary. A byte-pair tokenizer numbers tokens in merge order, so the low ids are the frequent
    ones; a drafter that proposes only them (the built-in engine drafts from the first 8,192) needs
    nothing else, and the heads' vocabulary work shrinks by draft_vocab / vocab_size. Saved in
    mtp.json."""
    chunk: int = Field(256, gt=0)
    """Positions per chunk of the distillation loss (memory: a few fp32 [chunk, vocab] blocks)."""
    eval_every: int = Field(0, ge=0)
    """Held-out greedy acceptance every this many steps (0: at the end of each phase only); written to
    <run>/mtp-acceptance.json."""
    eval_rows: int = Field(4, gt=0)
    """Rows of the phase's length from the held-out split that each acceptance measure runs on."""

    @model_validator(mode="after")
    def _trains_something(self) -> "MTPConfig":
        if self.heads and self.weight == 0:
            raise ValueError("mtp.weight = 0 would train no head; set a weight > 0, or heads = 0")
        return self
