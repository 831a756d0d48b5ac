"""How a rank's process ends, and that it dies with the launcher that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from atelier.train.ranks import LAUNCHER_PID
from tests.helpers import rank_env, wait_until

EXIT_PROBE = """
import atexit, sys
from pathlib import Path
from atelier.train.ranks import exit_rank

atexit.register(lambda: Path(sys.argv[1]).write_text("ran"))
print("unflushed", end="")
sys.stderr.write("also unflushed")

class Teardown:
    def __init__(self, marker):
        self.marker = marker

    def __del__(self, open=open):   # only the interpreter's teardown calls this
        with open(self.marker, "w") as f:
            f.write("teardown ran")

kept = Teardown(sys.argv[1])
exit_rank(3)
"""


def test_a_rank_ends_without_the_interpreter_teardown(tmp_path):
    """`exit_rank` (how `atelier rank` ends): the code, every byte written, the atexit
    handlers, and no teardown, where gloo's threads can abort a rank that finished its work."""
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, "-c", EXIT_PROBE, str(marker)], env={**os.environ, **rank_env()},
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (3, "unflushed", "also unflushed")
    assert marker.read_text() == "ran"


ORPHAN_PROBE = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "from atelier.train.ranks import die_with_parent\\n"
                         "die_with_parent()\\nprint('ready', flush=True)\\nimport time\\ntime.sleep(120)"],
                        stdout=subprocess.PIPE, text=True)
assert rank.stdout.readline().strip() == "ready"
print(rank.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_dies_with_the_process_that_started_it():
    """A `kill -9` of the launcher leaves no rank behind (`die_with_parent`, which every rank
    `atelier.cli.rank` runs calls first: torchrun's agent starts its ranks in sessions of their own)."""
    launcher = subprocess.Popen([sys.executable, "-c", ORPHAN_PROBE], env={**os.environ, **rank_env()},
                                stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())   # once the rank has asked to die with it
    assert _alive(rank)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    assert wait_until(lambda: not _alive(rank), 60), "the rank outlived its launcher"


def test_a_rank_whose_launcher_is_already_gone_exits_at_once():
    """The race `die_with_parent` closes: the launcher named in the environment is not the parent."""
    code = "from atelier.train.ranks import die_with_parent\ndie_with_parent()\nprint('ran on')"
    env = {**os.environ, **rank_env(), LAUNCHER_PID: "1"}   # as if the launcher died and init adopted the rank
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if not sys.platform.startswith("linux"):
        assert done.stdout.strip() == "ran on"
        return
    assert done.returncode == 1 and "ran on" not in done.stdout


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

