"""`atelier agent`: the harness on a user's repository.

The same `run_episode` that RL rollouts and benchmarks use, over a sandbox
of DIR; DIR itself changes only with `--apply`. Heavy modules are imported
inside the command so `atelier --help` stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer

from atelier.cli.options import ENGINE_HELP, VLLM_HELP, Backend, Engine


def agent(
    task: str = typer.Argument(..., help="What to do, in plain words."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model directory, known name (smollm2-135m) "
                                        "or OpenAI-compatible URL."),
    repo: Path = typer.Option(Path("."), "--repo", "-r", help="Repository to work on (copied into a sandbox)."),
    apply: bool = typer.Option(False, "--apply", help="Apply the final diff to DIR (otherwise DIR is untouched)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Trajectory JSON path "
                                       "(default: atelier-agent-TIME.json in the current directory)."),
    max_turns: Optional[int] = typer.Option(None, "--max-turns", help="Most model turns."),
    backend: Backend = typer.Option(Backend.bwrap, "--backend", help="bwrap (isolated) or local (isolates nothing)."),
    script: Optional[Path] = typer.Option(None, "--script", help="JSON list of assistant texts to replay instead "
                                          "of sampling (tokenized with --model's tokenizer, or a tiny one)."),
    recipe: Optional[Path] = typer.Option(None, "--config", help="TOML recipe of agent options."),
    overrides: List[str] = typer.Option([], "--set", help="Override an agent option, e.g. --set "
                                        "sampling.temperature=0.2 (repeatable)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY", help="Key for a URL model."),
    engine: Engine = typer.Option(Engine.builtin, "--engine", help=ENGINE_HELP),
    vllm_sets: List[str] = typer.Option([], "--vllm", help=VLLM_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the diff and the result line."),
) -> None:
    """Run the agent on DIR for TASK, showing each tool call; print the final diff.

    Example: atelier agent -m smollm2-135m -r . "make test_parse pass" --apply
    """
    from atelier.harness.deploy import run_agent_command

    code = run_agent_command(task=task, model=model, repo=repo, apply=apply,
                             out=out or Path(f"atelier-agent-{time.strftime('%Y%m%d-%H%M%S')}.json"),
                             max_turns=max_turns, backend=backend.value, script=script, recipe=recipe,
                             overrides=overrides, api_key=api_key, quiet=quiet,
                             engine=engine.value, vllm_sets=vllm_sets)
    raise typer.Exit(code)
