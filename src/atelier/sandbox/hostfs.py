"""What of the host a sandbox sees, and where the host keeps sandbox state.

Only what programs need to run is bound, read-only: `/usr` and the top-level
links or directories into it, and a short list of `/etc` entries (the loader
cache, certificates, time zone …). `/etc/passwd`, `/etc/group` and
`/etc/hosts` are generated, so no host account names leak in. Of the TLS
directories only the public certificates are bound, never `private/` keys. Home
directories, `/tmp`, `/root`, `/var`, `/run`, `/mnt`, `/media`, `/srv` and
`/opt` are never bound.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

SYSTEM_TOP = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

ETC_ENTRIES = (
    "alternatives", "ca-certificates", "ca-certificates.conf", "debian_version",
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "magic",
    "magic.mime", "mime.types", "nsswitch.conf", "os-release", "protocols",
    "python3", "services", "ssl/certs", "pki/tls/certs", "pki/ca-trust", "crypto-policies", "timezone",
    "inputrc", "bash.bashrc", "gai.conf", "host.conf", "terminfo",
)

PASSWD = "root:x:0:0:sandbox:/tmp:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"
HOSTS = "127.0.0.1 localhost sandbox\n::1 localhost\n"

SANDBOX_PATH = "/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin"


def runtime_dir() -> Path:
    """A private directory of this user for sandbox layers and generated
    files: $XDG_RUNTIME_DIR/atelier when set, else a 0700 folder in the temp
    directory."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(base) / "atelier" if base and os.path.isdir(base) else Path(
        tempfile.gettempdir()
    ) / f"atelier-{os.geteuid()}"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return root


@functools.lru_cache(maxsize=1)
def _generated_etc() -> Path:
    d = runtime_dir() / "etc"
    d.mkdir(exist_ok=True)
    for name, text in (("passwd", PASSWD), ("group", GROUP), ("hosts", HOSTS)):
        f = d / name
        if not f.exists() or f.read_text() != text:
            f.write_text(text)
    return d


@functools.lru_cache(maxsize=1)
def system_bind_args() -> tuple[str, ...]:
    """bwrap arguments that make the host's programs and libraries usable
    (all readable by everyone, so bwrap reaches them at their own paths)."""
    args: list[str] = []
    for top in SYSTEM_TOP:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for name in ETC_ENTRIES:
        path = f"/etc/{name}"
        if os.path.lexists(path):
            args += ["--ro-bind-try", path, path]
    return tuple(args)


def generated_etc_files() -> list[tuple[Path, str]]:
    """(host file, path inside) of the generated `/etc` files, to bind
    read-only after `system_bind_args()`."""
    gen = _generated_etc()
    return [(gen / name, f"/etc/{name}") for name in ("passwd", "group", "hosts")]


def python_mounts() -> list[str]:
    """Read-only mounts that make the host's Python interpreter usable inside
    (its installation prefix, at its own path), unless it already lives in a
    system directory."""
    prefix = os.path.realpath(sys.base_prefix)
    if any(prefix == top or prefix.startswith(top + "/") for top in SYSTEM_TOP):
        return []
    return [prefix]


def python_executable() -> str:
    """The path of the host's interpreter that works inside a sandbox that
    has `python_mounts()`."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return os.path.join(os.path.realpath(sys.base_prefix), "bin", name)
