"""No config a user writes can produce a traceback.

A fuzz over every level of the recipes of `atelier train`, `atelier pretrain`,
`atelier run` and `atelier eval` (its agent config): for each section, an
unknown key; for each field, a value of the wrong type, and for each choice
field a value outside its choices. Each case goes through the real CLI entry
point, in this process (`cli.main`, as the console script runs it), both as
`--set` and as a recipe file, and must exit with status 2, name the dotted
key, and print no traceback. A handful of cases run as real subprocesses.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal

import pytest
import tomli_w
from pydantic import BaseModel

from atelier.cli import main as cli
from atelier.compat import tomllib
from atelier.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN = "zz_not_a_key"


def _members(annotation: Any) -> list[Any]:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) if a is not type(None) for m in _members(a)]
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _bad_value(annotation: Any) -> Any:
    """A value no member of `annotation` accepts (None when the field takes anything)."""
    members = _members(annotation)
    origins = [typing.get_origin(m) or m for m in members]
    if any(m is Any for m in members) or any(o is dict for o in origins) and len(members) > 1:
        return None
    if len(members) == 1 and typing.get_origin(members[0]) is Literal:
        return "no-such-choice"
    if any(o in (dict,) or _is_model(o) for o in origins):
        return 5                                          # a scalar where a section belongs
    if any(o in (int, float, bool, list, tuple) for o in origins):
        return "not-a-number" if not any(o in (list, tuple) for o in origins) else 7
    return {"a": [1]}                                    # a table where a string or path belongs


def _cases(model: type[BaseModel], data: dict, path: list) -> Iterator[tuple[list, Any]]:
    """(path, bad value) for every level under `model`, whose valid data at `path` is `data`."""
    yield [*path, UNKNOWN], 1
    for name, field in model.model_fields.items():
        members = _members(field.annotation)
        sub = [m for m in members if _is_model(m)]
        items = [typing.get_args(m)[0] for m in members if typing.get_origin(m) is list and typing.get_args(m)]
        if sub:
            yield from _cases(sub[0], data.get(name) or {}, [*path, name])
        if items and _is_model(items[0]) and isinstance(data.get(name), list) and data[name]:
            yield from _cases(items[0], data[name][0], [*path, name, 0])
        bad = _bad_value(field.annotation)
        if bad is not None:
            yield [*path, name], bad


def _dotted(path: list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _apply(data: dict, path: list, value: Any) -> dict:
    data = copy.deepcopy(data)
    node = data
    for part in path[:-1]:
        if isinstance(part, int):
            node = node[part]
        else:
            if not isinstance(node.get(part), (dict, list)):     # an absent (None) section
                node[part] = {}
            node = node[part]
    node[path[-1]] = value
    return data


def _toml_value(value: Any) -> str:
    """`value` as an inline TOML value, as one would write it after --set key=."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def _commands(tmp_path: Path) -> dict[str, tuple[type[BaseModel], dict, Any]]:
    """Per command: its config model, a valid base recipe, and argv from (recipe file, --set list)."""
    from atelier.eval.runner import EvalRecipe
    from atelier.pipeline.config import RunConfig
    from atelier.pretrain.config import PretrainConfig
    from atelier.rl.config import TrainConfig

    def recipe(name: str) -> dict:
        return tomllib.loads((ROOT / "recipes" / name).read_text())

    out = tmp_path / "never-written"
    return {
        "train": (TrainConfig, recipe("rl-tiny.toml"),
                  lambda f, sets: ["train", str(f), "--run-dir", str(out), *sets]),
        "pretrain": (PretrainConfig, recipe("pretrain-tiny.toml"),
                     lambda f, sets: ["pretrain", str(f), "--run-dir", str(out), *sets]),
        "run": (RunConfig, recipe("demo.toml"), lambda f, sets: ["run", str(f), "--run-dir", str(out), *sets]),
        "eval": (EvalRecipe, {}, lambda f, sets: ["eval", str(f), "--model", "scripted:gold", "--tasks",
                                                  str(tmp_path), "--run-dir", str(out), *sets]),
    }


def _atelier(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    captured = capsys.readouterr()
    return info.value.code, captured.out + captured.err


@pytest.mark.parametrize("command", ["train", "pretrain", "run", "eval"])
def test_every_bad_key_type_and_choice_exits_2_naming_the_key(command, tmp_path, capsys):
    model, base, argv = _commands(tmp_path)[command]
    good = tmp_path / "good.toml"
    good.write_text(tomli_w.dumps(base))
    load_config(model, good)                              # the base recipe is valid
    cases = list(_cases(model, base, []))
    assert len(cases) >= 20
    through_cli, sections = 0, set()
    for path, value in cases:
        key = _dotted(path)
        bad = tmp_path / "bad.toml"
        bad.write_text(tomli_w.dumps(_apply(base, path, value)))
        variants = [(bad, [])]
        if not any(isinstance(p, int) for p in path):    # --set reaches every key outside a list
            variants.append((good, ["--set", f"{key}={_toml_value(value)}"]))
        # Every case through the config layer all commands share; through the whole CLI (0.1 s
        # each) every unknown key and bad choice, and one wrong type per section.
        section = tuple(path[:-1])
        whole = path[-1] == UNKNOWN or value == "no-such-choice" or section not in sections
        sections.add(section)
        for recipe, sets in variants:
            with pytest.raises(ConfigError) as info:      # typed, and names the key
                load_config(model, recipe, sets[1:])
            assert f"'{key}'" in info.value.message, (key, info.value.message)
            if whole:
                through_cli += 1
                code, output = _atelier(argv(recipe, sets), capsys)
                assert code == 2, (key, value, output)
                assert "Traceback" not in output and "error: " in output and key in output, (key, output)
    assert through_cli >= 5


def test_env_python_args_that_do_not_fit_the_factory_are_named(tmp_path):
    """The factory's own arguments come from the recipe too: a wrong one is a user error."""
    (tmp_path / "env.py").write_text("from atelier.rl.env import ToyEnvironment\n"
                                     "def make(rollout, shaping, seed, tasks=3):\n"
                                     "    raise AssertionError('never called')\n")
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'[env]\nkind = "python"\n[env.python]\nfactory = "{tmp_path / "env.py"}:make"\n'
                      'args = { taks = 3 }\n')
    from atelier.rl.config import TrainConfig
    from atelier.rl.env import EnvironmentFactoryError, make_environment

    config = load_config(TrainConfig, recipe)
    with pytest.raises(EnvironmentFactoryError, match="env.python.args do not fit") as info:
        make_environment(config.env, config.rollout, config.shaping, 0)
    assert "tasks" in info.value.hint


@pytest.mark.parametrize("argv", [
    ["train", "recipes/rl-tiny.toml", "--set", "rollout.mode=eventually"],
    ["run", "recipes/demo.toml", "--set", "rl.trainer.lr=fast", "--set", "eval.agent.sampling=3"],
    ["eval", "--model", "scripted:gold", "--tasks", ".", "--run-dir", "never", "--set", "agent.tools.nope=1"],
])
def test_through_the_real_process_no_traceback(argv):
    proc = subprocess.run([sys.executable, "-m", "atelier.cli", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "error: " in proc.stderr
