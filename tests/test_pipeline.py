"""`atelier run` end to end on a tiny recipe (a shrunken demo): a tiny model,
three mutation tasks from a small repository written here (three source
files, so the held-out task shares no file with the training ones), one SFT
step and one RL step, in real sandboxes, each stage in its own process;
summary.json checked against the evaluation records; then a rerun that
resumes and finds everything done."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from atelier.cli import main as cli
from atelier.config import load_config
from atelier.pipeline.config import RunConfig
from atelier.pipeline.record import RECORD_FILE, SCHEMA
from atelier.pipeline.runner import StageLedger, last_activity, run_pipeline
from atelier.pipeline.stages import BY_NAME, STAGE_NAMES, STAGES, Stage, StageContext, rl_tasks_off
from atelier.rundir import RunDirError, freeze_config

REPO = {
    "shapes/__init__.py": "",
    "shapes/calc.py": """
        def clamp(x, lo, hi):
            if x < lo:
                return lo
            if x > hi:
                return hi
            return x
    """,
    "shapes/stats.py": """
        def mean(values):
            total = 0
            for v in values:
                total += v
            return total / len(values)
    """,
    "shapes/text.py": """
        def shout(word, times):
            if times < 1:
                return ""
            return word.upper() * times
    """,
    "tests/test_calc.py": """
        from shapes.calc import clamp


        def test_clamp():
            assert clamp(5, 0, 10) == 5
            assert clamp(-5, 0, 10) == 0
            assert clamp(50, 0, 10) == 10
    """,
    "tests/test_stats.py": """
        from shapes.stats import mean


        def test_mean():
            assert mean([1, 2, 3, 6]) == 3
    """,
    "tests/test_text.py": """
        from shapes.text import shout


        def test_shout():
            assert shout("a", 3) == "AAA"
            assert shout("a", 0) == ""
    """,
}

RECIPE = """
seed = 0
threads = 1

[model]
name = "tiny"

[tasks]
package = "shapes"
version = ""
path = "shapes-repo"
count = 3
test_count = 1
timeout_s = 60
validate_runs = 1

[eval]
passes = 1
concurrency = 2
rl_tasks = true

[eval.agent]
max_turns = 2
max_tokens = 64
max_context_tokens = 4096

[eval.agent.sampling]
max_tokens = 16

[sft]
steps = 1
seq_len = 4096

[rl.rollout]
group_size = 2
groups_per_step = 1
workers = 2
max_tokens = 16
min_valid = 1

[rl.trainer]
steps = 1
lr = 1e-3

[headline]
measure = "edit"
min_attempts = 1
"""


@pytest.fixture
def recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    repo = tmp_path / "shapes-repo"
    for rel, text in REPO.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(textwrap.dedent(text).lstrip("\n"))
    path = tmp_path / "tiny.toml"
    path.write_text(RECIPE.replace('version = ""\n', ""))
    monkeypatch.setenv("ATELIER_CACHE", str(tmp_path / "cache"))
    return path


def _recount(run_dir: Path) -> tuple[int, int, int]:
    """(valid attempts, successes, edits) straight from results.jsonl: the last line per attempt."""
    last = {}
    for line in (run_dir / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        last[(row["task_id"], row["pass_index"])] = row
    valid = [r for r in last.values() if not r["infra_error"]]
    return (len(valid), sum(r["success"] for r in valid),
            sum(r["diff_lines"] > 0 and not r["grade_error"] for r in valid))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_atelier_run_end_to_end_then_resume(bwrap_ready, recipe: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", str(recipe), "--run-dir", str(out), "--json"])
    assert exit_info.value.code in (None, 0)
    printed = capsys.readouterr().out.strip().splitlines()
    assert Path(printed[-1]) == out / "report.html"
    stages = json.loads((out / "stages.json").read_text())
    assert list(stages) == list(STAGE_NAMES)
    assert stages["tasks"]["train"] == 2 and stages["tasks"]["test"] == 1
    assert stages["tasks"]["split"] == "file"
    for stage in ("eval-before", "eval-sft", "eval-after"):
        assert stages[stage]["attempts"] == 1
    assert stages["eval-rl-tasks"]["tasks"] == 2 and stages["eval-rl-tasks"]["attempts"] == 2
    assert stages["sft-data"]["kept"] == 2, "both gold replays should score 1"
    assert stages["sft"]["steps"] == 1
    assert stages["rl"]["steps"] == 1
    # The RL model is a new checkpoint, not the SFT model; each evaluation saw its own model.
    assert stages["rl"]["model"] != stages["sft"]["model"]
    assert stages["eval-sft"]["model"] == stages["sft"]["model"]
    assert stages["eval-after"]["model"] == stages["rl"]["model"]
    # Every stage ran in a child and its memory was measured (the whole tree: at least a Python with torch).
    assert all(50 < stages[s]["peak_pss_mb"] <= stages[s]["peak_rss_mb"] for s in STAGE_NAMES)
    assert (out / "logs" / "rl.log").is_file()

    summary = json.loads((out / "summary.json").read_text())
    for label, sub in (("before", "eval-before"), ("after_sft", "eval-sft"), ("after_rl", "eval-after")):
        figures = summary["evaluations"][label]
        valid, passed, edits = _recount(out / sub)
        assert figures["valid_attempts"] == valid
        assert figures["pass_rate"] == (passed / valid if valid else None)
        assert figures["edit"]["rate"] == (edits / valid if valid else None)
        assert set(figures) >= {"pass_rate_interval_95", "best_of_k", "mean_reward", "headline"}
    for label, sub in (("after_sft", "eval-rl-tasks/after-sft"), ("after_rl", "eval-rl-tasks/after-rl")):
        figures = summary["rl_tasks"]["evaluations"][label]
        valid, passed, edits = _recount(out / sub)
        assert valid == 2 and figures["valid_attempts"] == valid and figures["edit"]["successes"] == edits
    assert summary["rl_tasks"]["tests"]["edit"]["pairs"] == 2
    head = summary["headline"]
    assert head["measure"] == "edit" and head["pre_registered"] and 0 <= head["p_value"] <= 1
    assert set(head) >= {"test", "pairs", "improved", "worsened", "alpha", "significant"}
    assert summary["rl"]["steps"] == [1] and len(summary["rl"]["reward_mean"]) == 1
    assert summary["rl"]["zero_variance_fraction_all"] in (0.0, 1.0)
    assert set(summary["wall_s"]) == set(STAGE_NAMES) and summary["peak_pss_mb_run"] >= max(
        stages[s]["peak_pss_mb"] for s in STAGE_NAMES if s != "report")
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["evaluations"]["after_rl"]["edit"] == summary["evaluations"]["after_rl"]["edit"]
    assert record["headline"] == head and record["recipe"] == str(recipe)
    assert set(record["stages"]) == set(STAGE_NAMES) and record["stages"]["rl"]["load_start"] is not None
    html = (out / "report.html").read_text()
    # the models named by what they are, not by their directories (final, model)
    assert "a tiny random model after SFT" in html and "a tiny random model after RL" in html
    assert 'id="headline"' in html and "after SFT" in html
    # Held-out means held out: no test task was replayed for SFT or trained by RL.
    index = (out / "tasks" / "index.toml").read_text()
    test_ids = {line.split('"')[1] for line in index.splitlines() if line.strip().endswith('"test"')}
    assert test_ids and not any((out / "sft-data" / "trajectories" / t).exists() for t in test_ids)
    rollouts = json.dumps([p.read_text() for p in (out / "rl").rglob("ledger.jsonl")])
    assert not any(t in rollouts for t in test_ids)

    # A rerun resumes: every stage is already done, nothing runs again.
    config = load_config(RunConfig, recipe)
    said: list[str] = []
    run_pipeline(config, out, recipe_dir=recipe.parent, say=said.append)
    assert all("done earlier" in line for line in said) and len(said) == len(STAGES)

    # A different recipe in the same directory is refused, not mixed in.
    other = load_config(RunConfig, recipe, ["rl.trainer.steps=2"])
    with pytest.raises(RunDirError, match=r"different config \(rl.trainer.steps differ"):
        run_pipeline(other, out, recipe_dir=recipe.parent, say=said.append)


def test_bad_recipe_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[tasks]\npackage = \"inflection\"\nversion = \"0.5.1\"\ncount = 3\ntest_count = 5\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", str(path), "--run-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "test_count" in err and "Traceback" not in err


def test_a_run_begun_before_a_field_existed_resumes_and_a_changed_recipe_is_refused(recipe: Path,
                                                                                     tmp_path: Path) -> None:
    """The frozen config.toml of a run begun by an earlier version lacks the fields added since:
    at their defaults it is the same recipe. A changed value, or a key this version does not know,
    is another recipe."""
    import tomli_w

    from atelier.compat import tomllib
    from atelier.config import dump_config

    config = load_config(RunConfig, recipe, ["eval.rl_tasks=false"])
    frozen = tomllib.loads(dump_config(config))
    del frozen["eval"]["rl_tasks"]                       # as a run begun before eval.rl_tasks wrote it
    (tmp_path / "config.toml").write_text(tomli_w.dumps(frozen))
    assert freeze_config(config, tmp_path)
    assert "rl_tasks = false" in (tmp_path / "config.toml").read_text()
    with pytest.raises(RunDirError, match=r"different config \(eval.rl_tasks differ"):
        freeze_config(load_config(RunConfig, recipe, ["eval.rl_tasks=true"]), tmp_path)
    frozen["eval"]["no_such_option"] = 1
    (tmp_path / "config.toml").write_text(tomli_w.dumps(frozen))
    with pytest.raises(RunDirError, match="different config"):
        freeze_config(config, tmp_path)


def test_a_resumed_stage_counts_the_time_of_every_start(tmp_path: Path) -> None:
    ledger = StageLedger(tmp_path)
    ledger.begin("sft", 1000.0, None)
    peaks = {"peak_pss_mb": 500, "peak_rss_mb": 600}
    assert ledger.end("sft", 1100.0, peaks) == (100.0, 100.0, peaks)   # failed after 100 s
    ledger.begin("sft", 2000.0, None)                                # then killed: never ends
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "step.txt").write_text("x")
    os.utime(tmp_path / "sft" / "step.txt", (2300.0, 2300.0))
    os.utime(tmp_path / "sft", (2250.0, 2250.0))
    assert last_activity(tmp_path, "sft") == 2300.0
    reopened = StageLedger(tmp_path)                                    # a new process resumes
    reopened.begin("sft", 5000.0, last_activity(tmp_path, "sft"))   # the killed start ran until 2300
    # each measure's peak is the highest of any start
    assert reopened.end("sft", 5050.0, {"peak_pss_mb": 300, "peak_rss_mb": 900}) == (
        450.0, 50.0, {"peak_pss_mb": 500, "peak_rss_mb": 900})
    saved = json.loads((tmp_path / "stages-time.json").read_text())["sft"]
    assert saved["starts"] == 3 and "started" not in saved
    assert (saved["peak_pss_mb"], saved["peak_rss_mb"]) == (500, 900)


def test_eval_rl_tasks_is_off_unless_the_recipe_asks(recipe: Path, tmp_path: Path) -> None:
    """Off, the stage only records why, in the parent (no child process started for nothing)."""
    for value, reason in (("false", "eval.rl_tasks is off"), ("true", None)):
        config = load_config(RunConfig, recipe, [f"eval.rl_tasks={value}"])
        assert rl_tasks_off(config) == reason and BY_NAME["eval-rl-tasks"].off(config) == reason
        assert all(stage.off(config) is None for stage in STAGES if stage.name != "eval-rl-tasks")
    off = StageContext(load_config(RunConfig, recipe, ["eval.rl_tasks=false"]), tmp_path, recipe.parent, print,
                       StageLedger(tmp_path))
    assert off.run(BY_NAME["eval-rl-tasks"]) == {"skipped": "eval.rl_tasks is off"}


def test_summary_keys_when_the_report_stage_has_not_run(tmp_path: Path) -> None:
    """A summary over a run with no evaluation after RL has no headline test, and says so in the report."""
    from atelier.eval.report import headline_section
    from atelier.pipeline.summary import build_summary

    summary = build_summary(tmp_path, {}, measure="pass", alpha=0.05)
    assert summary["evaluations"] == {} and "p_value" not in summary["headline"]
    assert "No headline test" in headline_section(summary)


def test_every_rl_option_of_atelier_train_is_an_rl_option_of_atelier_run(tmp_path: Path) -> None:
    """[rl] is `atelier train`'s config less what the pipeline fills in, and reaches the RL stage whole."""
    from atelier.config import load_config
    from atelier.pipeline.config import RlStage, RunConfig
    from atelier.pipeline.stages import rl_train_config
    from atelier.rl.config import EnvConfig, TrainConfig

    # model, seed, env: the SFT stage's model, the run's seed, the train split; inference: the run's own.
    assert set(TrainConfig.model_fields) - set(RlStage.model_fields) <= {"model", "seed", "env", "inference"}
    path = tmp_path / "r.toml"
    path.write_text(RECIPE.replace('version = ""\n', ""))
    config = load_config(RunConfig, path, ["rl.loggers=[tensorboard]", "rl.rollout.retry_backoff_s=0.5",
                                           "rl.curriculum.window=3", "seed=7"])
    train = rl_train_config(config, model="m", env=EnvConfig())
    assert train.loggers == ["tensorboard"] and train.rollout.retry_backoff_s == 0.5
    assert train.curriculum.window == 3 and train.trainer.steps == 1 and train.seed == 7



def test_every_sft_option_reaches_the_sft_phase(tmp_path: Path) -> None:
    """[sft] reaches `atelier pretrain`'s config whole, precision included (bf16 halves its time here)."""
    from atelier.pipeline.config import SftStage
    from atelier.pipeline.stages import sft_pretrain_config

    path = tmp_path / "r.toml"
    path.write_text(RECIPE.replace('version = ""\n', ""))
    config = load_config(RunConfig, path, ["sft.precision=bf16", "sft.steps=5", "sft.lr=3e-5", "sft.grad_accum=2",
                                           "sft.micro_batch=2", "sft.seq_len=512", "sft.warmup_steps=0", "seed=3"])
    cfg = sft_pretrain_config(config, model="m", trajectories="t")
    phase = cfg.phases[0]
    assert cfg.precision == "bf16" and cfg.seed == 3 and cfg.model == "m" and phase.trajectories == ["t"]
    assert (phase.steps, phase.lr, phase.grad_accum, phase.micro_batch, phase.seq_len, phase.warmup_steps) == \
        (5, 3e-5, 2, 2, 512, 0)
    # enabled, replay and tasks belong to the sft-data stage (which gold replays, how), not to the phase.
    assert set(SftStage.model_fields) - {"enabled", "replay", "tasks"} <= set(type(phase).model_fields) | {"precision"}


def test_a_finished_run_writes_its_record_and_a_rerun_leaves_it(recipe: Path, tmp_path: Path) -> None:
    """run.json: the stages' cost and load, the summary's figures, the code and the machine."""
    import hashlib

    summary = {"evaluations": {"after_sft": {"attempts": 4, "valid_attempts": 4, "tasks": 2, "mean_reward": 0.5,
                                             "pass": {"successes": 1, "rate": 0.25}, "edit": {"successes": 2},
                                             "pass_rate": 0.25}},
               "headline": {"measure": "edit", "improved": 2, "worsened": 0, "p_value": 0.25},
               "peak_pss_mb_run": 700, "peak_rss_mb_run": 900, "rl": {"groups": 3}}

    def report(ctx: StageContext) -> dict:
        (ctx.run_dir / "summary.json").write_text(json.dumps(summary))
        return {"path": "report.html"}

    stages = [Stage("work", lambda ctx: {"made": 1}, in_process=True), Stage("report", report, in_process=True)]
    config = load_config(RunConfig, recipe, ["seed=3"])
    out = tmp_path / "run"
    run_pipeline(config, out, recipe_dir=recipe.parent, say=lambda line: None, stages=stages, recipe="x.toml")
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["schema"] == SCHEMA and record["seed"] == 3 and record["recipe"] == "x.toml"
    assert record["config_sha256"] == hashlib.sha256((out / "config.toml").read_bytes()).hexdigest()
    assert set(record["stages"]) == {"work", "report"}
    assert set(record["stages"]["work"]) >= {"wall_s", "starts", "load_start", "load_end"}
    assert "made" not in record["stages"]["work"]          # a stage's own outputs stay in stages.json
    assert record["evaluations"]["after_sft"]["edit"] == {"successes": 2}
    assert "pass_rate" not in record["evaluations"]["after_sft"]   # the per-measure figures only
    assert record["headline"] == summary["headline"] and record["peak_pss_mb"] == 700
    assert record["rl"]["groups"] == 3 and record["host"]["cores"] == os.cpu_count()
    assert record["commit"] is None or len(record["commit"].split("+")[0]) == 40
    (out / RECORD_FILE).write_text('{"kept": true}')
    run_pipeline(config, out, recipe_dir=recipe.parent, say=lambda line: None, stages=stages)
    assert json.loads((out / RECORD_FILE).read_text()) == {"kept": True}   # nothing ran: not rewritten
