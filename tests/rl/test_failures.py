"""The failure taxonomy in a real run (`atelier.failures`): a bug in an
environment stops `atelier train` at once with a message naming the slot and
the task, and the run resumes with nothing lost once it is fixed; a sandbox
that cannot start is retried after a backoff and never scored; both are
logged and counted in metrics.jsonl."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from atelier.cli import main as cli
from atelier.errors import InfraError
from atelier.failures import backoff_s, classify, is_infra
from atelier.rl.ledger import Ledger

ENVS = textwrap.dedent('''
    import threading
    from pathlib import Path

    from atelier.rl.config import ToyEnvConfig
    from atelier.rl.env import ToyEnvironment


    class BuggyEnv(ToyEnvironment):
        """The toy task, with a plain bug on one task until the file `fixed` exists."""

        def __init__(self, cfg, rollout, shaping, seed, fixed):
            super().__init__(cfg, rollout, shaping, seed)
            self.fixed = Path(fixed)

        def rollout(self, task, model, seed):
            if task.id == "toy-00001" and not self.fixed.exists():
                return {}["no such key"]            # a plain bug, as a user's code would have
            return super().rollout(task, model, seed)


    class NoSandboxFirstEnv(ToyEnvironment):
        """The first rollout of each task asks for a sandbox over a snapshot that is not there."""

        def __init__(self, cfg, rollout, shaping, seed, root):
            super().__init__(cfg, rollout, shaping, seed)
            self.root, self.seen, self.lock = Path(root), set(), threading.Lock()

        def rollout(self, task, model, seed):
            from atelier.sandbox import SandboxConfig, create_sandbox

            with self.lock:
                first = task.id not in self.seen
                self.seen.add(task.id)
            if first:
                with create_sandbox(self.root / "missing-snapshot", SandboxConfig(backend="local")):
                    pass
            return super().rollout(task, model, seed)


    def buggy(rollout, shaping, seed, fixed, tasks=3):
        return BuggyEnv(ToyEnvConfig(tasks=tasks), rollout, shaping, seed, fixed)


    def no_sandbox_first(rollout, shaping, seed, root, tasks=3):
        return NoSandboxFirstEnv(ToyEnvConfig(tasks=tasks), rollout, shaping, seed, root)
''')


def _recipe(tmp_path: Path, model: Path, factory: str, args: str, steps: int = 3) -> Path:
    (tmp_path / "user_envs.py").write_text(ENVS)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(textwrap.dedent(f'''
        model = "{model}"
        [rollout]
        group_size = 2
        groups_per_step = 1
        workers = 2
        max_tokens = 4
        retry_backoff_s = 0.05
        [trainer]
        steps = {steps}
        norm_tokens = 32
        [env]
        kind = "python"
        [env.python]
        factory = "{tmp_path / 'user_envs.py'}:{factory}"
        args = {{ {args} }}
    '''))
    return recipe


def _atelier(capsys, *argv: str) -> tuple[int, str]:
    """`atelier ARGV` in this process, as the console script runs it: (exit status, all output)."""
    with pytest.raises(SystemExit) as info:
        cli.main(list(argv))
    out = capsys.readouterr()
    return info.value.code or 0, out.out + out.err


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def test_a_bug_stops_the_run_names_the_slot_and_resumes_with_nothing_lost(tiny_model_dir, tmp_path, capsys):
    fixed = tmp_path / "fixed"
    recipe = _recipe(tmp_path, tiny_model_dir, "buggy", f'fixed = "{fixed}"')
    run = tmp_path / "run"
    code, output = _atelier(capsys, "train", str(recipe), "--run-dir", str(run), "--quiet")
    assert code == 1, output
    assert "Traceback" not in output                       # the message, not a traceback, on the console
    assert "failed with a bug" in output and "of task toy-00001" in output
    assert "KeyError" in output and f"--run-dir {run}" in output
    buggy = [s for s in Ledger.load(run / "ledger.jsonl").slots.values() if s.task_id == "toy-00001"]
    assert buggy and any(s.slot_id in output for s in buggy)     # the slot is named
    # Neither dropped nor trained: queued again (or still running when the run stopped), same attempt.
    assert all(s.state in ("queued", "running") and s.attempt == 0 for s in buggy)
    assert any(f.startswith("bug: KeyError") for s in buggy for f in s.failures)
    log = (run / "failures.log").read_text()
    assert "bug g" in log and "Traceback (most recent call last)" in log and "no such key" in log

    fixed.touch()                                          # the user fixes the bug
    code, output = _atelier(capsys, "train", "--run-dir", str(run), "--quiet")   # continues, as the hint says
    assert code == 0, output
    ledger = Ledger.load(run / "ledger.jsonl")
    counts = ledger.counts()
    assert counts["trained"] == 3 * 2 and counts["dropped"] == 0      # every sample trained, none lost
    assert {g.task_id for g in ledger.groups.values()} == {"toy-00000", "toy-00001", "toy-00002"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r["failures"]["bug"] for r in rows) >= 1          # the step that trained it says so
    assert all(r["failures"]["infra"] == 0 and r["rollout_failures"] == 0 for r in rows)


def test_a_sandbox_that_cannot_start_is_retried_and_never_scored(tiny_model_dir, tmp_path, capsys):
    recipe = _recipe(tmp_path, tiny_model_dir, "no_sandbox_first", f'root = "{tmp_path}"')
    run = tmp_path / "run"
    code, output = _atelier(capsys, "train", str(recipe), "--run-dir", str(run), "--quiet")
    assert code == 0, output
    ledger = Ledger.load(run / "ledger.jsonl")
    assert ledger.counts()["trained"] == 3 * 2 and ledger.counts()["dropped"] == 0
    retried = [s for s in ledger.slots.values() if s.failures]
    assert len(retried) == 3                               # one per task: its first rollout
    assert all(s.attempt == 1 and s.failures[0].startswith("infra: SnapshotMissing") for s in retried)
    # Never scored: each slot was graded once, by the attempt that ran.
    graded = [e for e in _events(run) if e.get("state") == "graded"]
    assert len(graded) == 3 * 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["failures"]["infra"] for r in rows) == 3
    assert sum(r["infra_types"].get("SnapshotMissing", 0) for r in rows) == 3
    assert all(r["failures"]["bug"] == 0 for r in rows)
    assert (run / "failures.log").read_text().count(" infra ") == 3


def test_a_killed_engine_is_infrastructure(tiny_model_dir):
    from atelier.inference.engine import EngineClosed, LocalEngine
    from atelier.inference.types import SamplingParams

    engine = LocalEngine(tiny_model_dir)
    engine.close()
    with pytest.raises(EngineClosed) as info:
        engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
    assert is_infra(info.value) and classify(info.value) == "infra"


def test_the_taxonomy_table():
    import errno

    from atelier.harness.errors import FormatError
    from atelier.inference.client import ServerError, ServerUnreachable
    from atelier.sandbox import SandboxError
    from atelier.sandbox.base import SandboxClosed, SandboxPathError

    infra = [InfraError("x"), SandboxClosed("died"), SandboxError("could not start"), ConnectionError("refused"),
             TimeoutError("slow"), MemoryError(), OSError(errno.ENOSPC, "disk full"),
             ServerUnreachable("down")]
    bugs = [KeyError("k"), ValueError("v"), TypeError("t"), SandboxPathError("outside"), ServerError("400"),
            OSError(errno.ENOENT, "no file"), FormatError("a malformed call escaping the loop is a bug")]
    assert [classify(e) for e in infra] == ["infra"] * len(infra)
    assert [classify(e) for e in bugs] == ["bug"] * len(bugs)
    assert [backoff_s(1.0, a) for a in range(5)] == [0.0, 1.0, 2.0, 4.0, 8.0]
    assert backoff_s(1.0, 20) == 60.0 and backoff_s(0.0, 3) == 0.0


def test_ray_errors_are_sorted_at_the_seam():
    """A dead actor is infrastructure; a rollout that raised keeps its own type and the worker's traceback."""
    exceptions = pytest.importorskip("ray.exceptions")
    from atelier.rl.ray_backend import remote_failure

    dead = remote_failure(exceptions.ActorDiedError())
    assert isinstance(dead, InfraError) and is_infra(dead)
    raised = exceptions.RayTaskError("rollout", "Traceback ...\nKeyError: 'k'", KeyError("k")).as_instanceof_cause()
    bug = remote_failure(raised)
    assert type(bug) is KeyError and not is_infra(bug) and "KeyError: 'k'" in bug.remote_traceback
    nested = exceptions.RayTaskError("rollout", "tb", exceptions.ActorDiedError())
    assert is_infra(remote_failure(nested))
    infra_inside = exceptions.RayTaskError("rollout", "tb", InfraError("sandbox died")).as_instanceof_cause()
    assert is_infra(remote_failure(infra_inside))


@pytest.mark.ray
@pytest.mark.slow   # starting Ray and its actor processes takes about a minute on 2 cores
def test_a_bug_inside_a_ray_actor_stops_the_run_with_the_workers_traceback(ray_instance, tiny_model_dir, tmp_path):
    from atelier.config import load_config
    from atelier.errors import BugError
    from atelier.rl.config import TrainConfig
    from atelier.rl.run import run_training

    recipe = _recipe(tmp_path, tiny_model_dir, "buggy", f'fixed = "{tmp_path / "fixed"}"', steps=2)
    config = load_config(TrainConfig, recipe, ["launcher=ray"])
    with pytest.raises(BugError, match=r"rollout g\d+-toy-00001/\d of task toy-00001 failed with a bug.*KeyError"):
        run_training(config, tmp_path / "run")
    log = (tmp_path / "run" / "failures.log").read_text()
    assert "raised remotely" in log and "no such key" in log
    slots = Ledger.load(tmp_path / "run" / "ledger.jsonl").slots.values()
    assert not any(s.state in ("dropped", "trained") for s in slots if s.task_id == "toy-00001")
