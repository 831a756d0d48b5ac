"""The seam between the RL driver (rank 0) and the other trainer ranks.

With `trainer.ranks = N`, N processes run `run_training`. Rank 0 is the
driver of `atelier.rl.run`: rollouts, reconciler, ledger, checkpoints'
commit, weight publishing. Ranks 1..N-1 hold only a `Trainer` (their shards
of the model and optimizer) and follow. Every trainer call that is a
collective is *mirrored*: rank 0's `LeadTrainer` first broadcasts a small
command on a dedicated gloo group, then makes the call itself, and each
follower makes the same call on receipt:

    rank 0 (LeadTrainer)                        ranks 1..N-1 (follow)
    restore_trainer: send ("open", model, ckpt) build Trainer, load its shards
    train_step(samples): send ("train", samples) train_step(samples)
    save(tmp_dir): send ("save", tmp_dir)       save(tmp_dir)   # DCP shards
    state_dict(): send ("weights",)             state_dict()    # the gather
    close(): send ("stop",)                     return

Ordering and guarantees:
- Commands arrive in the order rank 0 sends them, and rank 0 sends each one
  *before* it enters the collective, so every rank enters the same
  collectives in the same order: no rank can wait on a collective the
  others never start.
- The step's samples travel with the command (pickled on the CPU group);
  every rank sees the same list and takes its token-balanced share
  (`atelier.train.batching.step_plan`).
- Only rank 0 touches the run directory's ledger, metrics and renames: a
  checkpoint directory is created by rank 0, filled by every rank (its
  `sharded/` part) and committed by rank 0's rename after the collective
  returns, so the commit rule of `atelier.rl.checkpoint` is unchanged.
- Waiting for the next command may take as long as rollouts do, so the
  command group has a long timeout (`COMMAND_TIMEOUT_S`); the training
  collectives keep `trainer.timeout_s`. A rank killed outright closes its
  sockets, and the others fail at once rather than at a timeout; the
  launcher (`atelier.train.launch`) then stops every rank with a message
  naming the dead one. Running the same command again restarts all ranks
  from the last commit.

Example, N = 2, checkpoint_every = 1: rank 0 waits for a batch (rank 1
waits on the command group), sends ("train", 16 samples) and both train 8;
rank 0 creates a temporary checkpoint directory and sends ("save", that dir):
both write their shards, rank 0 writes model/ and meta.json and renames;
rank 0 sends ("weights",): both join the gather, rank 0 publishes it.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist

from atelier.train.collectives import named_failure
from atelier.train.ranks import DistributedError, Ranks

COMMAND_TIMEOUT_S = 7 * 24 * 3600.0


class Commands:
    """Rank 0's ordered messages to the other ranks, on their own gloo group."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=COMMAND_TIMEOUT_S))

    def send(self, *message: Any) -> None:
        self._broadcast(list(message))

    def receive(self) -> list[Any]:
        return self._broadcast(None)

    def _broadcast(self, message: list[Any] | None) -> list[Any]:
        box = [message]
        with named_failure("waiting for rank 0's next command"):
            dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class LeadTrainer:
    """Rank 0's trainer: each collective call is announced to the followers, then made."""

    def __init__(self, trainer, commands: Commands) -> None:
        self.trainer, self.commands = trainer, commands

    def __getattr__(self, name: str) -> Any:       # step, cfg, model, ranks ... read through
        return getattr(self.trainer, name)

    def train_step(self, samples):
        self.commands.send("train", samples)
        return self.trainer.train_step(samples)

    def state_dict(self, dtype=None):
        self.commands.send("weights", dtype)
        return self.trainer.state_dict(dtype)

    def save(self, out_dir: Path, tokenizer=None) -> None:
        self.commands.send("save", str(out_dir))
        self.trainer.save(out_dir, tokenizer)

    def close(self) -> None:
        self.commands.send("stop")


def lead(make_trainer, model_path: Path, ckpt: Path | None, commands: Commands) -> LeadTrainer:
    commands.send("open", str(model_path), str(ckpt) if ckpt else None)
    return LeadTrainer(make_trainer(model_path, ckpt), commands)


def follow(make_trainer, commands: Commands) -> int:
    """Ranks 1..N-1: obey rank 0's commands until "stop"; returns the steps trained."""
    kind, model_path, ckpt = commands.receive()
    if kind != "open":
        raise DistributedError(f"rank {commands.ranks.rank} expected 'open' from rank 0, got {kind!r}")
    trainer = make_trainer(Path(model_path), Path(ckpt) if ckpt else None)
    while True:
        kind, *args = commands.receive()
        if kind == "train":
            trainer.train_step(args[0])
        elif kind == "weights":
            trainer.state_dict(args[0])
        elif kind == "save":
            trainer.save(Path(args[0]))
        elif kind == "stop":
            return trainer.step
        else:
            raise DistributedError(f"unknown command {kind!r} from rank 0")
