"""Frozen overlay layers that forked sandboxes share.

A fork copies its parent's upper layer (only what changed) into a directory on
the host; that copy becomes a read-only lower layer of the child and, through
further forks, of its descendants. A layer is deleted when the last sandbox
using it closes; one left by a killed process is deleted by the next copy.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from pathlib import Path
from typing import Iterator

from atelier.fsio import owned_temp_dir
from atelier.sandbox.base import SandboxError
from atelier.sandbox.fsutil import remove_tree
from atelier.sandbox.hostfs import runtime_dir


class Layer:
    """`path` holds the layer's files; its parent, `layer-XXXX` in the runtime directory, also
    records the owning process, beside the files because a record among them would show in
    every sandbox over the layer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._refs = 1
        self._lock = threading.Lock()

    @classmethod
    def copy_of(cls, source: str) -> "Layer":
        holder = owned_temp_dir("layer-", runtime_dir())
        dest = holder / "files"
        # cp -a keeps what overlayfs needs: whiteouts (0:0 devices), opaque
        # xattrs, modes and symlinks as symlinks.
        res = subprocess.run(["cp", "-a", "--", f"{source}/.", str(dest)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            remove_tree(holder)
            raise SandboxError(f"could not copy the sandbox's files for fork: {res.stderr.strip()}")
        return cls(dest)

    def acquire(self) -> None:
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            done = self._refs == 0
        if done:
            remove_tree(self.path.parent)

    @contextlib.contextmanager
    def open(self) -> Iterator[int]:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            yield fd
        finally:
            os.close(fd)
