"""Projection: the two cluster files of recipes/clusters/ swept by `atelier simulate sweep`.

    python experiments/simulate/run.py [--out experiments/simulate] [--quick]

- `report-1t-moe.toml` (a slice of a cluster shaped like the report's: 1T MoE, three GPU
  regions, four CPU regions, its published step, rollout, delta and swap figures): the
  split of its 328 GPUs, the staleness bound, async over sync, the cost of a 10-minute outage
  of an inference region, a sandbox region and the trainer's node;
- `coder-7b.toml` (a user's: a 7B coder on H100s): the same from 8 to 512 GPUs.

Each sweep writes `<out>/<name>/sweep.json` and its plots; `<out>/results.json` gathers the
headlines. Every input's source (measured, published, assumed) is in the cluster files'
[sources] and repeated in each sweep.json. `--quick` shrinks the sweeps (the slow test runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "recipes" / "clusters"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("--quick", action="store_true", help="fewer points and steps (a smoke run)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from atelier.sim.sweep import run_sweep

    quick = ["steps=3"] if args.quick else []
    plans = {
        "report-1t-moe": dict(gpus=[], shares=[0.5, 0.6, 0.7, 0.8, 0.9] if not args.quick else [0.9],
                              staleness=[0, 1, 2, 4] if not args.quick else [1], outage_s=600.0),
        "coder-7b": dict(gpus=[8, 16, 32, 64, 128, 256, 512] if not args.quick else [16],
                         shares=[0.25, 0.5, 0.625, 0.75, 0.875] if not args.quick else [0.5],
                         staleness=[0, 1, 2, 4] if not args.quick else [1], outage_s=600.0,
                         groups_per_gpu=0.5),
    }
    results = {}
    for name, plan in plans.items():
        report = run_sweep(CLUSTERS / f"{name}.toml", args.out / name, overrides=quick, **plan)
        results[name] = report["headline"]
        print(json.dumps({name: report["headline"]}), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
