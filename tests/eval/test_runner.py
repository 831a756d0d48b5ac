"""`run_eval` and `atelier eval` through real bubblewrap sandboxes and the real
agent loop, driven by scripted models: gold replay scores 1, an empty
submission 0, infrastructure errors are counted apart and retried, and a run
resumes (also after a kill)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from atelier.cli import main as cli
from atelier.eval.models import ScriptedPolicy, empty_texts, gold_texts, open_eval_model
from atelier.eval.records import EvalError, read_records
from atelier.eval.report import build_report
from atelier.eval.runner import EvalConfig, run_eval
from atelier.eval.tasks import load_tasks
from atelier.harness.trajectory import Trajectory
from tests.helpers import wait_until


def config(env_cache: str, **kw) -> EvalConfig:
    return EvalConfig(env_cache=env_cache, **kw)


def test_gold_replay_scores_one_empty_scores_zero_and_runs_resume(suite: Path, tmp_path: Path,
                                                                  env_cache: str) -> None:
    tasks = load_tasks(suite)
    policy = open_eval_model("scripted:gold")
    first = run_eval(policy, tasks, tmp_path / "gold", config=config(env_cache, passes=1, concurrency=2))
    assert (first.ran, first.skipped) == (2, 0)
    # A second pass: the finished first pass is skipped, only pass 1 runs.
    gold = run_eval(policy, tasks, tmp_path / "gold", config=config(env_cache, passes=2, concurrency=2))
    m = gold.metrics
    assert (gold.ran, gold.skipped, m.tasks, m.valid_attempts, m.infra_errors) == (2, 2, 2, 4, 0)
    assert m.accuracy == 1.0 and m.pass_at_k == {1: 1.0, 2: 1.0} and m.best_of_k == 1.0
    assert m.mean_tool_calls >= 3 and m.broken_calls == 0 and m.median_cost == 0.0
    assert m.exit_reasons == {"submitted": 4}
    for rec in read_records(tmp_path / "gold"):
        assert rec.reward_parts == {"fail_to_pass": 1.0, "pass_to_pass": 1.0}
        traj = Trajectory.load(tmp_path / "gold" / rec.trajectory)
        assert traj.reward == 1.0 and "return a" in traj.final_diff and traj.tool_calls
        assert rec.tokens["completion"] > 0 and rec.wall_s >= rec.episode_s > 0
    summary = json.loads((tmp_path / "gold" / "summary.json").read_text())
    assert summary["accuracy"] == 1.0 and summary["pass_at_k"] == {"1": 1.0, "2": 1.0}
    page = build_report([tmp_path / "gold"], tmp_path / "report.html").read_text()
    assert "scripted:gold" in page and "calc-mul" in page and page.count('class="traj"') == 4
    done = run_eval(policy, tasks, tmp_path / "gold", config=config(env_cache, passes=2))
    assert (done.ran, done.skipped) == (0, 4)
    assert len((tmp_path / "gold" / "results.jsonl").read_text().splitlines()) == 4
    with pytest.raises(EvalError, match="scripted:gold"):  # a run directory holds one model
        run_eval(open_eval_model("scripted:empty"), tasks, tmp_path / "gold", config=config(env_cache))

    empty = run_eval(open_eval_model("scripted:empty"), tasks[:1], tmp_path / "empty",
                     config=config(env_cache, passes=1))
    assert empty.metrics.accuracy == 0.0 and empty.metrics.infra_errors == 0
    assert all(r.reward == 0.0 and r.reward_parts["fail_to_pass"] == 0.0 and r.diff_lines == 0
               for r in read_records(tmp_path / "empty"))


class Flaky(ScriptedPolicy):
    """The model server is down for the first `failures` attempts of a task."""

    def __init__(self, failures: int) -> None:
        super().__init__("scripted:flaky", empty_texts)
        self.failures: dict[str, int] = {}
        self.limit = failures

    def for_task(self, task):
        n = self.failures.get(task.id, 0)
        self.failures[task.id] = n + 1
        if n < self.limit:
            return Down()
        return super().for_task(task)


class Down:
    name = "scripted:flaky"

    def chat(self, messages, params, tools=None):
        raise ConnectionError("connection refused")


def test_infra_errors_are_counted_apart_retried_and_resumed(suite: Path, tmp_path: Path, env_cache: str) -> None:
    task = load_tasks(suite / "calc-add")
    out = tmp_path / "run"
    first = run_eval(Flaky(failures=2), task, out, config=config(env_cache, infra_retries=1, retry_backoff_s=0.01))
    m = first.metrics
    assert (m.infra_errors, m.infra_error_attempts, m.valid_attempts) == (1, 2, 0)
    assert m.accuracy is None and m.infra_error_types == {"ConnectionError": 1}
    rec = read_records(out)[0]
    assert rec.infra_error and rec.reward is None and "connection refused" in rec.error
    traj = Trajectory.load(out / rec.trajectory)  # saved despite the failure
    assert traj.exit_reason == "error" and "ConnectionError" in traj.error
    # Resuming runs the failed attempt again; now the server answers.
    again = run_eval(Flaky(failures=0), task, out, config=config(env_cache))
    assert (again.ran, again.skipped) == (1, 0)
    assert again.metrics.infra_errors == 0 and again.metrics.accuracy == 0.0
    assert again.metrics.infra_error_attempts == 2


class Buggy(ScriptedPolicy):
    """A policy with a plain bug: not an outage, so the evaluation stops at once."""

    def for_task(self, task):
        raise KeyError("a plain bug")


def test_a_bug_stops_the_evaluation_names_the_attempt_and_a_rerun_finishes_it(
        suite: Path, tmp_path: Path, env_cache: str) -> None:
    from atelier.errors import BugError

    task = load_tasks(suite / "calc-add")
    out = tmp_path / "run"
    with pytest.raises(BugError, match=r"attempt calc-add pass 0 failed with a bug.*KeyError") as info:
        run_eval(Buggy("scripted:empty", empty_texts), task, out, config=config(env_cache, infra_retries=3))
    assert "failures.log" in info.value.hint
    assert read_records(out) == []                       # not recorded, not retried, not scored
    assert "Traceback (most recent call last)" in (out / "failures.log").read_text()
    again = run_eval(ScriptedPolicy("scripted:empty", empty_texts), task, out, config=config(env_cache))
    assert (again.ran, again.skipped, again.metrics.valid_attempts) == (1, 0, 1)


def test_a_killed_cli_run_resumes(suite: Path, tmp_path: Path, env_cache: str,
                                  monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Kill `atelier eval` after its first finished attempt, cut a line in half
    as a kill mid-write would, and resume with the same command."""
    cache_root = Path(env_cache).parent / "cache"
    os.makedirs(cache_root, exist_ok=True)
    if not (cache_root / "envs").exists():
        (cache_root / "envs").symlink_to(env_cache)
    out = tmp_path / "run"
    argv = ["eval", "--model", "scripted:gold", "--tasks", str(suite / "calc-add"), "--passes", "2",
            "--run-dir", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "atelier.cli", *argv], start_new_session=True,
                            env={**os.environ, "ATELIER_CACHE": str(cache_root)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    results = out / "results.jsonl"
    assert wait_until(lambda: results.is_file() and results.read_text().count("\n") >= 1, 240, interval=0.05,
                      process=proc), "no attempt finished"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    finished = {tuple(json.loads(line)[k] for k in ("task_id", "pass_index"))
                for line in results.read_text().splitlines()}
    assert len(finished) == 1
    with open(results, "a") as fh:
        fh.write('{"task_id": "calc-add", "pass_index": 1, "rew')  # cut short

    monkeypatch.setenv("ATELIER_CACHE", str(cache_root))
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--json"])
    assert info.value.code == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["skipped"], report["ran"]) == (1, 1)
    assert report["accuracy"] == 1.0 and report["valid_attempts"] == 2
    assert len(read_records(out, latest=False)) == 2  # no attempt recorded twice
    lines = results.read_text().splitlines()
    assert len(lines) == 3 and lines[1].endswith('"rew')  # the cut line stayed alone


def test_token_model_path_and_billed_tokens(suite: Path, tmp_path: Path, env_cache: str,
                                            tiny_model_dir) -> None:
    """A TokenModel (ScriptedModel over a real tokenizer) replaying gold: the
    harness's token path; tokens in are every prompt the model was sent."""
    from atelier.inference.scripted import ScriptedModel

    models = []

    class TokenGold:
        name = "scripted:token-gold"

        def for_task(self, task):
            models.append(ScriptedModel(str(tiny_model_dir), gold_texts(task), name=self.name))
            return models[-1]

    run = run_eval(TokenGold(), load_tasks(suite / "calc-mul"), tmp_path / "run", config=config(env_cache))
    rec = read_records(tmp_path / "run")[0]
    assert rec.reward == 1.0, rec
    assert rec.tokens_in == sum(len(p) for p in models[0].prompts)
    assert rec.tokens_out == sum(len(o) for o in models[0].outputs) == rec.tokens["completion"]
    assert run.metrics.accuracy == 1.0


def test_bad_inputs_are_typed_errors(tmp_path: Path, suite: Path, capsys) -> None:
    def fails(*argv: str) -> str:
        with pytest.raises(SystemExit) as info:
            cli.main(list(argv))
        assert info.value.code == 2
        return capsys.readouterr().err

    out = str(tmp_path / "run")
    assert "not found" in fails("eval", "--model", "scripted:gold", "--tasks", str(tmp_path / "nope"), "--run-dir", out)
    err = fails("eval", "--model", "no-such-model", "--tasks", str(suite), "--run-dir", out)
    assert "error:" in err and "hint:" in err
    assert "unknown scripted model" in fails("eval", "--model", "scripted:nope", "--tasks", str(suite),
                                             "--run-dir", out)
    assert "split 'test'" in fails("eval", "--model", "scripted:gold", "--tasks", str(suite),
                                "--split", "test", "--run-dir", out)
    assert "run directory not found" in fails("report", str(tmp_path / "missing"), "--out", str(tmp_path / "r.html"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cli_with_a_local_model_directory(suite: Path, tmp_path: Path, env_cache: str, tiny_model_dir,
                                          monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A real (tiny, random) model through open_model and the local engine:
    its babble solves nothing, but every attempt is valid and measured."""
    cache_root = tmp_path / "cache"
    cache_root.mkdir()
    (cache_root / "envs").symlink_to(env_cache)
    monkeypatch.setenv("ATELIER_CACHE", str(cache_root))
    with pytest.raises(SystemExit) as info:
        cli.main(["eval", "--model", str(tiny_model_dir), "--tasks", str(suite / "calc-add"),
                  "--run-dir", str(tmp_path / "run"), "--max-turns", "2", "--set", "agent.sampling.max_tokens=8",
                  "--set", "agent.sampling.seed=0", "--json"])
    assert info.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid_attempts"] == 1 and out["infra_errors"] == 0 and out["accuracy"] == 0.0
    assert out["tokens"]["completion"] > 0 and out["median_cost"] is None  # no price for this model
    assert out["exit_reasons"] in ({"max_turns": 1}, {"max_tokens": 1})
