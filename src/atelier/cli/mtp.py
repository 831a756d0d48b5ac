"""`atelier mtp …`: attach multi-token-prediction heads to a model, and measure them.

`attach` runs a pretrain recipe whose `[mtp]` section trains heads on a frozen trunk (the run
directory, checkpoints and resume are `atelier pretrain`'s), then writes `--out`: the base
model's files linked and the heads beside them. `eval` prints the heads' greedy acceptance on
held-out code (atelier.pretrain.mtp_eval). `generate` writes the model's own replies to chat
requests and harness prompts (atelier.pretrain.mtp_corpus): the corpus the attach recipe's
heads distil on.

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


@mtp_app.command("generate")
def generate_cmd(
    model: str = typer.Option(..., "--model", help="The model whose replies the heads will learn "
                              "(a directory, or a name atelier models pull knows)."),
    out: Path = typer.Option(..., "--out", help="The JSONL file to write: one chat per line, the chat "
                             "files of an sft phase."),
    chat: int = typer.Option(700, "--chat", min=0, help="Chat requests to reply to."),
    agent: int = typer.Option(20, "--agent", min=0, help="Harness prompts (system prompt, tools, a task) "
                              "to reply to."),
    max_tokens: int = typer.Option(160, "--max-tokens", min=1, help="Tokens per reply at most."),
    temperatures: List[float] = typer.Option([0.0, 0.7], "--temperature", help="Sampling temperatures, "
                                             "taken in turn over the prompts (repeat the option)."),
    seed: int = typer.Option(0, "--seed", help="Seeds the prompts' order and the sampled replies."),
    split: str = typer.Option("train", "--split", help="train, or heldout: prompts about the standard-library "
                              "modules kept out of train (one in ten), to measure heads on."),
    max_batch: int = typer.Option(64, "--max-batch", min=1, help="Requests the engine decodes together."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary only."),
) -> None:
    """Write the model's own replies to chat requests and harness prompts: the corpus MTP heads
    are distilled on. Example: atelier mtp generate --model smollm2-135m --out runs/data/mtp-replies.jsonl"""
    from rich.progress import Progress

    from atelier.inference.engine import LocalEngine
    from atelier.pretrain.modeling import resolve_model_path
    from atelier.pretrain.mtp_corpus import CorpusSpec, generate

    spec = CorpusSpec(chat=chat, agent=agent, max_tokens=max_tokens, temperatures=tuple(temperatures), seed=seed,
                      split=split)
    with LocalEngine(resolve_model_path(model), max_batch=max_batch, speculate=False) as engine, \
            Progress(disable=as_json, transient=True) as progress:
        task = progress.add_task("replies", total=chat + agent)
        summary = generate(engine, spec, out, lambda done, total: progress.update(task, completed=done))
    if as_json:
        print(json.dumps(summary))
        return
    typer.echo(f"{summary['replies']} replies ({summary['reply_tokens']} tokens) written to {summary['out']}")


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
    chats: List[Path] = typer.Option([], "--chat", help="Also measure on the assistant turns of these chats "
                                     "(JSONL, as atelier mtp generate --split heldout writes; repeat for several)."),
    trajectories: List[Path] = typer.Option([], "--trajectories", help="Also measure on the sampled tokens of "
                                            "these harness trajectories (a directory: an RL run's rollouts, "
                                            "an evaluation's; repeat for several)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON result to this file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object only."),
) -> None:
    """Greedy acceptance per head and the mean accepted length of a model's MTP heads, on held-out
    code, on the model's own greedy continuations and on chats. Example: atelier mtp eval --model DIR
    --chat runs/data/mtp-replies-heldout.jsonl"""
    from atelier.fsio import atomic_write
    from atelier.pretrain.mtp_eval import evaluate_heads
    from atelier.train.devices import pick_device

    results = evaluate_heads(model, [str(r) for r in repos], tokens=tokens, seq_len=seq_len, prompts=prompts,
                             prompt_len=prompt_len, new_tokens=new_tokens, device=str(pick_device(device)),
                             dtype=dtype, draft_vocab=draft_vocab, chats=[str(c) for c in chats],
                             trajectories=[str(t) for t in trajectories])
    if out is not None:
        atomic_write(out, json.dumps(results, indent=1) + "\n")
    if as_json:
        print(json.dumps(results))
        return
    vocab = f"drafts from the first {results['draft_vocab']} ids" if results["draft_vocab"] else "drafts from all ids"
    typer.echo(f"{results['model']}: {results['heads']} heads, {results['tokens_seen']} training tokens seen, {vocab}")
    if results["text"]:
        _echo_acceptance(f"held-out code ({results['text']['tokens']} tokens)", results["text"])
    if results["greedy"]:
        g = results["greedy"]
        _echo_acceptance(f"greedy continuations ({g['prompts']} x {g['new_tokens']} tokens)", g)
    if results["chat"]:
        c = results["chat"]
        _echo_acceptance(f"chats ({c['conversations']} conversations, {c['tokens']} reply tokens)", c)
    if results["rollouts"]:
        r = results["rollouts"]
        _echo_acceptance(f"rollouts ({r['segments']} segments, {r['tokens']} sampled tokens)", r)


def _echo_acceptance(label: str, stats: dict) -> None:
    rates = "  ".join(f"head {h['head']} {h['rate']:.3f}" for h in stats["per_head"])
    typer.echo(f"{label}: mean accepted length {stats['mean_accepted_length']:.3f}  ({rates})")
