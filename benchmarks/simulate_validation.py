"""The simulator against real runs: calibrated on one run, each prediction of another run.

Runs `atelier train` (each in its own process, each run directory kept in `--runs` and reused
by later invocations), calibrates `atelier.sim` on one run of each family and predicts the
others of that family from their recipes alone, then prints ONE JSON object: every prediction
against its measurement with the relative error of the wall time and of the throughput, the
staleness distributions and their total variation distance, and whether every wall-time and
throughput error is within the target (15%).

The families (what is calibrated on what):
- tiny (built-in engine): `recipes/rl-tiny.toml` with 1 s +-50% of environment time per
  rollout (as `benchmarks/rl_async.py`) and 16 workers; calibrated on the async run, predicts
  the sync run and a run with 2 trainer ranks;
- vllm: the tiny recipe on a vLLM server (the slow tests' settings); calibrated on a clean run,
  predicts a run whose server is killed with SIGKILL after step 4 (the kill is the one input the
  prediction is told: when it came; the restart's length is the calibration run's server start,
  from its log);
- demo: the demo's RL stage (`recipes/demo.toml`'s [rl], its agent, SmolLM2-135M) on 8 funcy
  2.0 mutation tasks of the atelier-bench suite, from the base model (the demo starts RL from
  its SFT checkpoint), its 4 steps; calibrated on the stage in sync mode,
  predicts it in its own async mode.

    python benchmarks/simulate_validation.py [--runs DIR] [--families tiny,vllm,demo] [--save]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
TARGET = 0.15
TINY = ["env.toy.env_latency_s=1.0", "env.toy.env_latency_spread=0.5", "rollout.workers=16"]
VLLM = ["inference.engine=vllm", "inference.vllm.enforce_eager=true", "inference.vllm.chunk_tokens=8",
        "inference.vllm.dtype=float32", "inference.vllm.max_model_len=512", "trainer.steps=12",
        "rollout.workers=8", "env.toy.tasks=64", "env.toy.env_latency_s=0.5", "env.toy.env_latency_spread=0.5"]
KILL_AFTER_STEP = 4


def train(run_dir: Path, recipe: Path, overrides: list[str], kill_after: int | None = None) -> None:
    """`atelier train` into `run_dir` unless it finished there before; with `kill_after`, SIGKILL
    the run's vLLM server once that step's metrics line is written, and note when."""
    if (run_dir / "summary.json").is_file():
        return
    argv = [sys.executable, "-m", "atelier.cli.main", "train", str(recipe), "--run-dir", str(run_dir), "--quiet"]
    for o in overrides:
        argv += ["--set", o]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    killer = None
    if kill_after is not None:
        killer = threading.Thread(target=_kill_server_after, args=(run_dir, kill_after, proc), daemon=True)
        killer.start()
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"atelier train {recipe} into {run_dir} failed:\n{err[-3000:]}")
    if killer is not None:
        killer.join()


def _kill_server_after(run_dir: Path, step: int, proc: subprocess.Popen) -> None:
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        if len(lines) >= step:
            pid = int((run_dir / "vllm" / "vllm-server.pid").read_text().split()[0])
            os.kill(pid, signal.SIGKILL)
            (run_dir / "killed.json").write_text(json.dumps({"pid": pid, "t": time.time(), "after_step": step}))
            return
        time.sleep(0.05)


def demo_recipe(runs: Path, suite: Path, mode: str, steps: int) -> Path:
    """The demo's RL stage as a recipe of `atelier train` (`atelier.pipeline.stages.rl_train_config`)."""
    from atelier.config import dump_config, load_config
    from atelier.pipeline.config import RunConfig
    from atelier.pipeline.stages import rl_train_config
    from atelier.rl.config import EnvConfig, TasksEnvConfig
    from atelier.tasks import load_suite

    ids = sorted(t.id for t in load_suite(suite) if t.id.startswith("funcy-2.0-mut-"))[:8]
    if len(ids) < 8:
        raise SystemExit(f"{suite} has {len(ids)} funcy 2.0 mutation tasks, not 8: "
                         "build it with `atelier tasks build --suite atelier-bench --out DIR`")
    demo = load_config(RunConfig, ROOT / "recipes" / "demo.toml",
                       [f"rl.rollout.mode={mode}", f"rl.trainer.steps={steps}"])
    env = EnvConfig(kind="tasks", tasks=TasksEnvConfig(suite=str(suite), tasks=ids, backend=demo.tasks.backend,
                                                       agent=demo.eval.agent))
    config = rl_train_config(demo, model=demo.model.name, env=env)
    path = runs / f"demo-rl-{mode}.toml"
    path.write_text(dump_config(config))
    return path


def families(runs: Path, chosen: set[str], suite: Path) -> list[dict]:
    """Each family: a warm-up run (not measured: it fills the compile caches, so that every measured
    run meets them warm, as any run after a machine's first does), its calibration run, its
    predicted runs, each with how it was made."""
    tiny = ROOT / "recipes" / "rl-tiny.toml"
    out = []
    if "tiny" in chosen:
        out.append({"family": "tiny", "warmup": ("tiny-warmup", tiny, [*TINY, "trainer.steps=2"]),
                    "calibration": ("tiny-async", tiny, TINY),
                    "targets": [("tiny-sync", tiny, [*TINY, "rollout.mode=sync"]),
                                ("tiny-2-ranks", tiny, [*TINY, "trainer.ranks=2"])]})
    if "vllm" in chosen:
        out.append({"family": "vllm", "warmup": ("vllm-warmup", tiny, [*VLLM, "trainer.steps=1"]),
                    "calibration": ("vllm", tiny, VLLM),
                    "targets": [("vllm-server-killed", tiny, VLLM)], "kill": "vllm-server-killed"})
    if "demo" in chosen:
        sync = demo_recipe(runs, suite, "sync", 4)
        out.append({"family": "demo", "warmup": ("demo-rl-warmup", sync, ["trainer.steps=1"]),
                    "calibration": ("demo-rl-sync", sync, []),
                    "targets": [("demo-rl-async", demo_recipe(runs, suite, "async", 4), [])]})
    return out


def measure_and_predict(runs: Path, family: dict) -> list[dict]:
    from atelier.sim.cluster import FaultSpec
    from atelier.sim.commands import check

    train(runs / family["warmup"][0], *family["warmup"][1:])
    name, recipe, overrides = family["calibration"]
    train(runs / name, recipe, overrides)
    rows = []
    for target, recipe, overrides in family["targets"]:
        killed = family.get("kill") == target
        train(runs / target, recipe, overrides, kill_after=KILL_AFTER_STEP if killed else None)
        faults = [FaultSpec(kind="inference_down", after_step=KILL_AFTER_STEP)] if killed else []
        result = check(runs / target, runs / name, faults)
        errors = result["errors"]
        rows.append({"family": family["family"], "run": target, "calibrated_on": name,
                     "recipe": str(Path(recipe).relative_to(ROOT)) if Path(recipe).is_relative_to(ROOT) else
                     Path(recipe).name, "overrides": overrides, "faults": [f.model_dump() for f in faults],
                     "wall_s": errors["wall_s"], "throughput_samples_per_s": errors["steady_samples_per_s"],
                     "tokens_per_s": errors["tokens_per_s"], "step_s": errors["step_s"],
                     "trainer_idle_fraction": errors["trainer_idle_fraction"], "staleness": errors["staleness"],
                     "rollouts": {"predicted": result["predicted"]["rollouts"],
                                  "measured": result["measured"]["rollouts"]},
                     "failures": {"predicted": result["predicted"]["failures"],
                                  "measured": result["measured"]["failures"]}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path(tempfile.gettempdir()) / "atelier-simulate-validation",
                    help="where the run directories are made and kept (reused when already finished)")
    ap.add_argument("--families", default="tiny,vllm,demo")
    ap.add_argument("--suite", type=Path, default=Path.home() / ".cache" / "atelier" / "suites" / "atelier-bench-v0")
    ap.add_argument("--save", action="store_true", help="also write benchmarks/results/simulate_validation-*.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT / "src"))
    from record import save, stamp

    args.runs.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "simulate_validation", **stamp(), "target_relative_error": TARGET, "predictions": []}
    for family in families(args.runs, set(args.families.split(",")), args.suite):
        report["predictions"] += measure_and_predict(args.runs, family)
    errors = [abs(p[key]["relative_error"]) for p in report["predictions"]
              for key in ("wall_s", "throughput_samples_per_s") if p[key]["relative_error"] is not None]
    report["max_abs_error"] = round(max(errors), 4) if errors else None
    report["within_target"] = bool(errors) and max(errors) <= TARGET
    if args.save:
        report["saved"] = str(save("simulate_validation", report))
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
