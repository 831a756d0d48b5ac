"""CPT scaling: does lower continued-pretraining loss give a better model after RL?

    python experiments/cpt_scaling/run.py --out runs/cpt-scaling [--budgets 1,4,16] [--smoke]

From one initial model (a tiny Llama built from a config, same weights for
every arm) the script runs, per compute budget (a multiple of `--unit-steps`
CPT optimizer steps, log-spaced by default: 1x, 4x, 16x tokens):

1. CPT with `atelier.pretrain.run_pretrain` on a Python code mixture (the
   standard library and a few installed packages), held-out split by
   repository; the held-out loss is the codebase perplexity eval (NLL per
   token over the held-out repositories, rolling window);
2. the same SFT (`run_pretrain`, one chat phase, loss on assistant tokens)
   on next-line completions from training repositories, same seed;
3. the same short RL run (`atelier.rl.run.run_training`: the project's
   reconciler, engine and trainer) on next-line completion tasks from the
   held-out repositories, reward = edit similarity of the written line to the
   true one (see completion.py), same seed and task order.

It writes every run directory under --out, then results.json and
cpt_scaling.png there. Each stage is skipped when its run finished in an
earlier call and resumed when it was cut off, so an interrupted experiment
continues where it stopped.

RL runs next-line completion through `env.kind = "python"`: the run's
config.toml names `completion.py:make_environment` and the tasks file, so the
RL run directory says exactly what ran.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from completion import chat_record, line_tasks  # noqa: E402

# The CPT mixture: this interpreter's standard library (each top-level module
# or package is one repository) and a few pure-Python packages installed with atelier.
STDLIB = ["*.py", "asyncio/*.py", "email/*.py", "json/*.py", "http/*.py", "concurrent/futures/*.py",
          "logging/*.py", "urllib/*.py", "collections/*.py", "xml/**/*.py", "importlib/**/*.py",
          "unittest/*.py", "html/*.py", "wsgiref/*.py", "xmlrpc/*.py", "tomllib/*.py", "zoneinfo/*.py",
          "re/*.py"]
PACKAGES = ["click/**/*.py", "jinja2/**/*.py", "h11/**/*.py", "httpx/**/*.py"]
SMOKE_STDLIB = ["json/*.py", "html/*.py", "urllib/*.py", "wsgiref/*.py", "xmlrpc/*.py", "textwrap.py",
                "shlex.py", "string.py", "bisect.py", "colorsys.py", "queue.py", "sched.py", "glob.py"]
SMOKE_PACKAGES = ["h11/*.py"]

SMOKE = dict(budgets="1,4,16", unit_steps=2, seq_len=128, micro_batch=4, cpt_lr=1e-2, hidden=64,
             intermediate=128, layers=2, eval_tokens=400, sft_steps=4, sft_examples=64, sft_seq_len=256,
             rl_steps=3, group_size=4, groups_per_step=2, max_tokens=24, last_k=2,
             heldout_fraction=0.3)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for every run, results.json and the plot")
    p.add_argument("--budgets", default="1,4,16", help="CPT budgets as multiples of --unit-steps")
    p.add_argument("--smoke", action="store_true", help="a minimal end-to-end run (tests)")
    p.add_argument("--seed", type=int, default=0, help="model init, data order, SFT and RL seed")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (2 threads on a loaded 2-core machine ran 10x slower than 1)")
    g = p.add_argument_group("model (a tiny Llama built from a config)")
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--intermediate", type=int, default=384)
    g.add_argument("--layers", type=int, default=4)
    g = p.add_argument_group("CPT")
    g.add_argument("--unit-steps", type=int, default=24, help="optimizer steps of the 1x budget")
    g.add_argument("--seq-len", type=int, default=256)
    g.add_argument("--micro-batch", type=int, default=8)
    g.add_argument("--cpt-lr", type=float, default=3e-3)
    g.add_argument("--heldout-fraction", type=float, default=0.1)
    g.add_argument("--eval-tokens", type=int, default=2000, help="codebase perplexity: tokens per held-out repo")
    g = p.add_argument_group("SFT")
    g.add_argument("--sft-steps", type=int, default=40)
    g.add_argument("--sft-examples", type=int, default=1000)
    g.add_argument("--sft-seq-len", type=int, default=512)
    g.add_argument("--sft-lr", type=float, default=1e-3)
    g = p.add_argument_group("RL")
    g.add_argument("--rl-steps", type=int, default=30)
    g.add_argument("--rl-lr", type=float, default=5e-4)
    g.add_argument("--group-size", type=int, default=8)
    g.add_argument("--groups-per-step", type=int, default=2)
    g.add_argument("--max-tokens", type=int, default=40)
    g.add_argument("--last-k", type=int, default=5, help="final reward = mean over the last K RL steps")
    args = p.parse_args(argv)
    if args.smoke:  # smoke values replace the defaults, never what was passed explicitly
        given = {a.split("=")[0][2:].replace("-", "_") for a in (argv or sys.argv[1:]) if a.startswith("--")}
        for key, value in SMOKE.items():
            if key not in given:
                setattr(args, key, value)
    args.multipliers = parse_budgets(args.budgets)
    return args


def parse_budgets(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if len(values) < 2 or any(v <= 0 for v in values) or values != sorted(set(values)):
        raise SystemExit(f"--budgets must be increasing positive integers, got {text!r}")
    return values


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def final_reward(rewards: Sequence[float], last_k: int) -> tuple[float, float]:
    """Mean of the last `last_k` step rewards and its standard error over those steps."""
    tail = list(rewards)[-last_k:]
    if not tail:
        return float("nan"), float("nan")
    m = mean(tail)
    if len(tail) < 2:
        return m, float("nan")
    var = sum((r - m) ** 2 for r in tail) / (len(tail) - 1)
    return m, math.sqrt(var / len(tail))


# --- stages -----------------------------------------------------------------------------------

def build_start(out: Path, args) -> Path:
    from atelier.inference.tiny import build_tiny_model

    target = out / "start"
    if not (target / "config.json").exists():
        build_tiny_model(target, seed=args.seed, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers)
    return target


def data_config(args, cache_dir: Path):
    from atelier.pretrain.config import DataConfig, SourceConfig

    stdlib, packages = (SMOKE_STDLIB, SMOKE_PACKAGES) if args.smoke else (STDLIB, PACKAGES)
    return DataConfig(
        sources=[SourceConfig(name="stdlib", root="stdlib", include=stdlib, weight=3.0),
                 SourceConfig(name="packages", root="site-packages", include=packages,
                              exclude=["**/tests/**"], weight=1.0)],
        heldout_fraction=args.heldout_fraction, seed=args.seed, shard_tokens=1 << 20,
        cache_dir=str(cache_dir))


def prepare_data(out: Path, start: Path, args):
    """Tokenize the mixture once (shared by the CPT runs); build SFT data and RL tasks."""
    from transformers import AutoTokenizer

    from atelier.pretrain.corpus import build_corpus
    from atelier.pretrain.sources import HELDOUT, Doc, read_text

    data = data_config(args, out / "data")
    tokenizer = AutoTokenizer.from_pretrained(start)
    corpus = build_corpus(data, tokenizer, out / "data", quiet=True)
    docs = [Doc.from_json(line) for line in (out / "data" / "docs.jsonl").read_text().splitlines()]
    sources = {s.name: s for s in data.sources}

    def files(split_heldout: bool) -> list[tuple[str, str]]:
        return [(_rel_path(d), read_text(d, sources)) for d in docs if (d.split == HELDOUT) == split_heldout]

    n_rl = args.rl_steps * args.groups_per_step
    sft = line_tasks(files(False), args.sft_examples, seed=args.seed, per_file=4, prefix="sft")
    rl = line_tasks(files(True), n_rl, seed=args.seed + 1, per_file=3, prefix="rl")
    if len(rl) < n_rl:
        raise SystemExit(f"the held-out repositories give {len(rl)} RL tasks, {n_rl} needed "
                         f"(--rl-steps x --groups-per-step): raise --heldout-fraction")
    sft_file = out / "sft.jsonl"
    sft_file.write_text("".join(json.dumps(chat_record(t)) + "\n" for t in sft))
    rl_file = out / "rl_tasks.jsonl"
    rl_file.write_text("".join(json.dumps(t.to_json()) + "\n" for t in rl))
    info = {"train_tokens": corpus.info["tokens"], "heldout_tokens": corpus.info["heldout_tokens"],
            "documents": corpus.info["documents"], "repos": corpus.info["repos"],
            "heldout_repos": sorted(Path(p).name for p in corpus.heldout_repos),
            "sft_examples": len(sft), "rl_tasks": len(rl)}
    return data, info, sft_file, rl_file


def _rel_path(doc) -> str:
    if doc.repo_path:
        return Path(doc.ref).relative_to(Path(doc.repo_path).parent).as_posix()
    return doc.ref


def run_cpt(out: Path, start: Path, data, steps: int, args) -> dict[str, Any]:
    from atelier.pretrain.config import BaseEvalConfig, PhaseConfig, PretrainConfig

    phase = PhaseConfig(name="cpt", steps=steps, seq_len=args.seq_len, micro_batch=args.micro_batch,
                        lr=args.cpt_lr, warmup_steps=max(1, steps // 10), min_lr_ratio=0.1)
    config = PretrainConfig(
        model=str(start), data=data, phases=[phase], seed=args.seed, device="cpu", threads=args.threads,
        log_every=max(1, steps // 8), checkpoint_every=max(50, steps // 4), keep_checkpoints=1,
        evals=BaseEvalConfig(enabled=True, window=min(256, args.seq_len), stride=min(128, args.seq_len // 2),
                             max_repo_tokens=args.eval_tokens, histories=0))
    summary = _pretrain(config, out, quiet=False)
    losses = _losses(out)
    return {"steps": steps, "tokens": steps * args.micro_batch * args.seq_len,
            "heldout_nll": summary["evals"]["perplexity"]["nll_per_token"],
            "heldout_tokens": summary["evals"]["perplexity"]["tokens"],
            "train_loss_last": mean(losses[-max(1, steps // 10):]), "model": str(out / "final")}


def run_sft(out: Path, model: str, sft_file: Path, args) -> dict[str, Any]:
    from atelier.pretrain.config import PhaseConfig, PretrainConfig

    phase = PhaseConfig(name="sft", kind="sft", steps=args.sft_steps, seq_len=args.sft_seq_len,
                        micro_batch=4, lr=args.sft_lr, warmup_steps=max(1, args.sft_steps // 10),
                        weight_decay=0.0, chat=[str(sft_file)])
    config = PretrainConfig(model=model, phases=[phase], seed=args.seed, device="cpu", threads=args.threads,
                            log_every=max(1, args.sft_steps // 5), checkpoint_every=max(50, args.sft_steps),
                            keep_checkpoints=1)
    _pretrain(config, out, quiet=True)
    losses = _losses(out)
    return {"steps": args.sft_steps, "loss_first": losses[0], "loss_last": mean(losses[-3:]),
            "model": str(out / "final")}


def run_rl(out: Path, model: str, tasks_file: Path, args) -> dict[str, Any]:
    from atelier.rl.config import (
        CurriculumConfig,
        EnvConfig,
        PythonEnvConfig,
        RolloutConfig,
        SyncConfig,
        TrainConfig,
        TrainerConfig,
    )
    from atelier.rl.run import run_training
    from atelier.rl.shaping import ShapingConfig

    config = TrainConfig(
        model=model, seed=args.seed,
        # sync: every batch comes from the current weights, so the arms see the same
        # tasks in the same order whatever each rollout's speed; no curriculum for the same reason.
        rollout=RolloutConfig(mode="sync", group_size=args.group_size, groups_per_step=args.groups_per_step,
                              workers=args.group_size * args.groups_per_step, max_tokens=args.max_tokens,
                              temperature=1.0, min_valid=2),
        trainer=TrainerConfig(steps=args.rl_steps, lr=args.rl_lr, norm_tokens=256, micro_batch=16,
                              checkpoint_every=max(1, args.rl_steps), threads=args.threads),
        sync=SyncConfig(kind="inprocess"), curriculum=CurriculumConfig(enabled=False),
        env=EnvConfig(kind="python", python=PythonEnvConfig(
            factory=f"{Path(__file__).resolve().with_name('completion.py')}:make_environment",
            args={"tasks_file": str(Path(tasks_file).resolve())})),
        # Reward = correctness only: no length or tool-call shaping in a single-line task.
        shaping=ShapingConfig(length_coef=0.0, broken_call_penalty=0.0, unfinished_todo_penalty=0.0))
    summary_path = out / "summary.json"
    if not summary_path.exists():   # a run cut off earlier continues from its last commit
        run_training(config, out, on_step=lambda r: print(
            f"    rl step {r['step']:>3}  reward {r['reward_mean']:.3f}  pass {r['pass_rate']:.2f}",
            flush=True))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward_mean"] for r in rows]
    final, stderr = final_reward(rewards, args.last_k)
    return {"steps": len(rows), "reward_curve": rewards, "pass_curve": [r["pass_rate"] for r in rows],
            "reward_first": rewards[0] if rewards else float("nan"), "reward_final": final,
            "reward_final_stderr": stderr, "pass_final": mean([r["pass_rate"] for r in rows][-args.last_k:])}




def _pretrain(config, out: Path, quiet: bool) -> dict[str, Any]:
    from atelier.pretrain.train import run_pretrain

    if not (out / "summary.json").exists():
        run_pretrain(config, out, quiet=quiet)
    return json.loads((out / "summary.json").read_text())


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]


# --- driver -----------------------------------------------------------------------------------

def run_experiment(args) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    earlier = _earlier_arms(out)
    start = build_start(out, args)
    data, data_info, sft_file, rl_file = prepare_data(out, start, args)
    prep_s = time.perf_counter() - started
    _say(f"data: {data_info}")
    arms = []
    for m in args.multipliers:
        arm: dict[str, Any] = {"multiplier": m}
        before = earlier.get(m, {})
        arm["cpt"] = _timed(out / f"cpt-{m}x", before.get("cpt"),
                            lambda: run_cpt(out / f"cpt-{m}x", start, data, m * args.unit_steps, args))
        _say(f"{m}x CPT: {arm['cpt']['tokens']} tokens, held-out NLL {arm['cpt']['heldout_nll']:.4f}")
        arm["sft"] = _timed(out / f"sft-{m}x", before.get("sft"),
                            lambda: run_sft(out / f"sft-{m}x", str(out / arm["cpt"]["model"]), sft_file, args))
        _say(f"{m}x SFT: loss {arm['sft']['loss_first']:.3f} -> {arm['sft']['loss_last']:.3f}")
        arm["rl"] = _timed(out / f"rl-{m}x", before.get("rl"),
                           lambda: run_rl(out / f"rl-{m}x", str(out / arm["sft"]["model"]), rl_file, args))
        _say(f"{m}x RL: reward {arm['rl']['reward_first']:.3f} (first step) -> "
             f"{arm['rl']['reward_final']:.3f} (last {args.last_k} steps)")
        arms.append(arm)
    stage_s = [a[k].get("wall_s") for a in arms for k in ("cpt", "sft", "rl")]
    results = {
        "setup": {k: v for k, v in vars(args).items() if k not in {"out", "budgets"}},
        "data": data_info, "arms": arms,
        # Data preparation of this call plus every stage's time when it ran (stages an
        # earlier call finished keep that call's time).
        "wall_s": prep_s + sum(w for w in stage_s if w is not None),
        "model_parameters": _parameters(start), "torch": torch.__version__, "threads": args.threads,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot_results(results, out / "cpt_scaling.png")
    return results


def _timed(run_dir: Path, earlier: dict[str, Any] | None, stage) -> dict[str, Any]:
    """Run `stage`; record its wall time in run_dir/stage_wall.json the call that finishes it,
    and make its model path relative to the experiment directory (results carry no machine paths)."""
    finished_before = (run_dir / "summary.json").exists()
    t = time.perf_counter()
    result = stage()
    marker = run_dir / "stage_wall.json"
    if not finished_before:
        marker.write_text(json.dumps({"wall_s": time.perf_counter() - t}) + "\n")
    if marker.exists():
        result["wall_s"] = json.loads(marker.read_text())["wall_s"]
    else:  # finished by a version of this script that kept times only in results.json
        result["wall_s"] = (earlier or {}).get("wall_s")
    if "model" in result:
        result["model"] = Path(os.path.relpath(result["model"], run_dir.parent)).as_posix()
    return result


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _earlier_arms(out: Path) -> dict[int, dict[str, Any]]:
    path = out / "results.json"
    if not path.exists():
        return {}
    return {a["multiplier"]: a for a in json.loads(path.read_text())["arms"]}


def plot_results(results: dict[str, Any], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    arms = results["arms"]
    tokens = [a["cpt"]["tokens"] for a in arms]
    nll = [a["cpt"]["heldout_nll"] for a in arms]
    reward = [a["rl"]["reward_final"] for a in arms]
    err = [0.0 if math.isnan(a["rl"]["reward_final_stderr"]) else a["rl"]["reward_final_stderr"] for a in arms]
    labels = [f"{a['multiplier']}x" for a in arms]
    fig, (ax_loss, ax_curve, ax_reward) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_loss.plot(tokens, nll, "o-")
    ax_loss.set_xscale("log")
    ax_loss.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_loss.set_xticks(tokens, [f"{t / 1000:.0f}k\n({label})" for t, label in zip(tokens, labels)])
    ax_loss.set_xlabel("CPT tokens")
    ax_loss.set_ylabel("held-out NLL per token (nats)")
    ax_loss.set_title("CPT: codebase perplexity, held-out repos")
    for a, label in zip(arms, labels):
        curve = a["rl"]["reward_curve"]
        ax_curve.plot(range(1, len(curve) + 1), curve, label=f"CPT {label}")
    ax_curve.set_xlabel("RL step")
    ax_curve.set_ylabel("mean reward")
    ax_curve.set_title("RL reward (same SFT, tasks, seeds)")
    ax_curve.legend()
    ax_reward.errorbar(nll, reward, yerr=err, fmt="o", capsize=4)
    for x, y, label in zip(nll, reward, labels):
        ax_reward.annotate(label, (x, y), textcoords="offset points", xytext=(6, 4))
    ax_reward.set_xlabel("CPT held-out NLL per token (nats)")
    ax_reward.set_ylabel(f"final RL reward (last {results['setup']['last_k']} steps)")
    ax_reward.set_title("final RL reward vs CPT loss")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run_experiment(parse_args(argv))


if __name__ == "__main__":
    main()
