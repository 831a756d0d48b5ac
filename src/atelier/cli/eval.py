"""`atelier eval`: run a model over tasks for several passes and measure it.

Heavy modules are imported inside the command so `atelier --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from atelier.cli.options import ENGINE_HELP, SET_HELP, VLLM_HELP, Backend, Engine


def eval_cmd(
    recipe: Optional[Path] = typer.Argument(None, help="A TOML recipe of the evaluation's keys (passes, "
                                            "concurrency, ..., and the agent's under agent)."),
    model: str = typer.Option(..., "--model", help="A model directory, a name (smollm2-135m), an "
                              "http(s) URL of an OpenAI-compatible server, scripted:gold, "
                              "scripted:empty or script:FILE."),
    tasks: Path = typer.Option(..., "--tasks", help="A task directory or a suite of them."),
    run_dir: Path = typer.Option(..., "--run-dir", help="The run directory. Run the same command again to "
                                 "continue it (finished attempts are kept; more passes or tasks add "
                                 "attempts); one holding another model's evaluation is refused."),
    split: Optional[str] = typer.Option(None, "--split", help="Only this split of the suite (e.g. test)."),
    passes: Optional[int] = typer.Option(None, "--passes", min=1, help="Attempts per task (K of pass@k); "
                                         "--set passes=N."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="Attempts running at once; "
                                              "--set concurrency=N."),
    max_turns: Optional[int] = typer.Option(None, "--max-turns", min=1, help="Agent turns per attempt; "
                                            "--set agent.max_turns=N."),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0, help="Sampling temperature; "
                                                "--set agent.sampling.temperature=T."),
    prices: Optional[Path] = typer.Option(None, "--prices", help="Price table TOML (default: the packaged one)."),
    backend: Optional[Backend] = typer.Option(None, "--backend", help="bwrap (isolated, the default) or local "
                                              "(isolates nothing); --set backend=NAME."),
    overrides: List[str] = typer.Option([], "--set", help=SET_HELP.format(example="agent.max_turns=20")),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY",
                                          help="Bearer key for an http(s) model server."),
    served_model: Optional[str] = typer.Option(None, "--served-model",
                                               help="Model name to request from an http(s) server "
                                                    "(default: the first it lists)."),
    engine: Engine = typer.Option(Engine.builtin, "--engine", help=ENGINE_HELP),
    vllm_sets: List[str] = typer.Option([], "--vllm", help=VLLM_HELP),
    speculate: Optional[bool] = typer.Option(
        None, "--speculate/--no-speculate", help="Built-in engine: decode speculatively (default: where the model "
                                                 "has MTP heads; --speculate on a model without heads drafts by "
                                                 "lookup in the agent's context)."),
    as_json: bool = typer.Option(False, "--json", help="Print the metrics as one JSON object only."),
) -> None:
    """Evaluate MODEL on TASKS: sandbox per attempt, agent loop, hidden-test grading.
    Example: atelier eval --model scripted:gold --tasks suite/ --passes 2 --run-dir runs/gold"""
    from atelier.config import load_config
    from atelier.eval.models import open_eval_model
    from atelier.eval.prices import load_prices
    from atelier.eval.runner import EvalConfig, EvalRecipe, run_eval
    from atelier.eval.tasks import load_tasks
    from atelier.inference.config import inference_config
    from atelier.inference.types import owning

    shortcuts = {"passes": passes, "concurrency": concurrency, "agent.max_turns": max_turns,
                 "agent.sampling.temperature": temperature, "backend": backend and backend.value}
    recipe_config = load_config(EvalRecipe, recipe, [*(f"{k}={v}" for k, v in shortcuts.items() if v is not None),
                                                     *overrides])
    config = EvalConfig(**recipe_config.model_dump(exclude={"agent"}))
    table = load_prices(prices)
    task_list = load_tasks(tasks, split)
    policy = open_eval_model(model, api_key=api_key, served_model=served_model,
                             inference=inference_config(engine.value, vllm_sets, speculate))

    if not as_json:
        typer.echo(f"evaluating {policy.name} on {len(task_list)} task(s) x {config.passes} pass(es), "
                   f"{config.concurrency} at a time -> {run_dir}", err=True)

    def progress(done: int, total: int, rec) -> None:
        if as_json:
            return
        outcome = ("infra error: " + (rec.error_type or "?")) if rec.infra_error else f"reward {rec.reward:g}"
        typer.echo(f"[{done}/{total}] {rec.task_id} pass {rec.pass_index}: {outcome} "
                   f"({rec.turns} turns, {rec.wall_s:.1f} s)", err=True)

    with owning(policy):
        summary = run_eval(policy, task_list, run_dir, agent_config=recipe_config.agent, config=config,
                           prices=table, progress=progress)
    _print_summary(summary, as_json)


def _print_summary(summary, as_json: bool) -> None:
    m = summary.metrics
    if as_json:
        print(json.dumps({"run_dir": str(summary.run_dir), "ran": summary.ran,
                          "skipped": summary.skipped, **m.to_dict()}))
        return
    ci = f" (95% CI {m.accuracy_ci[0]:.3f}-{m.accuracy_ci[1]:.3f})" if m.accuracy_ci else ""
    acc = "n/a" if m.accuracy is None else f"{m.accuracy:.3f}"
    typer.echo(f"model {m.model}: {m.tasks} tasks x {m.passes} passes, ran {summary.ran}, "
               f"skipped {summary.skipped} already finished")
    typer.echo(f"  accuracy {acc}{ci}   best-of-{m.passes} "
               + ("n/a" if m.best_of_k is None else f"{m.best_of_k:.3f}"))
    typer.echo("  " + "   ".join(f"pass@{k} {v:.3f}" for k, v in sorted(m.pass_at_k.items())))
    cost = "n/a" if m.median_cost is None else f"{m.median_cost:.4f} $"
    wall = "n/a" if m.median_wall_s is None else f"{m.median_wall_s:.1f} s"
    typer.echo(f"  median cost {cost}   median latency {wall}   infra errors {m.infra_errors}")
    typer.echo(f"  results in {summary.run_dir}")
