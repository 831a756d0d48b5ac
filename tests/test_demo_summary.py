"""The pieces of `atelier run`'s summary and split, on small inputs built here:
the file split, the process-tree memory walk, zero-variance groups, and
summary.json recomputed from evaluation records written by the real writer."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from atelier.cli.run import final_table
from atelier.config import load_config
from atelier.eval.compare import mcnemar_one_sided, wilson_interval
from atelier.eval.records import EvalRecord, ResultsWriter
from atelier.pipeline.config import RunConfig
from atelier.pipeline.memory import TreeMemory, same_memory, tree_memory, tree_pids
from atelier.pipeline.summary import build_summary, zero_variance_fraction
from atelier.rl.ledger import Ledger


def test_tree_pids_follows_parent_links() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 11, 20: 1, 30: 99}
    assert tree_pids(parents, 10) == {10, 11, 12}
    assert tree_pids(parents, 1) == {1, 10, 11, 12, 20}


def test_tree_memory_counts_a_child_process() -> None:
    if not Path("/proc/self/statm").exists():
        pytest.skip("no /proc")
    alone = tree_memory(os.getpid())
    # A child holding ~200 MB resident: both sums of the tree must grow by about that much.
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(200 << 20); "
                              "print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with TreeMemory(interval_s=0.05) as memory:
            memory.sample()
        assert memory.peak_rss - alone.rss > 150 << 20
        assert memory.peak_pss - alone.pss > 150 << 20
    finally:
        child.stdin.close()
        child.wait()


def test_tree_memory_counts_pages_a_forked_child_shares_once() -> None:
    """A process holding 200 MB forks two children that only read it: summed RSS
    counts the 200 MB three times, PSS once (the figure the demo's budget uses)."""
    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("no smaps_rollup (Linux 4.14+)")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, sys\n"
         "b = bytearray(200 << 20)\n"
         "for i in range(0, len(b), 4096): b[i] = 1\n"
         "for _ in range(2):\n"
         "    if os.fork() == 0: os.read(0, 1); os._exit(0)\n"
         "print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        sample = tree_memory(holder.pid)
        assert sample.rss > 3 * (190 << 20)  # the holder and both children each map the 200 MB
        assert 190 << 20 < sample.pss < 300 << 20
    finally:
        holder.stdin.close()
        holder.wait()


# Run in a process of its own: reading smaps_rollup walks the reader's whole address space, and
# the test process, with models loaded by earlier tests, made each of the 1,000 samples 30x dearer.
BUSY_PROCESS = """
import json, os, subprocess, sys, threading
import numpy as np
from atelier.pipeline.memory import tree_memory

held = np.ones(400 << 17)   # 400 MiB, so that a second count stands out
stop = threading.Event()

def churn():   # page counts that change between two reads of /proc, as a training step's do
    while not stop.is_set():
        np.ones(40 << 17)

def spawn():   # vfork children (subprocess's default): each is this memory until it execs
    while not stop.is_set():
        subprocess.run(["true"])

workers = [threading.Thread(target=work) for work in (churn, spawn)]
for worker in workers:
    worker.start()
try:
    samples = [tree_memory(os.getpid()) for _ in range(1000)]
finally:
    stop.set()
    for worker in workers:
        worker.join()
json.dump({figure: [getattr(s, figure) for s in samples] for figure in ("pss", "rss")}, sys.stdout)
"""


def test_a_busy_process_and_its_vfork_children_are_counted_once() -> None:
    """A process that starts subprocesses while its memory moves (the RL stage: a trainer
    stepping while rollouts start sandboxes) is counted once in every sample. A vfork child
    shows its parent's page counts until it execs; one that then exec'd or exited before its
    smaps_rollup was read was counted with those counts, a second copy of its parent: 2 to 17
    of 1,500 samples here, and an 11.65 GB peak on a stage that held about 6."""
    if platform.machine() not in ("x86_64", "aarch64") or not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("kcmp is looked up for x86_64 and aarch64 Linux")
    done = subprocess.run([sys.executable, "-c", BUSY_PROCESS], capture_output=True, text=True, check=True)
    for figure, values in json.loads(done.stdout).items():
        values.sort()
        twice = sum(v > values[len(values) // 2] + (300 << 20) for v in values)
        assert twice == 0, f"{twice} of {len(values)} samples counted the process twice ({figure})"


def test_same_memory_tells_a_shared_address_space_from_a_child_process() -> None:
    """The check that keeps a vfork child (its parent's memory under a second
    pid until it execs) from being counted as a second copy."""
    if platform.machine() not in ("x86_64", "aarch64") or not Path("/proc/self").exists():
        pytest.skip("kcmp is looked up for x86_64 and aarch64 Linux")
    assert same_memory(os.getpid(), os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert not same_memory(os.getpid(), child.pid)
    finally:
        child.stdin.close()
        child.wait()


def test_zero_variance_fraction() -> None:
    assert zero_variance_fraction([[0, 0, 0], [1, 0, 1], [0.5, 0.5]]) == 2 / 3
    assert zero_variance_fraction([]) is None
    assert zero_variance_fraction([[1, 0]], skipped=3) == 3 / 4   # tied groups skipped, never trained


def _write_eval(run_dir: Path, outcomes: dict[tuple[str, int], tuple[bool, int]]) -> None:
    run_dir.mkdir(parents=True)
    writer = ResultsWriter(run_dir)
    for (task, index), (success, diff) in outcomes.items():
        # An infrastructure error first, retried: only the last record of an attempt counts.
        writer.append(EvalRecord(task_id=task, pass_index=index, infra_error=True))
        writer.append(EvalRecord(task_id=task, pass_index=index, success=success, reward=float(success),
                                 diff_lines=diff))


def test_summary_is_recomputed_from_the_records(tmp_path: Path) -> None:
    keys = [(f"t{i}", p) for i in range(8) for p in range(4)]  # 32 attempts
    before = {k: (False, 0) for k in keys}
    sft = {k: (i % 8 == 0, 1 if i % 2 else 0) for i, k in enumerate(keys)}
    rl = {k: (i % 4 == 0, 1) for i, k in enumerate(keys)}
    for name, outcomes in (("eval-before", before), ("eval-sft", sft), ("eval-after", rl)):
        _write_eval(tmp_path / name, outcomes)
    ledger = Ledger(tmp_path / "rl" / "ledger.jsonl")
    for g, rewards in enumerate([[0.0, 0.0], [1.0, 0.0], [0.2, 0.2]]):
        ledger.add_group(f"g{g}", "t0", len(rewards), 0)
        for m, r in enumerate(rewards):
            ledger.set(f"g{g}/{m}", "trained", reward=r, step=1 if g < 2 else 2)
    ledger.add_group("g3", "t1", 2, 0)               # tied, dropped by rollout.skip_tied_groups
    for m in range(2):
        ledger.set(f"g3/{m}", "graded", reward=0.5)
    ledger.drop_group("g3", "tied: every member scored 0.5")
    ledger.close()
    (tmp_path / "rl" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward_mean": 0.25, "pass_rate": 0.25}) + "\n"
        + json.dumps({"step": 2, "reward_mean": 0.2, "pass_rate": 0.0}) + "\n")
    stages = {"eval-before": {"wall_s": 10.0, "peak_pss_mb": 700, "peak_rss_mb": 900},
              "rl": {"wall_s": 5.5, "peak_pss_mb": 2100, "peak_rss_mb": 2500}}

    summary = build_summary(tmp_path, stages, measure="edit", alpha=0.05)

    ev = summary["evaluations"]
    assert ev["before"]["pass_rate"] == 0.0 and ev["before"]["valid_attempts"] == 32
    assert ev["after_sft"]["pass_rate"] == 4 / 32 and ev["after_rl"]["pass_rate"] == 8 / 32
    assert ev["after_rl"]["pass_rate_interval_95"] == wilson_interval(8, 32)
    assert ev["after_sft"]["best_of_k"] == 4 / 8 and ev["after_rl"]["best_of_k"] == 8 / 8
    assert ev["after_sft"]["edit"]["rate"] == 0.5 and ev["after_rl"]["headline"]["rate"] == 1.0
    head = summary["headline"]
    assert head["measure"] == "edit" and head["pre_registered"]
    assert (head["improved"], head["worsened"]) == (16, 0)
    assert head["p_value"] == mcnemar_one_sided([(False, True)] * 16)["p_value"] and head["significant"]
    other = summary["other_tests"]["pass"]
    assert not other["pre_registered"] and (other["improved"], other["worsened"]) == (4, 0)
    assert summary["rl"]["reward_mean"] == [0.25, 0.2]
    assert summary["rl"]["zero_variance_fraction"] == [0.5, 1.0]
    assert summary["rl"]["zero_variance_groups"] == 3 and summary["rl"]["groups"] == 3
    assert summary["rl"]["tied_groups_skipped"] == 1 and summary["rl"]["zero_variance_fraction_all"] == 3 / 4
    assert summary["wall_s"] == {"eval-before": 10.0, "rl": 5.5} and summary["peak_rss_mb_run"] == 2500
    assert summary["peak_pss_mb"] == {"eval-before": 700, "rl": 2100} and summary["peak_pss_mb_run"] == 2100
    assert "rl_tasks" not in summary   # the run did not evaluate RL's own tasks (eval.rl_tasks off)

    # What `atelier run` prints at the end, from this summary, in an 80-column terminal.
    console = Console(width=80, record=True, force_terminal=False)
    console.print(final_table(summary))
    text = console.export_text()
    caption = " ".join(text.split())  # the caption wraps at the table's width
    lo, hi = wilson_interval(8, 32)
    assert f"25.0% [{100 * lo:.0f}-{100 * hi:.0f}%]" in text    # after RL's pass rate, on one line
    assert "100.0% [89-100%]" in text                           # after RL's edit rate
    p_value = f"p = {head['p_value']:.2g} (significant)"
    assert "16 improved / 0 worsened of 32 pairs" in caption and p_value in caption
    assert "zero reward variance: 75%" in caption and "2.20 GB" in caption  # 2100 MiB of PSS


def test_rl_task_evaluations_are_summarised_beside_the_held_out_ones(tmp_path: Path) -> None:
    """With `eval.rl_tasks`, RL's own training tasks get the held-out figures and paired tests
    (recomputed from their records, apart from the headline) and a line under the final table."""
    held_out = [(f"h{i}", p) for i in range(2) for p in range(2)]
    for name in ("eval-sft", "eval-after"):
        _write_eval(tmp_path / name, {k: (False, 0) for k in held_out})
    own = [(f"r{i}", p) for i in range(4) for p in range(2)]  # 8 attempts
    _write_eval(tmp_path / "eval-rl-tasks" / "after-sft", {k: (False, 1 if i < 2 else 0) for i, k in enumerate(own)})
    _write_eval(tmp_path / "eval-rl-tasks" / "after-rl", {k: (i == 7, 1 if i >= 1 else 0) for i, k in enumerate(own)})

    summary = build_summary(tmp_path, {}, measure="edit", alpha=0.05)

    head = summary["headline"]
    assert (head["improved"], head["worsened"], head["pairs"]) == (0, 0, 4)   # held out only
    rl_tasks = summary["rl_tasks"]
    assert not rl_tasks["pre_registered"] and set(rl_tasks["evaluations"]) == {"after_sft", "after_rl"}
    assert rl_tasks["evaluations"]["after_sft"]["edit"]["successes"] == 2
    assert rl_tasks["evaluations"]["after_rl"]["edit"]["successes"] == 7
    assert rl_tasks["evaluations"]["after_rl"]["pass_rate"] == 1 / 8
    edit = rl_tasks["tests"]["edit"]
    assert (edit["improved"], edit["worsened"], edit["pairs"]) == (6, 1, 8)
    assert edit["p_value"] == mcnemar_one_sided([(False, True)] * 6 + [(True, False)])["p_value"]
    assert (rl_tasks["tests"]["pass"]["improved"], rl_tasks["tests"]["pass"]["worsened"]) == (1, 0)

    console = Console(width=80, record=True, force_terminal=False)
    console.print(final_table(summary))
    caption = " ".join(console.export_text().split())
    assert f"on RL's own training tasks (edit, not held out): 2 -> 7 of 8, 6 improved / 1 worsened, " \
           f"p = {edit['p_value']:.2g}" in caption

    from atelier.eval.report import headline_section

    page = headline_section(summary)   # report.html: its own table and test under the held-out ones
    own_table = page[page.index('<table id="rl-tasks">'):]
    assert own_table.index("after SFT") < own_table.index("after RL") and "before training" not in own_table
    assert "<td>0.250 [0.07, 0.59]</td><td>0.875 [0.53, 0.98]</td>" in own_table   # edit: 2/8 -> 7/8
    assert "(headline)" not in own_table
    assert f"6 improved, 1 worsened, one-sided p = {edit['p_value']:.4f} (not pre-registered)" in own_table
    assert "rl-tasks" not in headline_section({**summary, "rl_tasks": {}})


def test_too_few_held_out_attempts_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text('[tasks]\npackage = "funcy"\nversion = "2.0"\ncount = 20\ntest_count = 4\n[eval]\npasses = 2\n')
    with pytest.raises(Exception, match="min_attempts"):
        load_config(RunConfig, path)
    assert load_config(RunConfig, path, ["headline.min_attempts=8"]).headline.min_attempts == 8


@pytest.mark.parametrize("name", ["demo.toml", "demo-gpu.toml"])
def test_demo_recipes_load_and_hold_enough_attempts(name: str) -> None:
    config = load_config(RunConfig, Path(__file__).resolve().parents[1] / "recipes" / name)
    assert config.tasks.split == "file" and config.isolate_stages
    assert config.tasks.test_count * config.eval.passes >= config.headline.min_attempts >= 32
