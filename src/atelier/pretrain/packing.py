"""Tokenize documents once into memory-mapped token shards; read packed rows back.

A *stream* is the concatenation of its documents' tokens, each followed by
the end-of-text token, stored flat across shard files of `shard_tokens`
tokens (`uint16` when the vocabulary fits, else `uint32`). A packed row of
length S is simply tokens[i*S : (i+1)*S] of the stream, so one tokenization
serves every sequence length: the long-context phase reads rows of k*L from
the same shards. Only the stream's last, partial shard is shorter.

Building is resumable. After each full shard is written (temporary file,
then rename) the stream's manifest is rewritten the same way; it records the
shards done, how many documents they consumed and the file holding the
tokens carried over into the next shard. A build killed at any moment
restarts from the last manifest and produces byte-identical shards: no token
is lost or written twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from atelier.fsio import atomic_write

MANIFEST = "manifest.json"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _write_atomic(path: Path, data: bytes) -> None:
    atomic_write(path, data)


def build_stream(
    out_dir: str | Path,
    texts: Sequence[Callable[[], str]] | Sequence[str],
    encode: Callable[[list[str]], list[list[int]]],
    *,
    eos_id: int,
    vocab_size: int,
    shard_tokens: int,
    fingerprint: str = "",
    batch_docs: int = 64,
    progress: Callable[[int], None] | None = None,
    stop_after_shards: int | None = None,
) -> dict:
    """Tokenize `texts` (strings, or thunks that read one) into shards under `out_dir`.

    `encode` maps a batch of strings to token id lists. Returns the final
    manifest. `stop_after_shards` ends the call early, as a kill would, once
    that many shards exist (tests use it to exercise resume).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    manifest = _load_manifest(out, fingerprint, dtype, shard_tokens)
    if manifest["complete"]:
        return manifest
    carry = (np.fromfile(out / manifest["carry"], dtype=dtype)
             if manifest["carry"] else np.zeros(0, dtype=dtype))
    buffer: list[np.ndarray] = [carry]
    buffered = len(carry)
    start = manifest["docs_done"]
    consumed = start
    if progress:
        progress(start)
    for begin in range(start, len(texts), batch_docs):
        batch = [t() if callable(t) else t for t in texts[begin:begin + batch_docs]]
        for ids in encode(batch):
            row = np.asarray([*ids, eos_id], dtype=dtype)
            buffer.append(row)
            buffered += len(row)
            consumed += 1
            while buffered >= shard_tokens:
                flat = np.concatenate(buffer)
                _commit_shard(out, manifest, flat[:shard_tokens], flat[shard_tokens:], consumed)
                buffer, buffered = [flat[shard_tokens:]], len(flat) - shard_tokens
                if stop_after_shards is not None and len(manifest["shards"]) >= stop_after_shards:
                    return manifest
        if progress:
            progress(consumed)
    tail = np.concatenate(buffer)
    if len(tail):
        _commit_shard(out, manifest, tail, tail[:0], consumed)
    manifest["complete"] = True
    manifest["carry"] = None
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    for carry_file in out.glob("carry-*.bin"):  # a complete stream carries nothing over
        carry_file.unlink()
    return manifest


def _load_manifest(out: Path, fingerprint: str, dtype: np.dtype, shard_tokens: int) -> dict:
    path = out / MANIFEST
    if path.exists():
        manifest = json.loads(path.read_text())
        if manifest.get("fingerprint") == fingerprint and manifest.get("shard_tokens") == shard_tokens:
            return manifest
        for stale in out.glob("shard-*.bin"):  # another corpus or tokenizer: start over
            stale.unlink()
    return {"fingerprint": fingerprint, "dtype": dtype.name, "shard_tokens": shard_tokens,
            "shards": [], "tokens": 0, "docs_done": 0, "carry": None, "complete": False}


def _commit_shard(out: Path, manifest: dict, tokens: np.ndarray, carry: np.ndarray, consumed: int) -> None:
    """Shard file, then carry file, then manifest: each step leaves a resumable state."""
    index = len(manifest["shards"])
    name = f"shard-{index:05d}.bin"
    _write_atomic(out / name, tokens.tobytes())
    carry_name = f"carry-{index:05d}.bin"
    _write_atomic(out / carry_name, carry.tobytes())
    old_carry = manifest["carry"]
    manifest["shards"].append({"file": name, "tokens": int(len(tokens))})
    manifest["tokens"] += int(len(tokens))
    manifest["docs_done"] = consumed
    manifest["carry"] = carry_name
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    if old_carry:
        (out / old_carry).unlink(missing_ok=True)


class TokenStream:
    """Read-only view of a built stream: packed rows of any length, across shards."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        manifest = json.loads((self.dir / MANIFEST).read_text())
        if not manifest["complete"]:
            raise ValueError(f"stream {self.dir} is not fully built")
        dtype = np.dtype(manifest["dtype"])
        self.shards = [np.memmap(self.dir / s["file"], dtype=dtype, mode="r")
                       for s in manifest["shards"] if s["tokens"]]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.n_tokens = int(self.starts[-1])

    def rows(self, seq_len: int) -> int:
        """How many full rows of `seq_len` tokens the stream holds."""
        return self.n_tokens // seq_len

    def tokens(self, begin: int, end: int) -> np.ndarray:
        """Tokens [begin, end) of the stream as int64, gathered across shard files."""
        parts = []
        first = int(np.searchsorted(self.starts, begin, side="right")) - 1
        for i in range(max(first, 0), len(self.shards)):
            lo, hi = self.starts[i], self.starts[i + 1]
            if lo >= end:
                break
            parts.append(self.shards[i][max(begin, lo) - lo:min(end, hi) - lo])
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def row(self, index: int, seq_len: int) -> np.ndarray:
        return self.tokens(index * seq_len, (index + 1) * seq_len)


def all_tokens(directory: str | Path) -> np.ndarray:
    """Every token of a built stream, in order (for checks, not training)."""
    stream = TokenStream(directory)
    return stream.tokens(0, stream.n_tokens)


def encode_with(tokenizer) -> Callable[[Iterable[str]], list[list[int]]]:
    """A batch encoder for `build_stream` that adds no special tokens."""

    def encode(texts: Iterable[str]) -> list[list[int]]:
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"]

    return encode
