"""One trainer rank: `python -m atelier.cli.rank {train|pretrain} CONFIG.json RUN_DIR [--resume]`.

What `atelier train` / `atelier pretrain` start N times (atelier.launch) when
the recipe asks for N ranks; the rank and the rendezvous come from
torchrun's environment variables, so `torchrun --nproc-per-node N -m
atelier.cli.rank ...` runs the same program. Rank 0 writes the run's result
(a JSON object) to --result; every rank exits 0 on success (`exit_rank`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="atelier.cli.rank")
    parser.add_argument("kind", choices=["train", "pretrain"])
    parser.add_argument("config")
    parser.add_argument("run_dir")
    parser.add_argument("--result")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    from atelier.errors import AtelierError

    try:
        result = run_rank(args.kind, Path(args.config).read_text(), args.run_dir, resume=args.resume,
                          quiet=args.quiet)
    except AtelierError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if result is not None and args.result:
        Path(args.result).write_text(json.dumps(result))
    return 0


def run_rank(kind: str, text: str, run_dir: str, *, resume: bool, quiet: bool) -> dict | None:
    """Run this process's rank of an `atelier train` / `pretrain` job (config as JSON text);
    rank 0 returns the run's summary, the other ranks None. Also what Ray rank actors call."""
    if kind == "train":
        from atelier.rl.config import TrainConfig
        from atelier.rl.run import run_training

        def on_step(r: dict) -> None:
            print(json.dumps({k: r[k] for k in ("step", "reward_mean", "pass_rate", "staleness_max",
                                                 "gen_tokens_per_s", "trainer_idle_fraction", "sync_bytes")}),
                  flush=True)

        summary = run_training(TrainConfig.model_validate_json(text), run_dir, resume=resume, on_step=on_step)
        return summary.to_dict() if summary is not None else None
    from atelier.pretrain.config import PretrainConfig
    from atelier.pretrain.train import run_pretrain

    result = run_pretrain(PretrainConfig.model_validate_json(text), run_dir, resume=resume, quiet=quiet)
    import os

    if os.environ.get("RANK", "0") != "0":
        return None
    return {"run_dir": str(result.run_dir), "final_model": str(result.final_model) if result.final_model else None,
            "global_step": result.global_step, "stopped": result.stopped, "losses": result.losses,
            "evals": result.evals}


if __name__ == "__main__":
    from atelier.distributed import exit_rank

    exit_rank(main())
