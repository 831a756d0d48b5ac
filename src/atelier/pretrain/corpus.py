"""The packed corpus of a run: one token stream per source for training, one held out.

Layout of the data directory::

    corpus.json              fingerprint, counts, held-out repositories
    docs.jsonl               the document listing, fixed at first build
    train/<source>/          shards + manifest (see packing.py)
    heldout/                 every source's held-out documents, one stream

The listing is written once, so a resumed build tokenizes exactly the
documents the first attempt listed even if the directories changed since.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from atelier.pretrain.config import DataConfig
from atelier.pretrain.packing import TokenStream, build_stream, encode_with
from atelier.pretrain.sources import HELDOUT, TRAIN, DataError, Doc, list_documents, read_text


@dataclass
class Corpus:
    dir: Path
    train: dict[str, TokenStream]      # source name -> stream
    heldout: TokenStream | None
    info: dict

    @property
    def heldout_repos(self) -> list[str]:
        """Directories (or files) of held-out code repositories, for codebase perplexity."""
        return self.info["heldout_repo_paths"]


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def build_corpus(config: DataConfig, tokenizer, data_dir: str | Path, *, quiet: bool = False,
                 stop_after_shards: int | None = None) -> Corpus:
    """List, dedup, split and tokenize the mixture into `data_dir` (resuming a partial build)."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    recipe = json.dumps(config.model_dump(mode="json", exclude={"cache_dir"}), sort_keys=True)
    fingerprint = hashlib.sha256((recipe + tokenizer_fingerprint(tokenizer)).encode()).hexdigest()[:16]
    info_path = data_dir / "corpus.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    if info.get("fingerprint") != fingerprint:
        if info:
            raise DataError(f"{data_dir} holds a corpus built from another data recipe or tokenizer",
                            hint="use a fresh data.cache_dir, or delete that directory to rebuild")
        docs, counts = list_documents(config)
        (data_dir / "docs.jsonl").write_text("".join(d.to_json() + "\n" for d in docs))
        repo_paths = sorted({d.repo_path for d in docs if d.split == HELDOUT and d.repo_path})
        info = {"fingerprint": fingerprint, **counts, "heldout_repo_paths": repo_paths}
        info_path.write_text(json.dumps(info, indent=1) + "\n")
    docs = [Doc.from_json(line) for line in (data_dir / "docs.jsonl").read_text().splitlines()]
    sources = {s.name: s for s in config.sources}
    groups = {f"{TRAIN}/{s.name}": [d for d in docs if d.source == s.name and d.split == TRAIN]
              for s in config.sources}
    groups[HELDOUT] = [d for d in docs if d.split == HELDOUT]
    encode = encode_with(tokenizer)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no end-of-text token to separate documents",
                        hint="use a tokenizer with an eos_token")
    progress = _progress(quiet)
    with progress:
        for name, group in groups.items():
            if not group:
                continue
            task = progress.add_task(f"tokenize {name}", total=len(group))
            thunks = [lambda d=d: read_text(d, sources) for d in group]
            manifest = build_stream(
                data_dir / name, thunks, encode, eos_id=eos, vocab_size=len(tokenizer),
                shard_tokens=config.shard_tokens, fingerprint=fingerprint,
                progress=lambda n, task=task: progress.update(task, completed=n),
                stop_after_shards=stop_after_shards)
            if not manifest["complete"]:
                return Corpus(data_dir, {}, None, info)  # stopped early on purpose
    train = {s.name: TokenStream(data_dir / TRAIN / s.name) for s in config.sources
             if groups[f"{TRAIN}/{s.name}"]}
    missing = [s.name for s in config.sources if s.name not in train]
    if missing:
        raise DataError(f"sources {missing} have every repository held out: nothing to train on",
                        hint="add repositories to them or lower data.heldout_fraction")
    heldout = TokenStream(data_dir / HELDOUT) if groups[HELDOUT] else None
    info["tokens"] = {name: s.n_tokens for name, s in train.items()}
    info["heldout_tokens"] = heldout.n_tokens if heldout else 0
    return Corpus(data_dir, train, heldout, info)


def _progress(quiet: bool):
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), disable=quiet, transient=False)
