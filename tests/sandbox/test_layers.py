"""Frozen fork layers: a layer's files, its owner record beside them, and the layer a killed
process left removed by the next copy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from atelier.fsio import OWNER_FILE
from atelier.sandbox.layers import Layer

pytestmark = pytest.mark.timeout(60)

SRC = str(Path(__file__).parents[2] / "src")


def _upper(tmp_path: Path) -> Path:
    upper = tmp_path / "upper"
    (upper / "pkg").mkdir(parents=True)
    (upper / "pkg" / "a.py").write_text("A = 2\n")
    return upper


def test_a_layer_holds_only_the_copied_files_and_its_release_removes_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    layer = Layer.copy_of(str(_upper(tmp_path)))
    assert sorted(p.name for p in layer.path.iterdir()) == ["pkg"]   # no record among the files
    assert (layer.path / "pkg" / "a.py").read_text() == "A = 2\n"
    assert (layer.path.parent / OWNER_FILE).read_text().split()[0] == str(os.getpid())
    layer.acquire()
    layer.release()
    assert layer.path.is_dir()
    layer.release()
    assert not layer.path.parent.exists()


def test_the_layer_of_a_killed_process_is_removed_by_the_next_copy(tmp_path, monkeypatch) -> None:
    """A sandbox process killed before its forks close leaves their layers (the runtime
    directory of a machine that ran killed tests held dozens); the next copy removes them."""
    upper = _upper(tmp_path)
    program = ("import os, signal, sys\nfrom atelier.sandbox.layers import Layer\n"
               "print(Layer.copy_of(sys.argv[1]).path, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.run([sys.executable, "-c", program, str(upper)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": SRC, "XDG_RUNTIME_DIR": str(tmp_path)})
    assert killed.returncode == -9, killed.stderr
    left = Path(killed.stdout.strip())
    assert (left / "pkg" / "a.py").exists()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    mine = Layer.copy_of(str(upper))
    assert not left.parent.exists()
    assert (mine.path / "pkg" / "a.py").exists()
    mine.release()
