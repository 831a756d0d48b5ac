"""Grading time: the tamper-proof grader against the previous JUnit-file path, in one run.

Usage: python benchmarks/grading.py SUITE_OR_TASK [--tasks N] [--repeats R] [--backend bwrap]

For each task (the first N of a built suite, e.g. `atelier tasks build --suite
atelier-bench --out DIR`), the gold patch is graded R times by each path,
alternating new and old so that machine load falls on both alike:
- new: `atelier.tasks.grade.grade` (reporter on the stdout pipe, canaries,
  integrity checks, static screen);
- old: what grading did before, rebuilt here from the pieces that remain:
  a fresh sandbox, `git apply`, the test files and pytest control files put
  back, pytest with `--junitxml` to a file under the sandbox's /tmp, the file
  read back with `cat` and parsed (`parse_junit`), `score`.
Both share the environment build (done once, before timing).

Prints one JSON object: per-path total seconds, the overhead of new over old,
per-task medians, and the gold rewards and tamper flags each path gave (the
new path must give reward 1 with no `tampered` flag wherever the old one
gives 1).
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from pathlib import Path

from atelier.sandbox import create_sandbox
from atelier.tasks import load_task
from atelier.tasks.envs import ensure_env, env_mounts, env_python
from atelier.tasks.grade import _restore_tests, grade, score, test_argv
from atelier.tasks.junit import JUnitError, parse_junit
from atelier.tasks.validate import task_dirs

sys.path.insert(0, str(Path(__file__).parent))
import record  # noqa: E402


def grade_old(task, patch: str, backend: str, cache_dir: str | None):
    """The previous grader: JUnit XML to a file the tested process can see."""
    venv = ensure_env(task, cache_dir)
    mounts = env_mounts(venv) if venv else []
    python = env_python(venv) if venv else None
    f2p, p2p = task.fail_to_pass, task.pass_to_pass
    with create_sandbox(task.snapshot, task.limits.sandbox_config(backend=backend, ro_mounts=mounts)) as sb:
        timeout = task.limits.timeout_s or sb.config.timeout_s
        if patch.strip():
            applied = sb.exec(["git", "apply", "--whitespace=nowarn", "-"], stdin=patch.encode(), timeout=60)
            if not applied.ok:
                return score(f2p, p2p, None, None, error="the patch does not apply")
        _restore_tests(sb, task)
        junit = f"/tmp/atelier-junit-{secrets.token_hex(8)}.xml"
        run = sb.exec(test_argv(task, python, junit), timeout=timeout, env={"PYTHONDONTWRITEBYTECODE": "1"})
        if run.timed_out:
            return score(f2p, p2p, None, run.exit_code, timed_out=True, timeout_s=timeout)
        read = sb.exec(["cat", junit], timeout=60)
        if read.exit_code != 0:
            return score(f2p, p2p, None, run.exit_code)
        try:
            results = parse_junit(read.stdout, known_files=task.test_files())
        except JUnitError as exc:
            return score(f2p, p2p, None, run.exit_code, error=str(exc))
        return score(f2p, p2p, results, run.exit_code)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a built suite directory or one task directory")
    ap.add_argument("--tasks", type=int, default=5, help="first N tasks of the suite")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", default="bwrap", choices=["bwrap", "local"])
    ap.add_argument("--cache-dir", default=None, help="environment cache (default: ATELIER_CACHE)")
    record.add_no_save(ap)
    args = ap.parse_args(argv)
    stamp = record.stamp()
    tasks = [load_task(d) for d in task_dirs(args.path)[: args.tasks]]
    for task in tasks:
        ensure_env(task, args.cache_dir)
    paths = {"new": lambda t: grade(t, t.gold_patch, backend=args.backend, cache_dir=args.cache_dir),
             "old": lambda t: grade_old(t, t.gold_patch, args.backend, args.cache_dir)}
    per_task = []
    totals = {"new": 0.0, "old": 0.0}
    for task in tasks:
        times: dict[str, list[float]] = {"new": [], "old": []}
        outcome: dict[str, dict] = {}
        for r in range(args.repeats):
            for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
                start = time.perf_counter()
                result = paths[name](task)
                times[name].append(time.perf_counter() - start)
                outcome.setdefault(name, {"rewards": [], "tampered": 0, "tamper_suspect": 0})
                outcome[name]["rewards"].append(result.reward)
                outcome[name]["tampered"] += int(result.tampered)
                outcome[name]["tamper_suspect"] += int(bool(result.tamper_suspect))
        for name in totals:
            totals[name] += sum(times[name])
        per_task.append({"task": task.id, "tests": len(task.fail_to_pass) + len(task.pass_to_pass),
                         "median_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
                         **{k: v for k, v in outcome.items()}})
    overhead = totals["new"] / totals["old"] - 1.0 if totals["old"] else None
    print(json.dumps(record.finish("grading", {
        "benchmark": "grading", **stamp, "backend": args.backend, "tasks": len(tasks), "repeats": args.repeats,
        "total_s": {k: round(v, 2) for k, v in totals.items()},
        "overhead": None if overhead is None else round(overhead, 4),
        "gold_false_positives": sum(t["new"]["tampered"] for t in per_task),
        "per_task": per_task,
    }, not args.no_save)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
