"""Deployment: the agent on a user's repository (`atelier agent`).

Opens the model (`atelier.inference.models.open_model`: a local engine for a
directory or known name, a client for a URL) or a `ScriptedModel` for
`--script`, runs the episode in a sandbox over the repository
(`atelier.harness.episode.run_in_sandbox`, the path graded tasks take too), shows each
tool call as it happens, prints the final diff, saves the trajectory, and
applies the diff to the repository only when asked. The repository may be
a plain directory: the diff is applied with `git apply` outside any
enclosing git repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax

from atelier.config import load_config
from atelier.errors import AtelierError
from atelier.harness.agent import Event
from atelier.harness.config import AgentConfig
from atelier.harness.episode import run_in_sandbox
from atelier.inference.config import inference_config
from atelier.inference.models import is_url, open_model, resolve_model
from atelier.inference.scripted import ScriptedModel, load_script
from atelier.inference.tiny import build_tiny_tokenizer
from atelier.inference.types import owning
from atelier.sandbox import SandboxConfig


class ApplyError(AtelierError):
    """The final diff could not be applied to the repository."""


def open_agent_model(model: str | None, script: Path | None, api_key: str | None = None,
                     inference: Any = None) -> Any:
    if script is not None:
        texts = load_script(script)
        if model is None:
            return ScriptedModel(build_tiny_tokenizer(), texts, name=f"script:{script.name}")

        return ScriptedModel(str(resolve_model(model)), texts, name=f"script:{script.name}")
    if model is None:
        raise AtelierError("no model given", hint="pass --model (a directory, smollm2-135m or an http URL) "
                           "or --script FILE to replay canned turns")

    if is_url(model):
        return open_model(model, api_key=api_key) if api_key else open_model(model)
    return open_model(model, inference=inference)


def apply_diff(repo: Path, diff: str) -> None:
    """`git apply` in `repo`, never reaching a git repository above it."""
    if not diff.strip():
        return
    git = shutil.which("git")
    if git is None:
        raise ApplyError("git is needed to apply the diff and is not on PATH",
                         hint="install git, or apply the diff saved in the trajectory by hand")
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(repo.resolve().parent)}
    proc = subprocess.run([git, "apply", "--whitespace=nowarn", "-"], input=diff, text=True, cwd=repo, env=env,
                          capture_output=True)
    if proc.returncode != 0:
        raise ApplyError(f"the diff does not apply to {repo}: {proc.stderr.strip()}",
                         hint="the repository changed while the agent ran; the diff is in the trajectory")


class LiveView:
    """Prints each turn's reasoning and each tool call with the head of its result."""

    def __init__(self, console: Any, quiet: bool) -> None:
        self.console, self.quiet = console, quiet

    def __call__(self, event: Event) -> None:
        if self.quiet:
            return
        c = self.console
        if event.kind == "turn":
            prose = event.text.split("<tool_call>")[0].strip()
            c.rule(f"turn {event.turn}", style="dim")
            if prose:
                c.print(escape(_printable(prose[:600])), style="italic")
        elif event.kind == "tool_call":
            args = ", ".join(f"{k}={_short(v)}" for k, v in event.arguments.items())
            mark = "[green]▶[/]" if event.ok else "[red]✗[/]"
            c.print(f"{mark} [bold]{escape(event.name or 'invalid call')}[/]({escape(_printable(args))})")
            lines = event.output.splitlines()
            shown = "\n".join(lines[:8]) + (f"\n… {len(lines) - 8} more lines" if len(lines) > 8 else "")
            if shown:
                c.print(escape(_printable(shown)), style="dim", highlight=False)
        elif event.kind == "summary":
            c.rule("context summarised", style="yellow")
            c.print(escape(_printable(event.text[:800])), style="yellow")


def _printable(text: str) -> str:
    """Control characters (a random model writes them) would garble the terminal."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else "\ufffd" for ch in text)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def run_agent_command(*, task: str, model: str | None, repo: Path, apply: bool, out: Path, max_turns: int | None,
                      backend: str, script: Path | None, recipe: Path | None, overrides: list[str],
                      api_key: str | None, quiet: bool, engine: str = "builtin",
                      vllm_sets: list[str] | tuple[str, ...] = ()) -> int:

    if not repo.is_dir():
        raise AtelierError(f"repository {repo} is not a directory", hint="pass --repo DIR")
    if not task.strip():
        raise AtelierError("the task is empty", hint='say what to do, e.g. atelier agent "fix the failing test"')
    extra = [f"max_turns={max_turns}"] if max_turns is not None else []
    config = load_config(AgentConfig, recipe, [*overrides, *extra])
    console = Console(stderr=True)

    with owning(open_agent_model(model, script, api_key, inference_config(engine, vllm_sets))) as policy:
        traj = run_in_sandbox(policy, repo, task, SandboxConfig(backend=backend), task_id=repo.resolve().name,
                              agent_cfg=config, on_event=LiveView(console, quiet))
    traj.save(out)
    if traj.final_diff:  # whole lines on stdout, so the diff can be piped or copied
        stdout = Console()
        if stdout.is_terminal:
            stdout.print(Syntax(traj.final_diff, "diff", theme="ansi_dark", background_color="default",
                                word_wrap=True))
        else:
            sys.stdout.write(traj.final_diff)
            sys.stdout.flush()
    result = (f"{traj.exit_reason}: {traj.turns} turns, {traj.num_tool_calls} tool calls "
              f"({traj.broken_calls} broken), {traj.tokens.get('completion', 0)} tokens sampled, "
              f"{traj.wall_s:.1f} s; trajectory saved to {out}")
    console.print(result, style="green" if traj.exit_reason == "submitted" else "yellow", highlight=False)
    if traj.error:
        console.print(f"error: {traj.error}", style="red", highlight=False)
    if apply:
        if traj.final_diff:
            apply_diff(repo, traj.final_diff)
            console.print(f"applied the diff to {repo}", style="green")
        else:
            console.print("nothing to apply: the workspace did not change", style="yellow")
    elif traj.final_diff:
        console.print("the repository is unchanged; pass --apply to apply the diff", style="dim")
    return 0 if traj.exit_reason == "submitted" else 1
