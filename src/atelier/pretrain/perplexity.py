"""Codebase perplexity: NLL per token over a whole repository, rolling window.

The repository's files (those matching `include`) are concatenated in
alphabetical order of their relative paths, each followed by a blank line,
and tokenized once. Windows of `window` tokens start every `stride` tokens;
each window scores only the tokens no earlier window scored, so every token
after the first is scored exactly once, with between `window - stride` and
`window - 1` tokens of context (the first window: all it has).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from atelier.errors import AtelierError


class EvalError(AtelierError):
    """Eval input that cannot be evaluated (no files, bad window)."""


def repo_files(repo: str | Path, include: Sequence[str] = ("**/*.py",)) -> list[Path]:
    root = Path(repo)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise EvalError(f"repository {root} does not exist", hint="pass --repo DIRECTORY")
    files: set[Path] = set()
    for pattern in include:
        files.update(p for p in root.glob(pattern)
                     if p.is_file() and not {"__pycache__", ".git"} & set(p.relative_to(root).parts))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def repo_text(repo: str | Path, include: Sequence[str] = ("**/*.py",)) -> str:
    parts = []
    for path in repo_files(repo, include):
        try:
            parts.append(path.read_text(encoding="utf-8") + "\n\n")
        except UnicodeDecodeError:
            continue
    if not parts:
        raise EvalError(f"repository {repo} has no readable files matching {list(include)}",
                        hint="choose another repository or widen the include globs")
    return "".join(parts)


def rolling_nll(model, ids: Sequence[int], window: int, stride: int, device: str = "cpu") -> tuple[float, int]:
    """Summed NLL (nats) of tokens 1..N-1 and how many were scored."""
    import torch
    import torch.nn.functional as F

    if not 0 < stride < window:
        raise EvalError(f"stride {stride} must be positive and below the window {window}",
                        hint="e.g. window = 512, stride = 256")
    ids_N = torch.tensor(list(ids), dtype=torch.long, device=device)
    n = len(ids_N)
    total, count, prev_end = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for begin in range(0, max(n - 1, 1), stride):
            end = min(begin + window, n)
            first = max(prev_end, begin + 1)  # first token this window scores
            if first < end:
                logits_SV = model(input_ids=ids_N[None, begin:end]).logits[0].float()
                logprobs = F.log_softmax(logits_SV[first - begin - 1:end - begin - 1], dim=-1)
                targets = ids_N[first:end]
                total -= float(logprobs.gather(1, targets[:, None]).sum())
                count += end - first
            prev_end = end
            if end == n:
                break
    return total, count


def codebase_perplexity(model, tokenizer, repo: str | Path, *, window: int = 512, stride: int = 256,
                        include: Sequence[str] = ("**/*.py",), max_tokens: int | None = None,
                        device: str = "cpu") -> dict[str, Any]:
    """NLL per token of `model` over the concatenated repository (its first `max_tokens` tokens)."""
    ids = tokenizer(repo_text(repo, include), add_special_tokens=False)["input_ids"]
    truncated = max_tokens is not None and len(ids) > max_tokens
    ids = ids[:max_tokens] if truncated else ids
    total, count = rolling_nll(model, ids, window, stride, device)
    nll = total / max(count, 1)
    return {"repo": str(repo), "tokens": len(ids), "scored": count, "truncated": truncated,
            "nll_per_token": nll, "perplexity": math.exp(min(nll, 50.0))}
