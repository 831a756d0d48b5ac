"""Load tasks and suites, checking everything a grader will rely on.

Every problem becomes a `TaskError` that names the task, the field or file,
and the fix. A suite is a directory of task directories, listed by an
`index.toml` (`tasks = ["a", "b"]`, paths relative to the suite) or, without
one, every subdirectory that holds a `task.toml`. Suite loading reports all
broken tasks at once.
"""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

from pydantic import Field

from atelier.config import AtelierConfig, ConfigError, load_config
from atelier.tasks.schema import Task, TaskError, TaskSpec, node_file

TASK_FILE = "task.toml"
INDEX_FILE = "index.toml"


class SuiteIndex(AtelierConfig):
    name: str = ""
    tasks: list[str] = Field(default_factory=list)
    """Task directories, relative to the suite directory."""
    splits: dict[str, str] = Field(default_factory=dict)
    """Task directory → split ("test", "train" …); a task not named here has
    no split and is left out when `load_suite` is asked for one."""


def load_task(task_dir: str | Path) -> Task:
    root = Path(task_dir).resolve()
    name = root.name
    if not root.is_dir():
        raise TaskError(f"task directory not found: {task_dir}",
                        hint="pass a directory that holds task.toml, repo/, tests/ and gold.patch")
    if not (root / TASK_FILE).is_file():
        raise TaskError(f"task {name}: no {TASK_FILE} in {root}",
                        hint="every task directory needs a task.toml (see atelier.tasks.schema)")
    try:
        spec = load_config(TaskSpec, root / TASK_FILE)
    except ConfigError as exc:
        raise TaskError(f"task {name}: {exc.message}", hint=exc.hint) from None
    name = spec.id

    def fail(message: str, hint: str) -> TaskError:
        return TaskError(f"task {name}: {message}", hint=hint)

    repo = root / "repo"
    if not repo.is_dir():
        raise fail(f"missing repo/ directory in {root}",
                   "put the repository at its base state in repo/")
    _check_no_history(repo, fail)

    if not spec.fail_to_pass:
        raise fail("fail_to_pass is empty",
                   "list at least one test node id that fails before the fix and passes after it")
    overlap = sorted(set(spec.fail_to_pass) & set(spec.pass_to_pass))
    if overlap:
        raise fail(f"tests in both fail_to_pass and pass_to_pass: {', '.join(overlap)}",
                   "a test either starts failing or starts passing; keep it in one list")
    for rel in spec.hidden_tests:
        if not _is_plain_relative(rel):
            raise fail(f"hidden_tests entry {rel!r} is not a relative path inside the repository",
                       "write paths like tests/test_x.py")
        if not (root / "tests" / rel).is_file():
            raise fail(f"hidden test file tests/{rel} is missing (named in hidden_tests)",
                       f"put the test's content at {root / 'tests' / rel}, or remove it from hidden_tests")
    for node in [*spec.fail_to_pass, *spec.pass_to_pass]:
        path = node_file(node)
        if not _is_plain_relative(path) or not path:
            raise fail(f"test id {node!r} does not start with a relative file path",
                       "use pytest node ids like tests/test_x.py::test_name")
        if path not in spec.hidden_tests and not (repo / path).is_file():
            raise fail(f"test id {node!r}: file {path} is neither a hidden test nor in repo/",
                       "add the file to hidden_tests (and tests/), or fix the node id")

    gold = root / "gold.patch"
    if not gold.is_file():
        raise fail(f"missing gold.patch in {root}", "write the reference fix as a unified diff there")
    gold_text = gold.read_bytes().decode("utf-8")  # as written: a CRLF file's patch keeps its \r
    if not gold_text.strip():
        raise fail("gold.patch is empty", "a task needs a reference fix that makes fail_to_pass pass")
    return Task(**spec.model_dump(), root=root, snapshot=repo, gold_patch=gold_text)


def load_suite(suite_dir: str | Path, split: str | None = None) -> list[Task]:
    """Load every task of a suite (only those of `split` when given: needs an
    index with splits); all broken tasks are reported together."""
    root = Path(suite_dir).resolve()
    if not root.is_dir():
        raise TaskError(f"suite directory not found: {suite_dir}",
                        hint="pass a directory of task directories")
    if (root / INDEX_FILE).is_file():
        try:
            index = load_config(SuiteIndex, root / INDEX_FILE)
        except ConfigError as exc:
            raise TaskError(f"suite {root.name}: {exc.message}", hint=exc.hint) from None
        rels = index.tasks
        if split is not None:
            rels = [rel for rel in rels if index.splits.get(rel) == split]
            if not rels:
                known = sorted(set(index.splits.values()))
                raise TaskError(f"suite {root.name}: no task in split {split!r}",
                                hint="splits in its index: " + (", ".join(known) or "none"))
        dirs = [root / rel for rel in rels]
    elif split is not None:
        raise TaskError(f"suite {root.name}: no {INDEX_FILE}, so no split {split!r}",
                        hint="build the suite with `atelier tasks build --suite`, which writes splits")
    else:
        dirs = sorted(p.parent for p in root.glob(f"*/{TASK_FILE}"))
    if not dirs:
        raise TaskError(f"suite {root.name}: no tasks found in {root}",
                        hint=f"add task directories (each with {TASK_FILE}) or an {INDEX_FILE}")
    tasks, problems, seen = [], [], {}
    for d in dirs:
        try:
            task = load_task(d)
        except TaskError as exc:
            problems.append(str(exc))
            continue
        if task.id in seen:
            problems.append(f"task id {task.id!r} is used by both {seen[task.id]} and {d}")
            continue
        seen[task.id] = d
        tasks.append(task)
    if problems:
        head = problems[0] if len(problems) == 1 else (
            f"{len(problems)} broken tasks in suite {root.name}:\n  - " + "\n  - ".join(problems))
        raise TaskError(head, hint="fix each task named above; `atelier tasks show DIR` checks one")
    return tasks


def _is_plain_relative(rel: str) -> bool:
    p = PurePosixPath(rel)
    return bool(rel) and not p.is_absolute() and ".." not in p.parts and "\\" not in rel


def _check_no_history(repo: Path, fail) -> None:
    """A snapshot may hold a `.git` with at most one commit: any more could
    carry the answer (`git log -S`). Unreachable commits count too."""
    dot_git = repo / ".git"
    if not dot_git.exists() and not dot_git.is_symlink():
        return
    if not dot_git.is_dir() or dot_git.is_symlink():
        raise fail("repo/.git is a file or link (a worktree or submodule pointer)",
                   "remove repo/.git, or make it a standalone repository with a single commit")
    try:
        out = subprocess.run(
            ["git", "--git-dir", str(dot_git), "cat-file", "--batch-all-objects", "--batch-check"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout
    except FileNotFoundError:
        raise fail("repo/.git exists but git is not installed to check its history",
                   "install git, or remove repo/.git") from None
    except subprocess.CalledProcessError as exc:
        raise fail(f"repo/.git cannot be read by git: {exc.stderr.strip()}",
                   "remove repo/.git or repair it") from None
    commits = sum(1 for line in out.splitlines() if line.split()[1:2] == ["commit"])
    if commits > 1:
        raise fail(f"repo/.git holds {commits} commits; snapshots must carry no history",
                   "squash to one commit: rm -rf repo/.git && git -C repo init && "
                   "git -C repo add -A && git -C repo commit -m base")
