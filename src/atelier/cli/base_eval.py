"""`atelier base-eval`: evals of a base model that are not agent benchmarks (codebase
perplexity, state tracking); `atelier eval` is the agent benchmark.

Only typer is imported at the top; torch loads inside the command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atelier.cli.options import SET_HELP


def base_eval_cmd(
    recipe: Optional[Path] = typer.Argument(None, help="A TOML recipe of base-eval options (the evals table "
                                            "of a pretrain recipe, at its top level)."),
    model: str = typer.Option(..., "--model", help="A Hugging Face model directory or a known model name."),
    repos: List[Path] = typer.Option([], "--repo", help="A held-out repository (repeat for several)."),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP.format(example="window=1024")),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Write evals.json and evals.png here."),
    device: str = typer.Option("auto", "--device", help="auto (a GPU when torch sees one), cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
) -> None:
    """Codebase perplexity and state tracking of a base MODEL on each --repo (no agent).
    Example: atelier base-eval --model build/tiny-model --repo src/atelier/config.py --json"""
    from atelier.config import load_config
    from atelier.pretrain.config import BaseEvalConfig
    from atelier.pretrain.evals import run_base_evals
    from atelier.train.devices import pick_device

    config = load_config(BaseEvalConfig, recipe, overrides)
    results = run_base_evals(model, [str(r) for r in repos], config, out_dir=run_dir,
                             device=str(pick_device(device)))
    if as_json:
        print(json.dumps(results))
        return
    ppl = results["perplexity"]
    typer.echo(f"{model}: {ppl['nll_per_token']:.4f} nats/token (perplexity {ppl['perplexity']:.2f}) "
               f"over {ppl['tokens']} tokens")
    for repo in ppl["repos"]:
        typer.echo(f"  {repo['nll_per_token']:.4f}  {repo['repo']}")
    st = results["state_tracking"]
    if st["mean_score"] is not None:
        typer.echo(f"state tracking: mean similarity {st['mean_score']:.3f} over {len(st['items'])} histories")
