"""MTP heads attached to SmolLM2-135M on this CPU: greedy acceptance against training tokens and time.

    python experiments/mtp_attach/run.py --out runs/mtp-attach [--arms frozen,joint,...] [--smoke]

First the corpus, once: `atelier mtp generate` writes the model's replies that every arm distils on
(as the recipe's header does, `--out`/replies.jsonl) and replies to held-out prompts
(replies-heldout.jsonl). Every arm is recipes/mtp-attach-smollm2.toml with a few keys changed (the
arm's recipe is written beside its run), run as its own `atelier mtp attach` process (`atelier
pretrain` for the joint trunk, which attach refuses), then measured by `atelier mtp eval` on the
held-out replies, on held-out code and on greedy continuations of it. Arms:

- frozen: the recipe as it is (frozen trunk, heads from scratch, distilled on the first 8,192 ids);
- frozen-short: the same at half the steps (the comparisons below are at this length);
- last-layer: half the steps, each head's block a copy of the trunk's last layer;
- full-vocab: distilled on the whole vocabulary, a quarter of the steps (its step costs about
  three of the others': compare at equal training seconds);
- joint: half the steps, the trunk trained too (its own NLL plus the heads' loss) at a learning
  rate a hundredth of the heads'. The arms draw the same rows in the same order, so the joint
  arm's training NLL (the trunk's, before each step) against frozen-short's (the untouched base
  on the same rows) says what training the trunk too did to the main model.

Per arm: wall time of the run, training seconds (the steps' own), tokens, the acceptance history
(mtp-acceptance.json, with each point's training seconds), the training NLL of the main model
over the last steps, and the final evaluations. Writes results.json and mtp_attach.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import tomli_w

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "mtp-attach-smollm2.toml"
HERE = Path(__file__).resolve().parent

ARMS: dict[str, dict[str, Any]] = {
    "frozen": {},
    "frozen-short": {"steps": 0.5},
    "last-layer": {"steps": 0.5, "mtp": {"init": "last_layer"}},
    "full-vocab": {"steps": 0.25, "mtp": {"draft_vocab": None}},
    "joint": {"steps": 0.5, "lr": 2e-5, "mtp": {"trunk": "joint", "lr_scale": 100.0}},
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--recipe", default=str(RECIPE))
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="a tiny model and a few steps (tests)")
    return p.parse_args(argv)


CORPUS = {"replies": ["--chat", "700", "--agent", "20"], "replies-heldout": ["--chat", "48", "--agent", "4",
                                                                          "--split", "heldout"]}
SMOKE_CORPUS = ["--chat", "4", "--agent", "1", "--max-tokens", "8"]


def corpus(out: Path, smoke: bool) -> dict[str, Any]:
    """The two reply files (written once: a rerun keeps them), and the seconds each took."""
    from atelier.inference.models import resolve_or_build_tiny

    out.mkdir(parents=True, exist_ok=True)
    model = str(resolve_or_build_tiny("tiny", out)) if smoke else "smollm2-135m"   # the arms' "tiny" is the same
    written: dict[str, Any] = {}
    for name, options in CORPUS.items():
        path = out / f"{name}.jsonl"
        if not path.exists():
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "atelier.cli.main", "mtp", "generate", "--model", model,
                            "--out", str(path), "--json",
                            *(SMOKE_CORPUS + options[4:] if smoke else options)],
                           check=True, capture_output=True, text=True, cwd=ROOT)
            written[f"{name}_s"] = time.perf_counter() - started
        written[name] = str(path)
    return written


def arm_recipe(base: dict[str, Any], arm: dict[str, Any], smoke: bool, out: Path) -> dict[str, Any]:
    """The base recipe with the arm's changes (steps as a fraction of the base's), distilling on
    out/replies.jsonl."""
    recipe = json.loads(json.dumps(base))
    phase = recipe["phases"][0]
    phase["chat"] = [str(out / "replies.jsonl")]
    phase["steps"] = max(2, round(phase["steps"] * arm.get("steps", 1.0)))
    if "lr" in arm:
        phase["lr"] = arm["lr"]
    for key, value in arm.get("mtp", {}).items():
        if value is None:
            recipe["mtp"].pop(key, None)
        else:
            recipe["mtp"][key] = value
    if smoke:
        recipe.update(model="tiny", precision="fp32", threads=1, log_every=1)
        recipe["data"]["cache_dir"] = str(out / "data")
        recipe["data"]["sources"][0]["include"] = ["json/*.py", "textwrap.py", "shlex.py", "bisect.py",
                                                   "colorsys.py", "string.py", "html/*.py"]
        recipe["data"]["heldout_fraction"] = 0.3
        phase.update(steps=max(2, round(4 * arm.get("steps", 1.0))), seq_len=256)
        recipe["mtp"].update(eval_every=2, eval_rows=1)
        if "draft_vocab" in recipe["mtp"]:   # the tiny model has 512 ids
            recipe["mtp"]["draft_vocab"] = 256
    return recipe


def run_arm(name: str, recipe: dict[str, Any], out: Path, eval_tokens: int, smoke: bool) -> dict[str, Any]:
    arm_dir = out / name
    arm_dir.mkdir(parents=True, exist_ok=True)
    recipe_path = arm_dir / "recipe.toml"
    recipe_path.write_text(tomli_w.dumps(recipe))
    run_dir, model_dir = arm_dir / "run", arm_dir / "model"
    joint = recipe["mtp"].get("trunk") == "joint"
    cli = [sys.executable, "-m", "atelier.cli.main"]
    command = cli + (["pretrain", str(recipe_path), "--run-dir", str(run_dir), "--json"] if joint else
                     ["mtp", "attach", str(recipe_path), "--run-dir", str(run_dir), "--out", str(model_dir),
                      "--json"])
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    wall_s = time.perf_counter() - started
    model = run_dir / "final" if joint else model_dir
    evaluation = [cli + ["mtp", "eval", "--model", str(model), "--json", "--tokens", str(eval_tokens),
                         "--chat", str(out / "replies-heldout.jsonl")]]
    if smoke:
        evaluation[0] += ["--seq-len", "64", "--prompts", "2", "--prompt-len", "16", "--new-tokens", "8"]
    evaluated = json.loads(subprocess.run(evaluation[0], check=True, capture_output=True, text=True,
                                          cwd=ROOT).stdout)
    return {"recipe": recipe, "wall_s": wall_s, **_history(run_dir), "eval": evaluated}


def _history(run_dir: Path) -> dict[str, Any]:
    """Acceptance points with the training seconds (the steps' own time) spent before each."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds, spent = {}, 0.0
    for r in records:
        if "step_s" in r:
            spent += r["step_s"]
            seconds[r["step"]] = spent
    points = [{"step": r["step"], "tokens": r["mtp_tokens_seen"], "train_s": seconds.get(r["step"]),
               "mean_accepted_length": r["mtp_acceptance"]["mean_accepted_length"],
               "rates": [h["rate"] for h in r["mtp_acceptance"]["per_head"]]}
              for r in records if "mtp_acceptance" in r]
    steps = [r for r in records if "step_s" in r]
    last = [r["loss"] for r in steps[-10:]]
    return {"train_s": spent, "steps": len(steps), "tokens": sum(r["tokens"] for r in steps),
            "history": points, "last_steps_nll": sum(last) / max(len(last), 1)}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for name, arm in results["arms"].items():
        points = arm["history"]
        lengths = [p["mean_accepted_length"] for p in points]
        by_tokens.plot([p["tokens"] for p in points], lengths, marker="o", label=name)
        by_time.plot([p["train_s"] for p in points], lengths, marker="o", label=name)
    by_tokens.set_xlabel("training tokens")
    by_time.set_xlabel("training seconds (2 CPU cores)")
    for ax in (by_tokens, by_time):
        ax.set_ylabel("mean accepted length, held-out code (greedy, 3 heads)")
        ax.grid(alpha=0.3)
    by_tokens.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    from atelier.compat import tomllib

    args = parse_args(argv)
    out = Path(args.out).resolve()
    base = tomllib.loads(Path(args.recipe).read_text())
    results_path = out / "results.json" if args.smoke else HERE / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {"arms": {}}
    results["corpus"] = {**results.get("corpus", {}), **corpus(out, args.smoke)}
    for name in args.arms.split(","):
        recipe = arm_recipe(base, ARMS[name], args.smoke, out)
        results["arms"][name] = run_arm(name, recipe, out, args.eval_tokens, args.smoke)
        results_path.parent.mkdir(parents=True, exist_ok=True)
        results_path.write_text(json.dumps(results, indent=1) + "\n")   # after each arm: a rerun keeps the rest
    plot(results, results_path.parent / "mtp_attach.png")
    print(json.dumps({name: {"wall_s": a["wall_s"], "tokens": a["tokens"],
                             "chat": a["eval"]["chat"]["mean_accepted_length"],
                             "text": a["eval"]["text"]["mean_accepted_length"],
                             "greedy": (a["eval"]["greedy"] or {}).get("mean_accepted_length")}
                      for name, a in results["arms"].items()}))


if __name__ == "__main__":
    main()
