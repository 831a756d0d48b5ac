"""Documents of the pretraining mixture: listing, exact dedup, held-out split.

`list_documents` walks every source in a fixed (sorted) order and returns
`Doc` records: where the text is, its repository and its split. The split is
decided per *repository* (for a code directory, each first-level entry under
its root), never per file or line, so held-out code is code the model has
not seen any part of. Exact duplicates (same SHA-256 of the text) are kept
once, first occurrence wins, across all sources: stdlib files vendored in
site-packages are not trained on twice.
"""

from __future__ import annotations

import glob
import hashlib
import json
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from atelier.errors import AtelierError
from atelier.pretrain.config import DataConfig, SourceConfig

TRAIN, HELDOUT = "train", "heldout"


class DataError(AtelierError):
    """A data source that cannot be read or gives no usable documents."""


@dataclass(frozen=True)
class Doc:
    source: str
    ref: str          # code: file path; jsonl: "path:line"; hf: row index
    repo: str         # the unit of the held-out split
    repo_path: str    # code: the repository's directory or file; else ""
    split: str
    sha: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> "Doc":
        return cls(**json.loads(line))


def source_root(source: SourceConfig) -> Path:
    """The directory a code source reads, with "stdlib"/"site-packages" resolved."""
    special = {"stdlib": "stdlib", "site-packages": "purelib"}
    root = source.root or ""
    path = Path(sysconfig.get_paths()[special[root]]) if root in special else Path(root).expanduser()
    if not path.is_dir():
        raise DataError(f"source '{source.name}': root {path} is not a directory",
                        hint="set root to a directory of code, or to \"stdlib\" / \"site-packages\"")
    return path.resolve()


def heldout_score(key: str, seed: int) -> float:
    """A stable uniform number in [0, 1) for a repository key."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def list_documents(config: DataConfig) -> tuple[list[Doc], dict[str, int]]:
    """Every unique document of every source, in order, with its split; and counts."""
    raw: list[tuple[str, str, str, str, str]] = []  # source, ref, repo key, repo path, sha
    seen: set[str] = set()
    duplicates = 0
    for source in config.sources:
        found = 0
        for ref, repo, repo_path, text in _iter_source(source):
            sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
            if sha in seen:
                duplicates += 1
                continue
            seen.add(sha)
            raw.append((source.name, ref, f"{source.name}/{repo}", repo_path, sha))
            found += 1
            if source.max_docs is not None and found >= source.max_docs:
                break
        if found == 0:
            raise DataError(f"source '{source.name}' gives no documents",
                            hint=_empty_hint(source))
    heldout = _heldout_repos(sorted({r[2] for r in raw}), config)
    docs = [Doc(s, ref, repo, path, HELDOUT if repo in heldout else TRAIN, sha)
            for s, ref, repo, path, sha in raw]
    return docs, {"documents": len(docs), "duplicates": duplicates,
                  "repos": len({d.repo for d in docs}), "heldout_repos": len(heldout)}


def _heldout_repos(repos: list[str], config: DataConfig) -> set[str]:
    if config.heldout_fraction == 0 or len(repos) < 2:
        return set()
    scored = sorted(repos, key=lambda r: heldout_score(r, config.seed))
    chosen = {r for r in repos if heldout_score(r, config.seed) < config.heldout_fraction}
    return chosen or {scored[0]}  # always hold out one repository when asked to


def read_text(doc: Doc, sources: dict[str, SourceConfig]) -> str:
    """The text of a listed document (read again: the listing keeps only references)."""
    source = sources[doc.source]
    if source.kind == "code":
        return Path(doc.ref).read_text(encoding="utf-8")
    if source.kind == "jsonl":
        path, _, line_no = doc.ref.rpartition(":")
        with open(path, encoding="utf-8") as handle:
            for i, line in enumerate(handle):
                if i == int(line_no):
                    return str(json.loads(line)[source.text_field])
        raise DataError(f"{doc.ref}: line vanished since the corpus was listed")
    return str(_hf_rows(source)[int(doc.ref)][source.text_field])


def _iter_source(source: SourceConfig) -> Iterator[tuple[str, str, str, str]]:
    if source.kind == "code":
        yield from _iter_code(source)
    elif source.kind == "jsonl":
        yield from _iter_jsonl(source)
    else:
        for i, row in enumerate(_hf_rows(source)):
            text = row.get(source.text_field)
            if isinstance(text, str) and text.strip():
                repo = str(row.get(source.repo_field, i)) if source.repo_field else str(i)
                yield str(i), repo, "", text


def _iter_code(source: SourceConfig) -> Iterator[tuple[str, str, str, str]]:
    root = source_root(source)
    files: set[Path] = set()
    for pattern in source.include:
        files.update(p for p in root.glob(pattern) if p.is_file())
    for pattern in source.exclude:
        files.difference_update(root.glob(pattern))
    for path in sorted(files):
        rel = path.relative_to(root)
        if any(part in {"__pycache__", ".git"} for part in rel.parts):
            continue
        if path.stat().st_size > source.max_file_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: not code we can train on
        if not text.strip():
            continue
        repo = rel.parts[0]
        yield str(path), repo, str(root / repo), text


def _iter_jsonl(source: SourceConfig) -> Iterator[tuple[str, str, str, str]]:
    paths = sorted(glob.glob(str(Path(source.path or "").expanduser())))
    if not paths:
        raise DataError(f"source '{source.name}': no file matches {source.path}",
                        hint="set path to a JSONL file or a glob of them")
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for i, line in enumerate(handle):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    text = row[source.text_field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DataError(f"{path}:{i + 1}: not a JSON object with a '{source.text_field}' field",
                                    hint="each line must be like {\"text\": \"...\"}; "
                                         "or set text_field") from None
                if isinstance(text, str) and text.strip():
                    ref = f"{path}:{i}"
                    repo = str(row.get(source.repo_field, ref)) if source.repo_field else ref
                    yield ref, repo, "", text


_HF_CACHE: dict[tuple, object] = {}


def _hf_rows(source: SourceConfig):
    try:
        import datasets  # optional dependency
    except ImportError:
        raise DataError(f"source '{source.name}' is a Hugging Face dataset, but `datasets` is not installed",
                        hint="pip install datasets, or export the data to JSONL and use kind = \"jsonl\"") from None
    key = (source.dataset, source.dataset_config, source.split)
    if key not in _HF_CACHE:
        try:
            _HF_CACHE[key] = datasets.load_dataset(source.dataset, source.dataset_config, split=source.split)
        except (OSError, ValueError) as exc:   # not found, unreachable hub, bad config or split
            raise DataError(f"source '{source.name}': cannot load the Hugging Face dataset {source.dataset!r} "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                            hint="check its name, config and split, that the hub is reachable or the "
                                 "dataset cached, or export it to JSONL and use kind = \"jsonl\"") from None
    return _HF_CACHE[key]


def _empty_hint(source: SourceConfig) -> str:
    if source.kind == "code":
        return f"check root and include (now {source.include}); files over max_file_bytes are skipped"
    return f"check that the documents have a non-empty '{source.text_field}' field"
