"""State tracking (LoCoDiff-like): rebuild a file after a chain of unified diffs.

Histories are generated from real files: each step deletes, inserts or
rewrites a few lines (inserted lines come from the same file, so they look
like the code around them), and the step's unified diff is recorded. The
model sees the original file and the diffs in order, and writes the final
file; greedy decoding. The score is the character-level edit similarity
1 - levenshtein(prediction, truth) / max(len), 1.0 for an exact rebuild.
"""

from __future__ import annotations

import difflib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

END = "</final>"


def levenshtein(a: str, b: str) -> int:
    """Character edit distance (insert, delete, substitute; each costs 1).

    One numpy pass per character of the longer string: substitutions and
    deletions come from the previous row; insertions within a row are a
    running minimum, cur[j] = j + min_{k<=j}(x[k] - k).
    """
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    b_codes = np.frombuffer(b.encode("utf-32-le"), dtype=np.uint32)
    j = np.arange(len(b) + 1)
    prev = j.copy()
    x = np.empty(len(b) + 1, dtype=np.int64)
    for ch in a:
        cost = (b_codes != ord(ch)).astype(np.int64)
        x[0] = prev[0] + 1
        np.minimum(prev[1:] + 1, prev[:-1] + cost, out=x[1:])
        prev = j + np.minimum.accumulate(x - j)
    return int(prev[-1])


def edit_similarity(prediction: str, truth: str) -> float:
    """1 - edit distance / length of the longer string; two empty strings score 1."""
    longest = max(len(prediction), len(truth))
    return 1.0 if longest == 0 else 1.0 - levenshtein(prediction, truth) / longest


@dataclass
class History:
    name: str
    original: str
    diffs: list[str]
    final: str

    def prompt(self) -> str:
        parts = [f"Below is the file {self.name} and a sequence of unified diffs applied to it in order. "
                 "Write the file as it is after the last diff.\n\n"
                 f"<original>\n{self.original}</original>\n"]
        for i, diff in enumerate(self.diffs, 1):
            parts.append(f"\n<diff {i}>\n{diff}</diff {i}>\n")
        parts.append("\nThe final file:\n<final>\n")
        return "".join(parts)


def _mutate(lines: list[str], rng: random.Random, donors: list[str]) -> list[str]:
    out = list(lines)
    for _ in range(rng.randint(1, 3)):
        op = rng.choice(["delete", "insert", "rewrite"]) if out else "insert"
        at = rng.randrange(len(out)) if out else 0
        if op == "delete":
            del out[at]
        elif op == "insert":
            out.insert(at, rng.choice(donors))
        else:
            words = out[at].rstrip("\n").split(" ")
            k = rng.randrange(len(words))
            words[k] = words[k][::-1] if len(words[k]) > 1 else words[k] + "_x"
            out[at] = " ".join(words) + "\n"
    return out


def make_history(name: str, text: str, n_diffs: int, seed: int) -> History:
    """A chain of `n_diffs` random line edits of `text`, as unified diffs."""
    rng = random.Random(f"{seed}:{name}")
    text = text if text.endswith("\n") else text + "\n"
    versions = [text.splitlines(keepends=True)]
    donors = [line for line in versions[0] if line.strip()] or ["pass\n"]
    diffs = []
    while len(diffs) < n_diffs:
        new = _mutate(versions[-1], rng, donors)
        diff = "".join(difflib.unified_diff(versions[-1], new, f"a/{name}", f"b/{name}"))
        if diff:
            diffs.append(diff)
            versions.append(new)
    return History(name, text, diffs, "".join(versions[-1]))


def histories_from_files(files: Sequence[Path], count: int, n_diffs: int, max_chars: int,
                         seed: int) -> list[History]:
    """`count` histories from the shortest-enough files, picked in a seeded order."""
    usable = []
    for path in sorted(files):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if 3 <= len(text.splitlines()) and len(text) <= max_chars:
            usable.append((path, text))
    if len(usable) < count:  # too few small files: take the heads of long ones
        for path in sorted(files):
            if len(usable) >= count:
                break
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            head = "".join(text.splitlines(keepends=True)[:40])[:max_chars]
            if len(text) > max_chars and len(head.splitlines()) >= 3:
                usable.append((path, head))
    random.Random(seed).shuffle(usable)
    return [make_history(path.name, text, n_diffs, seed) for path, text in usable[:count]]


def complete(model, tokenizer, prompt: str, max_new_tokens: int, device: str = "cpu") -> str:
    """Greedy continuation of `prompt`, cut at the closing tag."""
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return text.split(END, 1)[0]


def state_tracking(model, tokenizer, histories: Sequence[History], max_new_tokens: int,
                   device: str = "cpu") -> dict[str, Any]:
    items = []
    for history in histories:
        budget = min(max_new_tokens, len(tokenizer(history.final, add_special_tokens=False)["input_ids"]) + 16)
        prediction = complete(model, tokenizer, history.prompt(), budget, device)
        items.append({"file": history.name, "diffs": len(history.diffs), "chars": len(history.final),
                      "score": edit_similarity(prediction, history.final), "exact": prediction == history.final})
    mean = sum(i["score"] for i in items) / len(items) if items else None
    return {"mean_score": mean, "items": items}
