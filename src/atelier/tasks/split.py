"""Tasks set apart from each other: held-out tasks from training ones, or the train tasks
one stage takes from those another takes (pure).

A split by *file* keeps the source files a task's gold patch changes
(`task_files`) on one side: tasks linked by a shared file, directly or through
others, form one component, and a component goes whole to one side, so no
held-out task asks for a fix in a file a training task fixes
(`split_by_file`). A *random* split is a seeded sample. `hold_apart` picks one
of the two; `train_extras` keeps, of tasks built for the train side alone,
those that respect a split already chosen.
"""

from __future__ import annotations

import random
from typing import Mapping, Sequence

from atelier.tasks.schema import Task
from atelier.tasks.swebench import patch_files


def task_files(task: Task) -> set[str]:
    """The source files a task's gold patch changes: what the file split keeps apart.

    Hidden test modules are left out on purpose: one mutation can break tests
    in several modules (funcy's `flow.py` breaks five), and linking tasks by
    them joins nearly every task into one component. A held-out task may so
    be graded by a test module that also grades a training task; the code to
    fix is never shared."""
    return set(patch_files(task.gold_patch))


def train_extras(extra: Sequence[str], files: Mapping[str, set[str]], held_out: set[str], split: str) -> list[str]:
    """Of tasks built after those a split was chosen from (`extra`, in build order), the ones the
    train side may take: with `split = "file"`, those that share no file with a held-out task, so
    the split's promise holds for them too; otherwise all."""
    if split != "file":
        return list(extra)
    held = set().union(*(files[i] for i in held_out))
    return [i for i in extra if not files[i] & held]


def hold_apart(files: Mapping[str, set[str]], count: int, seed: int, split: str) -> set[str]:
    """At most `count` of the tasks in `files` (id -> source files), set apart from the rest:
    held-out tasks from train ones, or the train tasks SFT replays from those RL trains on.
    `split`: "file" (`split_by_file`: no file shared across) or "random" (a seeded sample)."""
    if split == "file":
        return split_by_file(files, count, seed)
    return set(random.Random(seed).sample(sorted(files), min(count, len(files) - 1)))


def split_by_file(files: Mapping[str, set[str]], test_count: int, seed: int) -> set[str]:
    """Held-out task ids sharing no file with the rest.

    Tasks linked by a shared file, directly or through others, form one
    component, and a component goes whole to one side: so no held-out task
    shares a file with a training task. Components are taken in a seeded
    order while they fit in `test_count`; the result may hold fewer (never
    more) when no remaining component fits, and is empty when every task is
    linked to every other."""
    parent = {t: t for t in files}

    def find(t: str) -> str:
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    owner: dict[str, str] = {}
    for task in sorted(files):
        for f in sorted(files[task]):
            if f in owner:
                parent[find(task)] = find(owner[f])
            else:
                owner[f] = task
    components: dict[str, list[str]] = {}
    for task in sorted(files):
        components.setdefault(find(task), []).append(task)
    order = sorted(components.values())
    random.Random(seed).shuffle(order)
    if len(order) < 2:
        return set()
    test: set[str] = set()
    for comp in order:
        if len(test) + len(comp) <= min(test_count, len(files) - 1):
            test.update(comp)
    return test
