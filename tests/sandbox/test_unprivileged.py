"""Users are not root: the sandbox must work for an ordinary account.

When the suite runs as root (as CI does), this test drops to `nobody` with
`setpriv` and runs a sandbox there, with the same interpreter (readable by
everyone) and the project's sources on PYTHONPATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

import atelier

NOBODY = 65534

SCRIPT = r"""
from atelier.sandbox import SandboxConfig, create_sandbox
with create_sandbox("snap", SandboxConfig(max_processes=32)) as sb:
    assert sb.mode == "overlay", sb.mode
    assert sb.exec("echo more >> a.txt").exit_code == 0
    child = sb.fork()
    assert child.read_file("a.txt") == "one\nmore\n"
    child.close()
    bomb = sb.exec("for i in $(seq 100); do sleep 5 & done", timeout=10)
    assert "fork" in bomb.stderr.lower(), bomb
    assert "+more" in sb.diff()
print("UNPRIVILEGED-OK")
"""


def _readable_by_all(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [path, *path.parents])


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="already unprivileged: the other tests cover it")
def test_sandbox_works_for_an_unprivileged_user() -> None:
    src = Path(atelier.__file__).resolve().parents[1]
    site = Path(sysconfig.get_paths()["purelib"])
    # The same Python version, from wherever everyone may run it.
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [Path(sys.executable).resolve(), Path("/usr/bin") / version, Path("/usr/local/bin") / version]
    python = next((p for p in candidates if p.exists() and _readable_by_all(p.parent)), None)
    if python is None or not all(_readable_by_all(p) for p in (src, site)):
        pytest.skip("no interpreter and sources readable by an unprivileged user here")
    work = Path(tempfile.mkdtemp(prefix="atelier-unpriv-"))
    try:
        os.chmod(work, 0o755)
        (work / "snap").mkdir()
        (work / "snap" / "a.txt").write_text("one\n")
        (work / "run.py").write_text(SCRIPT)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(work)], check=True)
        res = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", str(python), "run.py"],
            cwd=work, capture_output=True, text=True, timeout=120,
            env={"PYTHONPATH": f"{src}:{site}", "PATH": "/usr/bin:/bin", "TMPDIR": str(work),
                 "HOME": str(work)},
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert "UNPRIVILEGED-OK" in res.stdout, res.stdout + res.stderr
