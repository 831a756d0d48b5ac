"""`env.kind = "python"`: a user's environment, named by file or import path,
trains through the real trainer; a bad factory is a typed error that says
what to write."""

from __future__ import annotations

import textwrap

import pytest
from typer.testing import CliRunner

from atelier.cli.main import app
from atelier.config import load_config
from atelier.rl.config import EnvConfig, PythonEnvConfig, RolloutConfig, TrainConfig
from atelier.rl.env import EnvironmentFactoryError, ToyEnvironment, load_factory, make_environment
from atelier.rl.shaping import ShapingConfig

# A user's environment: the toy task, wrapped, with the task count from the recipe's args.
USER_ENV = textwrap.dedent('''
    from atelier.rl.config import ToyEnvConfig
    from atelier.rl.env import ToyEnvironment

    class CountingEnv(ToyEnvironment):
        rollouts = 0

        def rollout(self, task, model, seed):
            CountingEnv.rollouts += 1
            traj = super().rollout(task, model, seed)
            traj.reward_parts["from_user_env"] = 1.0
            return traj

    def make_env(rollout, shaping, seed, tasks=8):
        return CountingEnv(ToyEnvConfig(tasks=tasks), rollout, shaping, seed)

    def not_an_env(rollout, shaping, seed):
        return 42
''')


def _env(factory: str, **args) -> EnvConfig:
    return EnvConfig(kind="python", python=PythonEnvConfig(factory=factory, args=args))


def _make(env: EnvConfig):
    return make_environment(env, RolloutConfig(), ShapingConfig(), seed=0)


def test_a_factory_loads_from_a_file_or_a_module(tmp_path):
    (tmp_path / "user_env.py").write_text(USER_ENV)
    built = _make(_env(f"{tmp_path / 'user_env.py'}:make_env", tasks=5))
    assert type(built).__name__ == "CountingEnv" and len(built.tasks()) == 5
    # an importable module by dotted path
    assert load_factory("atelier.rl.env:ToyEnvironment") is ToyEnvironment


def test_bad_factories_are_typed_errors_with_a_fix(tmp_path):
    (tmp_path / "user_env.py").write_text(USER_ENV)
    cases = {
        "no_colon_here": "names no callable",
        f"{tmp_path / 'missing.py'}:make_env": "cannot import",
        "atelier.no_such_module:make_env": "cannot import",
        f"{tmp_path / 'user_env.py'}:nope": "has no callable 'nope'",
        f"{tmp_path / 'user_env.py'}:not_an_env": "lacks tasks, category, rollout",
    }
    for factory, message in cases.items():
        with pytest.raises(EnvironmentFactoryError, match=message) as info:
            _make(_env(factory))
        assert info.value.hint
    with pytest.raises(ValueError, match=r"\[env.python\] section"):
        EnvConfig(kind="python")


def test_atelier_train_runs_a_python_environment(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "user_env.py").write_text(USER_ENV)
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(textwrap.dedent(f'''
        model = "{tiny_model_dir}"
        [rollout]
        group_size = 4
        groups_per_step = 1
        workers = 4
        max_tokens = 8
        [trainer]
        steps = 2
        norm_tokens = 64
        [env]
        kind = "python"
        [env.python]
        factory = "user_env.py:make_env"
        args = {{ tasks = 3 }}
    '''))
    monkeypatch.chdir(tmp_path)          # the factory's file path is relative to the working directory
    result = CliRunner().invoke(app, ["train", str(recipe), "--run-dir", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 0, result.output
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert f'factory = "{tmp_path / "user_env.py"}:make_env"' in saved   # the run directory says what ran
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2 and "from_user_env" in metrics[0]


def test_the_same_config_loads_from_dotted_overrides(tmp_path):
    config = load_config(TrainConfig, None, ["env.kind=python", "env.python.factory=pkg.mod:make"])
    assert config.env.python.factory == "pkg.mod:make" and config.env.python.args == {}
