"""The HTML report: built from run directories written here (records and
trajectories by hand, a training log), rendered in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from atelier.eval.plots import flatten_training_row, pareto_front, training_families
from atelier.eval.records import EvalError, EvalRecord, ResultsWriter, trajectory_path, write_json
from atelier.eval.report import build_report, discover_runs
from atelier.harness.trajectory import ToolCallRecord, Trajectory

EVIL = "<script>document.title='pwned'</script><img src=x onerror=alert(1)>"


def write_run(run_dir: Path, model: str, rewards: dict[str, list[float]], cost: float) -> Path:
    run_dir.mkdir(parents=True)
    write_json(run_dir / "eval.json", {"model": model, "passes": 2, "tasks": list(rewards)})
    writer = ResultsWriter(run_dir)
    for task, rs in rewards.items():
        for i, reward in enumerate(rs):
            rel = trajectory_path(task, i)
            traj = Trajectory(
                task_id=task, model=model, turns=2, reward=reward, exit_reason="submitted",
                messages=[{"role": "system", "content": "tools: ..."},
                          {"role": "user", "content": f"fix it {EVIL}"},
                          {"role": "assistant", "content": "looking " + EVIL},
                          {"role": "tool", "content": "calc/ops.py:2: return a - b"},
                          {"role": "assistant", "content": "done"}],
                tool_calls=[ToolCallRecord(turn=1, name="grep", arguments={"pattern": EVIL},
                                           output="OUT-" + EVIL, ok=True),
                            ToolCallRecord(turn=2, name="bogus", arguments={}, output="unknown tool",
                                           ok=False, broken=True)],
                tokens={"prompt": 100, "completion": 20},
                final_diff="--- a/calc/ops.py\n+++ b/calc/ops.py\n@@ -1 +1 @@\n-    return a - b\n"
                           "+    return a + b  # " + EVIL + "\n")
            traj.save(run_dir / rel)
            writer.append(EvalRecord(task_id=task, pass_index=i, model=model, reward=reward,
                                     success=reward == 1.0, cost=cost, wall_s=3.0, turns=2,
                                     tool_calls=2, broken_calls=1, tokens=traj.tokens,
                                     tokens_in=100, tokens_out=20, trajectory=rel))
    return run_dir


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    before = write_run(tmp_path / "train" / "eval-before", "smol<b>", {"t1": [0.0, 0.0], "t<2>": [1.0, 0.0]}, 0.01)
    after = write_run(tmp_path / "train" / "eval-after", "smol<b>", {"t1": [1.0, 0.0], "t<2>": [1.0, 1.0]}, 0.02)
    with open(tmp_path / "train" / "metrics.jsonl", "w") as fh:
        for step in range(5):
            # the shape atelier.rl writes; missing and unknown keys are fine
            fh.write(json.dumps({"step": step, "reward_mean": step / 4, "reward_parts": {"correct": 0.5},
                                 "pass_rate": step / 5, "kl_k1": 0.01 * step, "loss": 1.0 / (step + 1),
                                 "staleness_hist": {"0": 3, "1": 1}, "staleness_max": 1,
                                 "gen_tokens_per_s": 100 + step, "ledger": {"trained": step},
                                 "mode": "async"}) + "\n")
        fh.write('{"step": 5, "reward_mean": 1.0, "kl": 0.0\n')  # a line cut short by a kill
    # the RL ledger sorts first and has steps too, but is not the training curve
    (tmp_path / "train" / "ledger.jsonl").write_text('{"step": 0, "slot": "a", "state": "queued"}\n')
    assert before.parent == after.parent
    return [tmp_path / "train"]


def test_pareto_front_and_training_keys() -> None:
    assert pareto_front([(1.0, 0.5), (2.0, 0.4), (3.0, 0.9), (0.5, 0.1)]) == [3, 0, 2]
    fams = training_families([{"step": 1, "reward_mean": 0.1, "kl": 0.2, "policy_loss": 1.0, "note": "x"}])
    assert fams == {"reward": ["reward_mean"], "KL": ["kl"], "loss": ["policy_loss"]}
    row = flatten_training_row({"step": 2, "reward_parts": {"correct": 1.0}, "ledger": {"trained": 4},
                                "staleness_hist": {"0": 3, "2": 1}})
    assert row == {"step": 2, "reward_parts.correct": 1.0, "staleness_mean": 0.5}



def test_reward_panel_holds_the_reward_terms_only() -> None:
    """RL's reward_parts as the metrics log writes them: the terms, their total,
    grading fractions and a raw length of hundreds that would flatten the panel."""
    rows = [flatten_training_row({"step": s, "reward_mean": r, "reward_parts": {
        "correctness": c, "edit": e, "length": 0.0, "total": r, "length_x": 345.2, "tamper_suspect_flag": 0.0,
        "pass": c, "fail_to_pass": c, "pass_to_pass": 0.75}, "pass_rate": c})
        for s, r, c, e in [(1, 0.5625, 0.375, 0.1875), (2, 0.0, 0.0, 0.0)]]
    fams = training_families(rows)
    assert fams["reward"] == ["reward_mean", "reward_parts.correctness", "reward_parts.edit"]
    assert fams["pass rate"] == ["reward_parts.pass", "reward_parts.fail_to_pass", "reward_parts.pass_to_pass",
                                 "pass_rate"]
    assert not any("length" in k or "flag" in k or "total" in k for keys in fams.values() for k in keys)


def test_discover_a_training_run_with_eval_subdirs(runs: list[Path]) -> None:
    found = discover_runs(runs[0])
    assert [r.label for r in found] == ["train (training)", "train/eval-after", "train/eval-before"]
    assert len(found[0].training) == 5 and found[0].training_file == "metrics.jsonl"
    after = found[1].metrics
    assert after.accuracy == pytest.approx(0.75) and after.pass_at_k[2] == pytest.approx(1.0)


def test_report_escapes_everything(runs: list[Path], tmp_path: Path) -> None:
    page = build_report(runs, tmp_path / "out" / "report.html").read_text()
    assert "<script>document.title" not in page and "<img src=x" not in page
    assert "&lt;script&gt;document.title" in page
    assert "smol&lt;b&gt;" in page and "t&lt;2&gt;" in page
    assert page.count("data:image/png;base64,") == 3  # pass@k, Pareto, training
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from elsewhere


def test_names_say_what_each_model_is(tmp_path: Path) -> None:
    """A run's label and model column come from `names` when given (atelier run names the base
    model, after SFT, after RL), not from the directory the model was saved in."""
    before = write_run(tmp_path / "run" / "eval-before", "smollm2-135m", {"t1": [0.0]}, 0.0)
    after = write_run(tmp_path / "run" / "eval-after", "model", {"t1": [1.0]}, 0.0)
    plain = build_report([before, after], tmp_path / "plain.html").read_text()
    assert "<td>model</td>" in plain
    page = build_report([before, after], tmp_path / "named.html",
                        names={str(before): "SmolLM2-135M-Instruct", str(after): "SmolLM2-135M-Instruct after RL"})
    summary = page.read_text().split('<table id="summary">')[1].split("</table>")[0]
    assert summary.count("<td>SmolLM2-135M-Instruct after RL</td>") == 2     # the run and its model
    assert "<td>model</td>" not in summary and "eval-after" not in summary


def test_bad_run_dirs_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="not found"):
        build_report([tmp_path / "nope"], tmp_path / "r.html")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvalError, match="no evaluation results"):
        build_report([tmp_path / "empty"], tmp_path / "r.html")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no headless Chromium on PATH (Debian package `chromium`)")


def render(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=5000", *extra,
            page.resolve().as_uri()]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_report_renders_in_headless_chromium(runs: list[Path], tmp_path: Path) -> None:
    page = build_report(runs, tmp_path / "report.html")
    proc = render(page, tmp_path / "profile", "--dump-dom")
    dom = proc.stdout
    assert "<body" in dom, proc.stderr[-2000:]
    # The JS ran: the viewer shows the first trajectory and hides the others.
    assert 'data-shown="traj-0"' in dom
    shown = re.findall(r'<div class="traj" id="(traj-\d+)"[^>]*style="display: (\w+);"', dom)
    assert len(shown) == 8 and [s for s in shown if s[1] == "block"] == [("traj-0", "block")]
    # Plots decoded as images, the title untouched by the trajectories' scripts.
    assert dom.count("data:image/png;base64,") == 3
    assert "<title>atelier report</title>" in dom and "pwned" not in dom.split("<body")[0]
    assert "tool <b>grep</b>" in dom and 'class="diff"' in dom
    shot = tmp_path / "shot.png"  # and it paints
    proc = render(page, tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1200,2000")
    assert shot.is_file() and shot.stat().st_size > 10_000, proc.stderr[-2000:]
