"""`atelier mtp …`: attach multi-token-prediction heads to a model, and measure them.

`attach` runs a pretrain recipe whose `[mtp]` section trains heads on a frozen trunk (the run
directory, checkpoints and resume are `atelier pretrain`'s), then writes `--out`: the base
model's files linked and the heads beside them. `eval` prints the heads' greedy acceptance on
held-out code (atelier.pretrain.mtp_eval).

Only typer is imported at the top; torch and the trainer load inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atelier.cli.options import RUN_DIR_HELP, SET_HELP

mtp_app = typer.Typer(help="Multi-token-prediction heads: attach them to a model, measure them.",
                      no_args_is_help=True)


@mtp_app.command("attach")
def attach(
    recipe: Optional[Path] = typer.Argument(None, help="A pretrain recipe with an mtp table and "
                                            "mtp.trunk = \"frozen\" (recipes/mtp-attach-smollm2.toml)."),
    out: Path = typer.Option(..., "--out", help="The model directory to write: the base model's files "
                             "linked, mtp.safetensors and mtp.json beside them."),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP.format(example="mtp.heads=2")),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help=RUN_DIR_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary only."),
) -> None:
    """Train MTP heads on a frozen model and write it with its heads to --out.
    Example: atelier mtp attach recipes/mtp-attach-smollm2.toml --out ~/.cache/atelier/models/smollm2-135m-mtp"""
    from atelier.cli.pretrain import run_on_ranks
    from atelier.pretrain.config import PretrainConfig
    from atelier.pretrain.mtp_phase import ACCEPTANCE_FILE, check_attach, link_model_with_heads
    from atelier.pretrain.train import base_model_dir
    from atelier.rundir import resolve_run

    config, target = resolve_run(PretrainConfig, recipe, overrides, run_dir, "atelier mtp attach")
    check_attach(config)
    result = run_on_ranks(config, target, as_json)
    if result is None:
        return
    summary = {"run_dir": str(result.run_dir), "stopped": result.stopped, "global_step": result.global_step,
               "out": None, "acceptance": None}
    if not result.stopped:
        summary["out"] = str(link_model_with_heads(base_model_dir(config, target), result.final_model, out))
        accepted = target / ACCEPTANCE_FILE
        if accepted.is_file():
            history = json.loads(accepted.read_text())["history"]
            summary["acceptance"] = history[-1]["mtp_acceptance"] if history else None
    if as_json:
        print(json.dumps(summary))
        return
    typer.echo(f"run directory: {result.run_dir}")
    if result.stopped:
        typer.echo(f"stopped after step {result.global_step}; run the same command again to continue")
        return
    typer.echo(f"model with {config.mtp.heads} MTP heads: {summary['out']}")
    if summary["acceptance"]:
        _echo_acceptance("held-out code", summary["acceptance"])


@mtp_app.command("eval")
def eval_cmd(
    model: str = typer.Option(..., "--model", help="A model directory with MTP heads (mtp.json)."),
    repos: List[Path] = typer.Option([], "--repo", help="Held-out code (repeat for several; default: the "
                                     "held-out repositories mtp.json records)."),
    tokens: int = typer.Option(8192, "--tokens", min=1, help="Tokens of held-out code to measure on."),
    seq_len: int = typer.Option(1024, "--seq-len", min=2, help="Tokens per row."),
    prompts: int = typer.Option(4, "--prompts", min=0, help="Greedy continuations to measure (0: none)."),
    prompt_len: int = typer.Option(256, "--prompt-len", min=1, help="Tokens of each prompt."),
    new_tokens: int = typer.Option(128, "--new-tokens", min=2, help="Greedy tokens generated per prompt."),
    draft_vocab: Optional[int] = typer.Option(None, "--draft-vocab", min=0, help="Draft from the first N "
                                              "token ids (default: those the heads were distilled on; 0: all)."),
    device: str = typer.Option("auto", "--device", help="auto (a GPU when torch sees one), cpu or cuda."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 where the hardware has it), fp32 or bf16."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON result to this file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
) -> None:
    """Greedy acceptance per head and the mean accepted length of a model's MTP heads, on held-out
    code and on the model's own greedy continuations. Example: atelier mtp eval --model DIR --repo src/"""
    from atelier.fsio import atomic_write
    from atelier.pretrain.mtp_eval import evaluate_heads
    from atelier.train.devices import pick_device

    results = evaluate_heads(model, [str(r) for r in repos], tokens=tokens, seq_len=seq_len, prompts=prompts,
                             prompt_len=prompt_len, new_tokens=new_tokens, device=str(pick_device(device)),
                             dtype=dtype, draft_vocab=draft_vocab)
    if out is not None:
        atomic_write(out, json.dumps(results, indent=1) + "\n")
    if as_json:
        print(json.dumps(results))
        return
    vocab = f"drafts from the first {results['draft_vocab']} ids" if results["draft_vocab"] else "drafts from all ids"
    typer.echo(f"{results['model']}: {results['heads']} heads, {results['tokens_seen']} training tokens seen, {vocab}")
    _echo_acceptance(f"held-out code ({results['text']['tokens']} tokens)", results["text"])
    if results["greedy"]:
        g = results["greedy"]
        _echo_acceptance(f"greedy continuations ({g['prompts']} x {g['new_tokens']} tokens)", g)


def _echo_acceptance(label: str, stats: dict) -> None:
    rates = "  ".join(f"head {h['head']} {h['rate']:.3f}" for h in stats["per_head"])
    typer.echo(f"{label}: mean accepted length {stats['mean_accepted_length']:.3f}  ({rates})")
