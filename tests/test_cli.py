"""The `atelier` entry point: fast help, the version, and how user errors look."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

import atelier
from atelier.cli import main as cli
from atelier.config import ConfigError
from atelier.errors import AtelierError


def run_python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_help_lists_the_sandbox_group() -> None:
    proc = run_python("-m", "atelier.cli.main", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage: atelier" in proc.stdout
    assert "sandbox" in proc.stdout


def test_no_arguments_prints_help() -> None:
    result = CliRunner().invoke(cli.app, [])
    assert "Usage" in result.output


def test_version() -> None:
    result = CliRunner().invoke(cli.app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"atelier {atelier.__version__}"


def test_python_dash_m_atelier_cli() -> None:
    proc = run_python("-m", "atelier.cli", "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"atelier {atelier.__version__}"


def test_sandbox_group_answers_help() -> None:
    result = CliRunner().invoke(cli.app, ["sandbox", "--help"])
    assert result.exit_code == 0
    assert "Isolated coding environments" in result.output


def test_importing_the_cli_loads_no_heavy_module() -> None:
    heavy = ["torch", "ray", "numpy", "transformers", "vllm", "atelier.config"]
    code = (
        "import sys, atelier.cli.main\n"
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_commands_are_listed_and_the_rank_entry_point_is_hidden() -> None:
    proc = run_python("-m", "atelier.cli.main", "--help")
    listed = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("│ ") and len(line.split()) > 1}
    for name in ("run", "train", "pretrain", "eval", "base-eval", "agent", "serve", "report", "models", "tasks",
                 "sandbox"):
        assert name in listed, (name, listed)
    assert "rank" not in listed and "evals" not in listed
    result = CliRunner().invoke(cli.app, ["rank", "--help"])
    assert result.exit_code == 0 and "internal" in result.output


def _app_raising(exc: Exception) -> typer.Typer:
    """A stand-in app whose one command fails the way a real command would."""
    app = typer.Typer()

    @app.command()
    def fail() -> None:
        raise exc

    return app


def test_user_errors_print_message_and_hint_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error = ConfigError("unknown key 'trainer.lrr'", hint="did you mean 'lr'?")
    monkeypatch.setattr(cli, "app", _app_raising(error))
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error: unknown key 'trainer.lrr'" in err
    assert "hint: did you mean 'lr'?" in err
    assert "Traceback" not in err


def test_user_error_without_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "app", _app_raising(AtelierError("no bwrap")))
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: no bwrap\n"


def test_bugs_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "app", _app_raising(KeyError("bug")))
    with pytest.raises(KeyError):
        cli.main([])


def test_a_user_error_through_the_real_process_has_no_traceback(tmp_path) -> None:
    script = tmp_path / "entry.py"
    script.write_text(
        "import typer\n"
        "from atelier.cli import main as cli\n"
        "from atelier.config import load_config, AtelierConfig\n"
        "class C(AtelierConfig):\n"
        "    lr: float = 1.0\n"
        "app = typer.Typer()\n"
        "@app.command()\n"
        "def go(setting: str) -> None:\n"
        "    load_config(C, None, [setting])\n"
        "cli.app = app\n"
        "cli.main()\n"
    )
    proc = run_python(str(script), "lrr=3")
    assert proc.returncode == 2
    assert "error: unknown key 'lrr'" in proc.stderr
    assert "hint: did you mean 'lr'?" in proc.stderr
    assert "Traceback" not in proc.stderr
