"""How MTP heads' acceptance moves as the policy does: heads distilled from one model, measured on
its descendants through SFT and RL, on the text RL sampled.

    python experiments/mtp_rl_drift/run.py --heads ~/.cache/atelier/models/smollm2-135m-mtp --run runs/demo \
        [--chat runs/mtp-attach/replies-heldout.jsonl] [--out runs/mtp-rl-drift]

Trunks, in order: the heads' own model (the one they were distilled from), the run's SFT model
(`<run>/sft/final`) and each RL checkpoint (`<run>/rl/checkpoints/step-*/model`). Each trunk gets
the same heads, unchanged, beside it (`link_model_with_heads`) and is measured as `atelier mtp
eval` measures (teacher-forced greedy acceptance against that trunk's own argmax) on the sampled
tokens of the run's RL rollouts and, with `--chat`, on held-out replies of the heads' model. So
each point says how many of the heads' drafts that policy would keep. Writes results.json and
mtp_rl_drift.png beside this file (under --out with --smoke).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from atelier.pretrain.mtp_eval import evaluate_heads
from atelier.pretrain.mtp_phase import link_model_with_heads

HERE = Path(__file__).resolve().parent


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", required=True, help="a model directory with MTP heads (atelier mtp attach --out)")
    p.add_argument("--run", required=True, help="a run directory of `atelier run` (sft/ and rl/ in it)")
    p.add_argument("--chat", action="append", default=[], help="held-out replies (JSONL chats)")
    p.add_argument("--out", default="runs/mtp-rl-drift", help="where the trunks with heads are linked")
    p.add_argument("--smoke", action="store_true", help="write results beside --out (tests)")
    return p.parse_args(argv)


def trunks(run: Path, heads: Path) -> list[tuple[str, Path]]:
    """(name, model directory) of every policy along the run, the heads' own model first."""
    found = [("heads' model", heads), ("SFT", run / "sft" / "final")]
    found += [(f"RL step {int(p.parent.name.split('-')[-1])}", p)
              for p in sorted((run / "rl" / "checkpoints").glob("step-*/model"))]
    missing = [str(path) for _, path in found if not (path / "config.json").is_file()]
    if missing:
        raise SystemExit(f"not model directories: {', '.join(missing)} (is --run a run of `atelier run`?)")
    return found


def measure(name: str, trunk: Path, heads: Path, rollouts: Path, chats: list[str], out: Path) -> dict[str, Any]:
    slug = name.replace(" ", "-").replace("'", "")
    linked = trunk if trunk == heads else link_model_with_heads(trunk, heads, out / slug)
    result = evaluate_heads(str(linked), tokens=1, prompts=0, device="cpu", chats=chats, trajectories=[rollouts])
    return {"trunk": name, "model": str(trunk), "rollouts": _brief(result["rollouts"]), "chat": _brief(result["chat"])}


def _brief(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {"mean_accepted_length": stats["mean_accepted_length"], "rates": [h["rate"] for h in stats["per_head"]],
            "tokens": stats["tokens"]}


def plot(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [p["trunk"] for p in points]
    for measure_name, label in (("rollouts", "RL rollouts' sampled tokens"), ("chat", "held-out replies")):
        values = [p[measure_name]["mean_accepted_length"] if p[measure_name] else None for p in points]
        if any(v is not None for v in values):
            ax.plot(names, values, marker="o", label=label)
    ax.set_ylabel("mean accepted length (greedy)")
    ax.set_xlabel("the policy the heads draft for")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    run, heads, out = Path(args.run).expanduser(), Path(args.heads).expanduser(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rollouts = run / "rl" / "rollouts"
    points = [measure(name, trunk, heads, rollouts, args.chat, out) for name, trunk in trunks(run, heads)]
    where = out if args.smoke else HERE
    (where / "results.json").write_text(json.dumps({"heads": str(heads), "run": str(run), "points": points},
                                                   indent=1) + "\n")
    plot(points, where / "mtp_rl_drift.png")
    print(json.dumps({p["trunk"]: (p["rollouts"] or {}).get("mean_accepted_length") for p in points}))


if __name__ == "__main__":
    main()
