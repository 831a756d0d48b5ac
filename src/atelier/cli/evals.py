"""`atelier evals base`: base-model evals (codebase perplexity, state tracking).

Only typer is imported at the top; torch loads inside the command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

evals_app = typer.Typer(help="Evals of models that are not agent benchmarks.", no_args_is_help=True)


@evals_app.command("base")
def base_cmd(
    model: str = typer.Option(..., "--model", help="A Hugging Face model directory or a known model name."),
    repos: List[Path] = typer.Option([], "--repo", help="A held-out repository (repeat for several)."),
    overrides: List[str] = typer.Option([], "--set", help="Eval option, e.g. --set window=1024 --set histories=8"),
    out_dir: Optional[Path] = typer.Option(None, "--out", help="Write evals.json and evals.png here."),
    device: str = typer.Option("auto", "--device", help="auto (a GPU when torch sees one), cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
) -> None:
    """Codebase perplexity and state tracking of MODEL on each --repo.
    Example: atelier evals base --model build/tiny-model --repo src/atelier/config.py --json"""
    from atelier.config import load_config
    from atelier.pretrain.config import BaseEvalConfig
    from atelier.pretrain.evals import run_base_evals
    from atelier.pretrain.modeling import pick_device

    config = load_config(BaseEvalConfig, None, overrides)
    results = run_base_evals(model, [str(r) for r in repos], config, out_dir=out_dir,
                             device=pick_device(device))
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


def register(app: typer.Typer) -> None:
    app.add_typer(evals_app, name="evals")
