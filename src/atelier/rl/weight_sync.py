"""Weight sync: the trainer publishes, inference readers take the latest.

One small interface, two transports (the loop never changes):

- `InProcessWeightSync`: a locked reference to a detached copy; for the
  one-process launcher.
- `DeltaChainWeightSync`: files on shared storage. Step s writes only what
  changed since the previous publish: for every tensor, the XOR of its raw
  bits (bf16 -> int16, fp32 -> int32 ...) against the last published value,
  zlib-compressed; a tensor whose bits did not change is not written at all.
  Every `full_every` steps a full snapshot starts a new chain. A reader
  rebuilds weights by loading the newest full snapshot at or below the
  newest step and XOR-ing the deltas after it in order; XOR is exact, so the
  rebuilt weights are the trainer's bit for bit.

Ordering and guarantees (the concurrency seam):
- `publish(sd, s)` writes `step-<s>.{full,delta}` through a temporary file and
  a rename; a reader never sees half a file. A step is visible only once its
  file is renamed, and the writer publishes steps in increasing order, so
  every step at or below the newest visible one is visible too.
- `latest()` returns the newest complete step. A reader that already holds
  step r applies only the deltas r+1..s (no re-read of the chain), unless a
  full snapshot newer than r exists, which it then starts from.
- A writer that restarts (resume) rebuilds its "previous publish" from the
  chain before writing the next delta, so a chain survives `kill -9`; steps
  newer than the resumed checkpoint are deleted first (they belong to an
  abandoned future).
- Old chains (before the newest full snapshot) are pruned by the writer after
  it writes a new full snapshot, keeping `keep_chains` of them.

Example: full_every=3, publishes at steps 0..4 write step-0.full,
step-1.delta, step-2.delta, step-3.full, step-4.delta; a reader at step 1
asked for latest() loads step-3.full and applies step-4.delta.
"""

from __future__ import annotations

import json
import re
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from atelier.fsio import atomic_write
from atelier.rl.chain import FULL, chain_reads, publish_kind

StateDict = dict[str, torch.Tensor]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NAME = re.compile(r"^step-(\d{8})\.(full|delta)$")


@dataclass
class SyncStats:
    step: int
    bytes: int
    seconds: float
    kind: str            # "inprocess", "full" or "delta"
    changed_tensors: int = 0


class WeightSync(Protocol):
    """The trainer publishes through one instance; each inference side reads
    through `reader()` (the same object in one process, its own file cursor
    on shared storage)."""

    def publish(self, state_dict: StateDict, step: int) -> SyncStats: ...

    def latest(self) -> tuple[StateDict, int] | None: ...

    def reader(self) -> "WeightSync": ...

    def truncate_after(self, step: int) -> None:
        """Forget steps newer than `step` (a resume from the checkpoint of `step`)."""
        ...


def map_tensors(state_dict: StateDict, fn) -> StateDict:
    """`fn` of each tensor, called once for keys that are views of one tensor (a tied embedding
    and LM head), so their results stay one tensor: a tied head is not copied twice."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for key, value in state_dict.items():
        tie = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
               tuple(value.stride()), value.dtype, value.device)
        if tie not in done:
            done[tie] = fn(value)
        out[key] = done[tie]
    return out


def distinct_bytes(state_dict: StateDict) -> int:
    """Bytes the tensors of `state_dict` hold, a tensor shared by several keys counted once."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in state_dict.values()}.values())


def detached_copy(state_dict: StateDict) -> StateDict:
    return map_tensors(state_dict, lambda v: v.detach().to("cpu", copy=True).contiguous())


class InProcessWeightSync:
    """A detached copy behind a lock; `latest` hands out that copy (treat it as read-only)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: tuple[StateDict, int] | None = None

    def publish(self, state_dict: StateDict, step: int) -> SyncStats:
        start = time.perf_counter()
        copy = detached_copy(state_dict)
        with self._lock:
            self._current = (copy, step)
        return SyncStats(step, distinct_bytes(copy), time.perf_counter() - start, "inprocess", len(copy))

    def latest(self) -> tuple[StateDict, int] | None:
        with self._lock:
            return self._current

    def reader(self) -> "InProcessWeightSync":
        return self

    def truncate_after(self, step: int) -> None:
        with self._lock:
            if self._current is not None and self._current[1] > step:
                self._current = None


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_VIEW[t.element_size()])


def _encode(tensors: StateDict, meta: dict) -> bytes:
    return zlib.compress(st_save(tensors, metadata={"atelier": json.dumps(meta)}), 1)


def _decode(blob: bytes) -> tuple[StateDict, dict]:
    raw = zlib.decompress(blob)
    header_len = int.from_bytes(raw[:8], "little")  # safetensors: u64 header size, JSON header
    header = json.loads(raw[8:8 + header_len])
    meta = json.loads(header.get("__metadata__", {}).get("atelier", "{}"))
    return st_load(raw), meta


class DeltaChainWeightSync:
    """XOR-delta chain on a shared directory; see the module docstring."""

    def __init__(self, root: str | Path, *, full_every: int = 10, keep_chains: int = 2) -> None:
        if full_every < 1:
            raise ValueError("full_every must be >= 1")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.full_every = full_every
        self.keep_chains = keep_chains
        self._prev: StateDict | None = None       # writer: bits of the last publish
        self._prev_step: int | None = None
        self._read: tuple[StateDict, int] | None = None  # reader cache

    # --- files -------------------------------------------------------------
    def _steps(self) -> list[tuple[int, str]]:
        found = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m:
                found.append((int(m.group(1)), m.group(2)))
        return sorted(found)

    def _path(self, step: int, kind: str) -> Path:
        return self.root / f"step-{step:08d}.{kind}"

    def reader(self) -> "DeltaChainWeightSync":
        """A reader with its own cache over the same directory (a writer's cache is its last publish)."""
        return DeltaChainWeightSync(self.root, full_every=self.full_every, keep_chains=self.keep_chains)

    def truncate_after(self, step: int) -> None:
        """Delete steps newer than `step` (resume from a checkpoint at `step`)."""
        for s, kind in self._steps():
            if s > step:
                self._path(s, kind).unlink(missing_ok=True)
        self._prev = self._prev_step = None
        self._read = None

    # --- writer ------------------------------------------------------------
    def publish(self, state_dict: StateDict, step: int) -> SyncStats:
        start = time.perf_counter()
        bits = {k: _bits(v.detach().cpu()).clone() for k, v in state_dict.items()}
        if self._prev is None:
            rebuilt = self.latest()
            if rebuilt is not None and rebuilt[1] < step:
                self._prev = {k: _bits(v) for k, v in rebuilt[0].items()}
                self._prev_step = rebuilt[1]
        if self._prev_step is not None and step <= self._prev_step:
            raise ValueError(f"publish steps must increase: {step} after {self._prev_step}")
        full = publish_kind(step, full_every=self.full_every, has_previous=self._prev is not None,
                            same_keys=self._prev is None or set(self._prev) == set(bits)) == FULL
        dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in state_dict.items()}
        if full:
            kind, payload = "full", bits
        else:
            kind = "delta"
            payload = {k: torch.bitwise_xor(b, self._prev[k]) for k, b in bits.items()
                       if not torch.equal(b, self._prev[k])}
        blob = _encode(payload, {"step": step, "dtypes": dtypes, "base": self._prev_step})
        path = self._path(step, kind)
        atomic_write(path, blob)
        self._prev, self._prev_step = bits, step
        if full:
            self._prune()
        return SyncStats(step, len(blob), time.perf_counter() - start, kind, len(payload))

    def _prune(self) -> None:
        fulls = [s for s, kind in self._steps() if kind == "full"]
        if len(fulls) <= self.keep_chains:
            return
        cutoff = fulls[-self.keep_chains]
        for s, kind in self._steps():
            if s < cutoff:
                self._path(s, kind).unlink(missing_ok=True)

    # --- reader ------------------------------------------------------------
    def latest(self) -> tuple[StateDict, int] | None:
        steps = self._steps()
        if not steps:
            return None
        newest = steps[-1][0]
        held = None if self._read is None else self._read[1]
        try:
            base, deltas = chain_reads(steps, held)
        except ValueError:
            raise RuntimeError(f"delta chain in {self.root} has no full snapshot") from None
        if base is None and not deltas:
            return self._read
        if base is None:
            bits = {k: _bits(v).clone() for k, v in self._read[0].items()}
            dtypes = {k: v.dtype for k, v in self._read[0].items()}
        else:
            bits, meta = _decode(self._path(base, "full").read_bytes())
            dtypes = {k: getattr(torch, d) for k, d in meta["dtypes"].items()}
        for s in deltas:
            payload, meta = _decode(self._path(s, "delta").read_bytes())
            for k, x in payload.items():
                bits[k] = torch.bitwise_xor(bits[k], x)
        state = {k: b.view(dtypes[k]) for k, b in bits.items()}
        self._read = (state, newest)
        return self._read


def make_weight_sync(kind: str, root: str | Path | None = None, full_every: int = 10) -> WeightSync:
    """The writer side of `sync.kind`; readers come from its `reader()`."""
    if kind == "inprocess":
        return InProcessWeightSync()
    if kind == "delta":
        if root is None:
            raise ValueError("the delta-chain weight sync needs a directory")
        return DeltaChainWeightSync(root, full_every=full_every)
    raise ValueError(f"unknown weight sync {kind!r}")


__all__ = ["DeltaChainWeightSync", "InProcessWeightSync", "SyncStats", "WeightSync",
           "detached_copy", "distinct_bytes", "make_weight_sync", "map_tensors"]
