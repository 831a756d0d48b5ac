"""Recipes, overrides and the messages a user sees when they get one wrong."""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import pytest
from pydantic import Field, field_validator

from atelier.config import AtelierConfig, ConfigError, dump_config, load_config, parse_override
from atelier.errors import AtelierError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Precision(enum.Enum):
    BF16 = "bf16"
    FP32 = "fp32"


class TrainerConfig(AtelierConfig):
    lr: float = 1e-5
    steps: int = Field(100, gt=0)
    optimizer: Literal["adamw", "muon"] = "adamw"
    precision: Precision = Precision.BF16


class SandboxSection(AtelierConfig):
    network: Literal["none", "host"] = "none"
    env: dict[str, str] = Field(default_factory=dict)
    ro_mounts: list[str] = Field(default_factory=list)

    @field_validator("ro_mounts")
    @classmethod
    def _absolute(cls, mounts: list[str]) -> list[str]:
        if not all(m.startswith("/") for m in mounts):
            raise ValueError("mounts must be absolute paths")
        return mounts


class TaskSpec(AtelierConfig):
    name: str
    weight: float = 1.0


class TasksConfig(AtelierConfig):
    names: list[str] = Field(default_factory=list)
    specs: list[TaskSpec] = Field(default_factory=list)


class RunConfig(AtelierConfig):
    name: str = "run"
    seed: Optional[int] = None
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    tasks: TasksConfig = Field(default_factory=TasksConfig)


class Bwrap(AtelierConfig):
    kind: Literal["bwrap"] = "bwrap"
    memory_mb: int = 2048


class Docker(AtelierConfig):
    kind: Literal["docker"] = "docker"
    image: str = "python:3.11"


class WithBackend(AtelierConfig):
    backend: Annotated[Union[Bwrap, Docker], Field(discriminator="kind")] = Field(
        default_factory=Bwrap
    )


class Required(AtelierConfig):
    model: str


RECIPE = """\
name = "toy"

[trainer]
lr = 3e-4
optimizer = "muon"

[sandbox]
network = "none"
env = { PYTHONHASHSEED = "0" }
"""


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "toy.toml"
    path.write_text(RECIPE)
    return path


def test_loads_a_toml_recipe(recipe: Path) -> None:
    cfg = load_config(RunConfig, recipe, [])
    assert cfg.name == "toy"
    assert cfg.trainer.lr == 3e-4 and cfg.trainer.optimizer == "muon"
    assert cfg.trainer.steps == 100
    assert cfg.sandbox.env == {"PYTHONHASHSEED": "0"}


def test_without_a_recipe_the_defaults_and_overrides_apply() -> None:
    cfg = load_config(RunConfig, None, ["trainer.steps=7"])
    assert cfg.trainer.steps == 7 and cfg.name == "run"


def test_nested_overrides_win_over_the_file_and_later_ones_win(recipe: Path) -> None:
    cfg = load_config(
        RunConfig,
        recipe,
        ["trainer.lr=1e-3", "sandbox.network=host", "trainer.lr=2e-3", "sandbox.env.A=b"],
    )
    assert cfg.trainer.lr == 2e-3
    assert cfg.sandbox.network == "host"
    assert cfg.sandbox.env == {"PYTHONHASHSEED": "0", "A": "b"}
    assert cfg.trainer.optimizer == "muon"  # untouched keys keep the file's value


def test_list_overrides_accept_bare_words_and_toml() -> None:
    cfg = load_config(RunConfig, None, ["tasks.names=[a,b]"])
    assert cfg.tasks.names == ["a", "b"]
    cfg = load_config(RunConfig, None, ['tasks.names=["x y", "z"]'])
    assert cfg.tasks.names == ["x y", "z"]
    cfg = load_config(RunConfig, None, ["tasks.specs=[{name = 'a'}, {name = 'b', weight = 2}]"])
    assert [(s.name, s.weight) for s in cfg.tasks.specs] == [("a", 1.0), ("b", 2.0)]


@pytest.mark.parametrize(
    ("text", "keys", "value"),
    [
        ("trainer.lr=3e-4", ["trainer", "lr"], 3e-4),
        ("sandbox.network=host", ["sandbox", "network"], "host"),
        ("a = 1", ["a"], 1),
        ("flag=true", ["flag"], True),
        ('name="true"', ["name"], "true"),
        ("names=[a, 2, [c,d]]", ["names"], ["a", 2, ["c", "d"]]),
        ("names=[]", ["names"], []),
        ("day=2024-01-01", ["day"], "2024-01-01"),
        ("cmd=a=b", ["cmd"], "a=b"),
        ("empty=", ["empty"], ""),
    ],
)
def test_parse_override(text: str, keys: list[str], value: object) -> None:
    assert parse_override(text) == (keys, value)


@pytest.mark.parametrize("text", ["trainer.lr", "=3", "trainer..lr=1", "a b=1"])
def test_malformed_override_shows_the_expected_form(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_override(text)
    assert "expected the form key=value" in info.value.message
    assert info.value.hint


def test_override_through_a_value_is_an_error(recipe: Path) -> None:
    with pytest.raises(ConfigError, match="'name' is a value, not a section"):
        load_config(RunConfig, recipe, ["name.first=x"])


def test_unknown_key_names_the_key_lists_allowed_and_suggests(recipe: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, recipe, ["trainer.lrr=1e-3"])
    err = info.value
    assert isinstance(err, AtelierError)
    assert "unknown key 'trainer.lrr'" in err.message
    assert "lr, steps, optimizer, precision" in err.message
    assert "from --set trainer.lrr=1e-3" in err.message
    assert err.hint == "did you mean 'lr'?"


def test_unknown_top_level_section_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text("[trainr]\nlr = 1.0\n")
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, path, [])
    assert "unknown key 'trainr'" in info.value.message
    assert "allowed keys at the top level: name, seed, trainer, sandbox, tasks" in info.value.message
    assert f"(in {path})" in info.value.message
    assert info.value.hint == "did you mean 'trainer'?"


def test_unknown_key_inside_a_list_of_models() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, ["tasks.specs=[{name = 'a', wieght = 2}]"])
    assert "unknown key 'tasks.specs[0].wieght'" in info.value.message
    assert info.value.hint == "did you mean 'weight'?"


def test_unknown_key_in_a_union_member_picked_by_its_tag() -> None:
    cfg = load_config(WithBackend, None, ["backend.kind=docker", "backend.image=x"])
    assert cfg.backend == Docker(image="x")
    with pytest.raises(ConfigError) as info:
        load_config(WithBackend, None, ["backend.kind=docker", "backend.imag=x"])
    assert info.value.message == (
        "unknown key 'backend.imag'; allowed keys at 'backend': kind, image"
        " (from --set backend.imag=x)"
    )
    assert info.value.hint == "did you mean 'image'?"


def test_bad_literal_names_the_key_and_the_allowed_values() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, ["sandbox.network=hots"])
    assert "'sandbox.network'" in info.value.message
    assert "allowed values: 'none' or 'host'" in info.value.message
    assert info.value.hint == "did you mean 'host'?"


def test_bad_enum_names_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match="'trainer.precision'; allowed values: 'bf16' or 'fp32'"):
        load_config(RunConfig, None, ["trainer.precision=fp8"])


def test_other_validation_errors_name_the_key_and_say_why() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, None, ["trainer.steps=0", "sandbox.ro_mounts=[rel]"])
    message = info.value.message
    assert message.startswith("2 problems in the config")
    assert "invalid value 0 for 'trainer.steps': Input should be greater than 0" in message
    assert "'sandbox.ro_mounts': mounts must be absolute paths" in message


def test_missing_required_key_says_how_to_set_it() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Required, None, [])
    assert info.value.message == "missing required key 'model'"
    assert "--set model=VALUE" in info.value.hint


def test_missing_recipe_names_the_path_and_suggests(recipe: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, recipe.parent / "tyo.toml", [])
    assert f"recipe file not found: {recipe.parent / 'tyo.toml'}" in info.value.message
    assert info.value.hint == f"did you mean {recipe}?"
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, "no/such/dir/x.toml", [])
    assert "relative to" in info.value.message and "recipes/" in info.value.hint


def test_malformed_toml_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('name = "x"\n[trainer]\nlr = \n')
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, path, [])
    assert f"malformed TOML in {path}:3" in info.value.message
    assert "3 | lr = " in info.value.message
    assert info.value.hint


def test_dump_round_trips(recipe: Path, tmp_path: Path) -> None:
    cfg = load_config(
        RunConfig,
        recipe,
        [
            "tasks.names=[a,b]",
            "tasks.specs=[{name = 'q\"uote', weight = 0.5}]",
            'sandbox.env={"odd key" = "tab\\there\\u007f", A = "b"}',
            "trainer.precision=fp32",
        ],
    )
    text = dump_config(cfg)
    assert "seed" not in text  # None has no TOML spelling; the default restores it
    tomllib.loads(text)  # valid TOML
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    assert load_config(RunConfig, path, []) == cfg


def test_dump_writes_sections_and_empty_tables() -> None:
    text = dump_config(RunConfig())
    assert text.startswith('name = "run"\n')
    assert "\n[trainer]\nlr = 1e-05\n" in text
    assert "[sandbox]\nnetwork = \"none\"\nro_mounts = []\n\n[sandbox.env]\n" in text
