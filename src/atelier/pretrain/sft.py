"""SFT on successful rollouts (rejection sampling), callable from RL and demos.

`sft_on_trajectories` writes a one-phase SFT recipe around the given
trajectories and runs it with `run_pretrain`, so the run directory, the
checkpoints and the final Hugging Face model look like any other run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from atelier.pretrain.config import PhaseConfig, PretrainConfig
from atelier.pretrain.train import prepare_run_dir, run_pretrain


def sft_on_trajectories(model: str | Path, trajectories: str | Path | Iterable[Any], run_dir: str | Path, *,
                        steps: int = 20, seq_len: int = 1024, lr: float = 1e-5, micro_batch: int = 1,
                        grad_accum: int = 1, min_reward: float = 1.0, warmup_steps: int = 0,
                        chat: Iterable[str | Path] = (), seed: int = 0, quiet: bool = True,
                        moe_precision: str = "bf16") -> Path:
    """Fine-tune `model` on trajectories with reward >= min_reward; return the final model directory.

    `trajectories` is a directory of trajectory JSON files or an iterable of
    `Trajectory` objects (saved under run_dir/trajectories first). Loss is on
    the segments' sampled tokens (their loss_mask), exactly what RL trains.
    `moe_precision`: the expert matmuls of an MoE model (PretrainConfig.moe_precision).
    """
    run_dir = Path(run_dir)
    given = isinstance(trajectories, (str, Path))
    directory = Path(trajectories) if given else run_dir / "trajectories"
    phase = PhaseConfig(name="sft", kind="sft", steps=steps, seq_len=seq_len, lr=lr, micro_batch=micro_batch,
                        grad_accum=grad_accum, min_reward=min_reward, warmup_steps=warmup_steps,
                        trajectories=[str(directory)], chat=[str(c) for c in chat], weight_decay=0.0)
    config = PretrainConfig(model=str(model), phases=[phase], seed=seed, checkpoint_every=max(steps, 1),
                            moe_precision=moe_precision)
    prepare_run_dir(config, run_dir)   # the run directory first, then the trajectories into it
    if not given:
        for i, traj in enumerate(trajectories):
            traj.save(directory / f"{i:05d}-{traj.task_id.replace('/', '_')}.json")
    result = run_pretrain(config, run_dir, quiet=quiet)
    assert result.final_model is not None
    return result.final_model
