"""How big a suite's tasks are, beside the reference figures (pure).

`patch_stats(text)` counts a unified diff's changed lines (`+`/`-` lines,
the `+++`/`---` headers excluded) and changed files; `suite_stats(tasks)`
gives task counts per source and the medians of prompt characters, changed
lines and changed files, all from `gold.patch`, never from the metadata a
builder wrote. `REFERENCE` holds the figures printed beside them.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Iterable

from atelier.tasks.schema import Task

REFERENCE = {
    "reference benchmark": {"prompt_chars": 390, "lines_changed": 181},
    "SWE-bench": {"lines_changed": "7-10"},
}
"""Medians of the tasks we aim to resemble (prompt characters, changed lines)."""


@dataclasses.dataclass(frozen=True)
class PatchStats:
    files: int
    added: int
    removed: int

    @property
    def lines(self) -> int:
        return self.added + self.removed


_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def patch_stats(patch_text: str) -> PatchStats:
    """Changed files and lines of a unified (git) diff. Lines inside a hunk
    (as long as its `@@ -a,b +c,d @@` header says) starting with `+`/`-`
    count; file headers (`---`/`+++`, `diff --git`, `index`, mode lines) do
    not, even when a removed line itself starts with `--`. Binary and
    mode-only changes count as files."""
    files: set[str] = set()
    added = removed = 0
    old_left = new_left = 0
    for line in patch_text.splitlines():
        if old_left > 0 or new_left > 0:
            if line.startswith("+"):
                added, new_left = added + 1, new_left - 1
            elif line.startswith("-"):
                removed, old_left = removed + 1, old_left - 1
            elif line.startswith("\\"):
                pass  # "\ No newline at end of file"
            else:
                old_left, new_left = old_left - 1, new_left - 1
            continue
        hunk = _HUNK.match(line)
        if hunk:
            old_left = int(hunk.group(1) or 1)
            new_left = int(hunk.group(2) or 1)
        elif line.startswith("diff --git "):
            files.add(line.rsplit(" ", 1)[-1].removeprefix("b/"))
        elif line.startswith(("--- ", "+++ ")):
            path = line[4:].split("\t", 1)[0]
            if path != "/dev/null":
                files.add(path.removeprefix("a/").removeprefix("b/"))
    return PatchStats(len(files), added, removed)


def _median(values: list[int]) -> float | None:
    return float(statistics.median(values)) if values else None


def suite_stats(tasks: Iterable[Task]) -> dict:
    """Counts per source and medians over `tasks` (None when there are none)."""
    tasks = list(tasks)
    sources: dict[str, int] = {}
    for t in tasks:
        sources[t.metadata.source] = sources.get(t.metadata.source, 0) + 1
    patches = [patch_stats(t.gold_patch) for t in tasks]
    return {
        "tasks": len(tasks),
        "sources": dict(sorted(sources.items())),
        "median_prompt_chars": _median([len(t.prompt) for t in tasks]),
        "median_lines_changed": _median([p.lines for p in patches]),
        "median_files_changed": _median([p.files for p in patches]),
        "reference": REFERENCE,
    }
