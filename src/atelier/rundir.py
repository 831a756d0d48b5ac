"""A run directory, and the one rule by which a command continues the run it holds.

Every command that writes a run (`atelier run`, `train`, `pretrain`, `eval`)
takes it as `--run-dir DIR`. The first start freezes the resolved config in
`DIR/config.toml`; running the same command again continues the run from
what it last committed (finished stages, checkpoints, attempts), whatever
stopped it: an error, Ctrl-C, `kill -9`, a full disk. A start whose config
differs from the frozen one is refused, naming the keys that differ, rather
than mixing two runs in one directory, and so is a directory that holds
files but no frozen config. The frozen config is compared as data after the
defaults of fields added since the run began are filled in: a run started
before a field existed is the same run with that field at its default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

from atelier.compat import tomllib
from atelier.config import dump_config, load_config
from atelier.errors import AtelierError
from atelier.fsio import atomic_write

CONFIG = "config.toml"
M = TypeVar("M", bound=BaseModel)


class RunDirError(AtelierError):
    """A run directory that cannot be started or continued."""


def freeze_config(config: BaseModel, run_dir: str | Path, *, command: str = "atelier",
                  may_change: Sequence[str] = ()) -> bool:
    """Freeze `config` in `run_dir` at a first start, or check it against the frozen one; True
    when the directory already held this run (the caller continues it). `may_change`: dotted
    keys that say how far a run goes, not what it is (RL's `trainer.steps`): a continued run may
    take a new value, which the frozen config then records. `command` names the command in the
    messages."""
    run_dir = Path(run_dir)
    frozen = run_dir / CONFIG
    text = dump_config(config)
    if frozen.is_file():
        differing = differing_keys(type(config), frozen.read_text(), text)
        if differing and not set(differing) <= set(may_change):
            shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
            raise RunDirError(f"{run_dir} holds a run of a different config ({shown} differ from its {CONFIG})",
                              hint=f"continue it with the recipe and --set values it began with (its {CONFIG} "
                                   f"holds them), or pick a new --run-dir for {command}")
        if frozen.read_text() != text:   # this version's form: new fields at their defaults, a new step budget
            atomic_write(frozen, text)
        return True
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} is a file, not a directory", hint="pick a new --run-dir")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        raise RunDirError(f"{run_dir} holds files but no {CONFIG}: it is not a run directory of {command}",
                          hint="pick a new --run-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(frozen, text)
    return False


def frozen_config_path(run_dir: str | Path) -> Path | None:
    """`run_dir`'s frozen config, or None when it holds none."""
    path = Path(run_dir) / CONFIG
    return path if path.is_file() else None


def differing_keys(model_cls: type[BaseModel], frozen: str, text: str) -> list[str]:
    """The dotted keys whose values differ between a frozen config and `text` (both TOML), after
    the frozen one is read by `model_cls` (filling in defaults); ["(unreadable)"] when this
    version cannot read it."""
    try:
        then = tomllib.loads(dump_config(model_cls.model_validate(tomllib.loads(frozen))))
    except (tomllib.TOMLDecodeError, ValidationError, ValueError):
        return [f"(its {CONFIG} cannot be read as this version's config)"]
    return sorted(_diff(then, tomllib.loads(text), ""))


def _diff(a: Any, b: Any, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            out += _diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def resolve_run(model_cls: type[M], recipe: str | Path | None, overrides: Sequence[str],
                run_dir: str | Path | None, command: str) -> tuple[M, Path]:
    """The config and run directory of a command that writes a run: `recipe` with `overrides`,
    in `run_dir` (default `runs/<recipe name>`). Without a recipe, the config frozen in
    `run_dir`, so that `COMMAND --run-dir DIR` continues the run DIR holds."""
    if recipe is None:
        if run_dir is None:
            raise RunDirError("no recipe given", hint=f"{command} RECIPE, or {command} --run-dir DIR to "
                                                      "continue the run DIR holds")
        recipe = frozen_config_path(run_dir)
        if recipe is None:
            raise RunDirError(f"{run_dir} holds no run to continue (no {CONFIG} there)",
                              hint=f"start one with {command} RECIPE --run-dir {run_dir}")
    config = load_config(model_cls, recipe, overrides)
    return config, Path(run_dir) if run_dir is not None else Path("runs") / Path(recipe).stem
