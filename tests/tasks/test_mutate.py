"""Mutation tasks: each operator on small sources, sampling, the gold patch,
and the builder on a tiny real repository with the real pytest runner."""

from __future__ import annotations

import ast
import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from atelier.tasks.loader import load_task
from atelier.tasks.mutate import (
    OPERATORS,
    Mutation,
    apply_mutations,
    enumerate_mutations,
    gold_patch,
    sample_combinations,
    terse_prompt,
)
from atelier.tasks.mutation_tasks import (
    BuildReport,
    MutationBuildError,
    _try,
    build_mutation_tasks,
    run_pytest_local,
    source_files,
)
from tests.helpers import SHAPES, write_tree


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _applied(source: str, m: Mutation) -> str:
    """Apply one mutation and check it parses and changed exactly its span."""
    new = apply_mutations({m.path: source}, [m])[m.path]
    ast.parse(new)
    assert ast.dump(ast.parse(new)) != ast.dump(ast.parse(source))
    assert source[m.start : m.end] == m.original
    assert new[: m.start] == source[: m.start]
    assert new[m.start : m.start + len(m.mutated)] == m.mutated
    assert new[m.start + len(m.mutated) :] == source[m.end :]
    return new


def _mutants(source: str, operator: str) -> list[str]:
    return [_applied(source, m) for m in enumerate_mutations(source, "m.py", [operator])]


def test_flip_comparison_flips_each_operator_of_a_chain() -> None:
    src = _src("""
        def f(a, b, c):
            return a < b <= c and a is not None and b not in (1, 2)
    """)
    got = {line.split("return ")[1] for line in _mutants(src, "flip_comparison") for line in line.splitlines()
           if "return" in line}
    assert got == {
        "a >= b <= c and a is not None and b not in (1, 2)",
        "a < b > c and a is not None and b not in (1, 2)",
        "a < b <= c and a is None and b not in (1, 2)",
        "a < b <= c and a is not None and b in (1, 2)",
    }


def test_flip_comparison_keeps_formatting_and_skips_comments_in_the_gap() -> None:
    src = _src("""
        def f(a, b):
            x = (a)==(b)   # keep  this comment
            y = (a <  # a < in a comment
                 b)
            return x, y
    """)
    [new] = _mutants(src, "flip_comparison")
    assert "x = (a)!=(b)   # keep  this comment" in new


def test_flip_boolop_flips_the_whole_chain() -> None:
    src = _src("""
        def f(a, b, c):
            return a and b and c
    """)
    assert _mutants(src, "flip_boolop") == [src.replace("a and b and c", "a or b or c")]


def test_off_by_one_on_range_and_slices() -> None:
    src = _src("""
        def f(xs, n):
            for i in range(n):
                pass
            for j in range(1, len(xs) + 1):
                pass
            return xs[1:n - 1]
    """)
    got = set(_mutants(src, "off_by_one"))
    assert got == {
        src.replace("range(n)", "range(n - 1)"),
        src.replace("len(xs) + 1)", "len(xs))"),
        src.replace("xs[1:", "xs[2:"),
        src.replace("n - 1]", "n]"),
    }


def test_off_by_one_parenthesises_loose_expressions() -> None:
    src = _src("""
        def f(a, b):
            return range(a << b)
    """)
    assert _mutants(src, "off_by_one") == [src.replace("a << b", "(a << b) - 1")]


def test_swap_args_swaps_adjacent_positional_pairs_only() -> None:
    src = _src("""
        def f(a, b):
            g(a, b, key=1)
            g(a, a)
            max(a, b)
            return g(*a, b)
    """)
    assert _mutants(src, "swap_args") == [src.replace("g(a, b, key=1)", "g(b, a, key=1)")]


def test_remove_statement_deletes_lines_or_leaves_pass() -> None:
    src = _src("""
        def f(a):
            \"\"\"Docstring stays.\"\"\"
            a += 1
            b = 2; a = a * b
            if a:
                print(a)
            return a
    """)
    got = _mutants(src, "remove_statement")
    assert src.replace("    a += 1\n", "") in got
    assert src.replace("b = 2; a", "pass; a") in got
    assert src.replace("; a = a * b", "; pass") in got
    assert src.replace("print(a)", "pass") in got
    assert len(got) == 4  # not the docstring


def test_remove_return_and_invert_condition() -> None:
    src = _src("""
        def f(a, b):
            if a and b:
                return a if not b else b
            return None
    """)
    assert _mutants(src, "remove_return") == [src.replace("return a if not b else b", "return None")]
    assert set(_mutants(src, "invert_condition")) == {
        src.replace("if a and b:", "if not (a and b):"),
        src.replace("a if not b else b", "a if b else b"),
    }


def test_invert_condition_keeps_parentheses_around_multiline_tests() -> None:
    src = _src("""
        def f(a, b):
            if not (a
                    and b):
                return 1
    """)
    assert _mutants(src, "invert_condition") == [src.replace("not (a", "(a")]


def test_change_constant_ints_bools_and_plain_strings() -> None:
    src = _src("""
        def f():
            \"\"\"doc\"\"\"
            return [0, -3, True, "abc", f"x{1}", r"raw", "a\\tb", '123']
    """)
    got = set(_mutants(src, "change_constant"))
    assert got == {
        src.replace("[0,", "[1,"),
        src.replace("-3", "-4"),
        src.replace("True", "False"),
        src.replace('"abc"', '"Abc"'),
    }


def test_remove_body_keeps_signature_and_docstring_and_skips_stubs() -> None:
    src = _src("""
        class C:
            def m(self, x):
                \"\"\"Doc.\"\"\"
                y = x + 1
                return y

            def stub(self):
                raise NotImplementedError
    """)
    [new] = _mutants(src, "remove_body")
    assert new == src.replace("        y = x + 1\n        return y", "        raise NotImplementedError")


def test_operators_leave_module_level_and_non_ascii_columns_right() -> None:
    src = _src("""
        LIMIT = 3 < 4

        def f(s):
            return "é" + s if len(s) < 2 else s
    """)
    muts = enumerate_mutations(src, "m.py")
    assert muts and all(m.function == "f" and m.line == 4 for m in muts)
    for m in muts:
        _applied(src, m)
    assert "é" in next(m.original for m in muts if m.operator == "remove_return")


def test_every_operator_has_a_unit_test() -> None:
    assert set(OPERATORS) == {
        "flip_comparison", "flip_boolop", "off_by_one", "swap_args", "remove_statement",
        "remove_return", "change_constant", "invert_condition", "remove_body",
    }


def _three_files() -> dict[str, str]:
    body = "def f{i}(a, b):\n    if a < b:\n        return a + {i}\n    return g(a, b)\n"
    return {f"pkg/m{i}.py": body.format(i=i) for i in range(3)}


def test_sampling_is_deterministic_and_spans_files_without_overlap() -> None:
    files = _three_files()
    muts = [m for path, text in files.items() for m in enumerate_mutations(text, path)]
    first = sample_combinations(muts, random.Random(7), 20)
    assert first == sample_combinations(muts, random.Random(7), 20)
    assert first != sample_combinations(muts, random.Random(8), 20)
    assert {len(c) for c in first} == {1, 2, 3}
    for combo in first:
        assert len({m.path for m in combo}) == len(combo)  # three files: always spread
        apply_mutations(files, combo)  # no overlap


def test_apply_refuses_overlaps_and_stale_sources() -> None:
    [path, text] = next(iter(_three_files().items()))
    muts = enumerate_mutations(text, path)
    body = next(m for m in muts if m.operator == "remove_body")
    inner = next(m for m in muts if m.operator == "flip_comparison")
    with pytest.raises(ValueError, match="overlapping"):
        apply_mutations({path: text}, [body, inner])
    with pytest.raises(ValueError, match="no longer"):
        apply_mutations({path: text.replace("<", ">")}, [inner])


def test_prompt_names_what_is_broken_never_the_fix() -> None:
    [path, text] = next(iter(_three_files().items()))
    muts = enumerate_mutations(text, path)
    flip = next(m for m in muts if m.operator == "flip_comparison")
    body = next(m for m in muts if m.operator == "remove_body")
    prompt = terse_prompt([flip], ["tests/test_m.py::test_f0"])
    assert prompt == "Fix the failing behaviour of `f0` in pkg/m0.py (see tests/test_m.py::test_f0)."
    assert terse_prompt([body], ["t.py::a"]).startswith("Implement `f0` in pkg/m0.py")
    many = [f"tests/test_long_module_name.py::test_case_number_{i}" for i in range(50)]
    long = terse_prompt([flip], many)
    assert len(long) <= 300 and "more" in long
    for p in (prompt, long):
        assert "<" not in p and ">=" not in p and flip.description not in p


def test_gold_patch_applies_with_git_including_missing_final_newline(tmp_path: Path) -> None:
    before = {"a.py": "x = 1\ny = 2\n", "b/c.py": "z = 3"}
    after = {"a.py": "x = 1\ny = 3\n", "b/c.py": "z = 4"}
    for path, text in before.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    (tmp_path / "gold.patch").write_text(gold_patch(before, after))
    subprocess.run(["git", "apply", "gold.patch"], cwd=tmp_path, check=True, capture_output=True)
    assert {p: (tmp_path / p).read_text() for p in after} == after


def test_source_files_skip_tests_and_tooling(tmp_path: Path) -> None:
    for rel in ["pkg/__init__.py", "pkg/core.py", "pkg/test_core.py", "tests/test_x.py", "conftest.py",
                "setup.py", "docs/conf.py", ".venv/lib/x.py", "pkg/core_test.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert source_files(tmp_path) == ["pkg/__init__.py", "pkg/core.py"]


# --- the builder --------------------------------------------------------------------



def _write_repo(root: Path) -> Path:
    return write_tree(root, SHAPES)


def _git_apply(task_dir: Path, dest: Path) -> Path:
    shutil.copytree(task_dir / "repo", dest)
    subprocess.run(["git", "apply", str(task_dir / "gold.patch")], cwd=dest, check=True, capture_output=True)
    return dest


def test_build_with_the_real_runner_gold_patches_fix_the_failing_tests(tmp_path: Path) -> None:
    repo = _write_repo(tmp_path / "tiny")
    out = tmp_path / "out"
    report = build_mutation_tasks(repo, out, n=3, seed=1, max_attempts=30)
    assert len(report.tasks) == 3, report.dropped
    assert report.clean_passing == 4
    assert json.loads((out / "build_report.json").read_text())["tasks"] == report.tasks
    for task_id in report.tasks:
        task_dir = out / task_id
        loaded = load_task(task_dir)
        task = loaded.model_dump()
        assert task["id"] == task_id and task["fail_to_pass"]
        assert loaded.hidden_tests and all(t.startswith("tests/") for t in loaded.hidden_tests)
        mutations = json.loads((task_dir / "mutations.json").read_text())
        assert sorted(task["fail_to_pass"] + task["pass_to_pass"]) == sorted(
            ["tests/test_calc.py::test_add", "tests/test_calc.py::test_clamp",
             "tests/test_seq.py::test_window", "tests/test_seq.py::test_both_positive"])
        meta = task["metadata"]
        assert meta["source"] == "mutation" and mutations["seed"] == 1 and meta["lines_changed"] >= 2
        assert set(meta["category"].split(",")) <= set(OPERATORS)
        assert not (task_dir / "repo" / ".git").exists()

        before = run_pytest_local(task_dir / "repo")
        assert all(before[t] != "passed" for t in task["fail_to_pass"])
        fixed = run_pytest_local(_git_apply(task_dir, tmp_path / f"fixed-{task_id}"))
        assert all(fixed[t] == "passed" for t in task["fail_to_pass"] + task["pass_to_pass"])
        assert meta["files_changed"] == len({m["path"] for m in mutations["mutations"]})
        for path in {m["path"] for m in mutations["mutations"]}:
            assert (tmp_path / f"fixed-{task_id}" / path).read_text() == (repo / path).read_text()

        patch = (task_dir / "gold.patch").read_text()
        restored = [line[1:].strip() for line in patch.splitlines()
                    if line.startswith("+") and not line.startswith("+++")]
        assert len(task["prompt"]) <= 300
        assert not any(len(code) >= 3 and code in task["prompt"] for code in restored), task["prompt"]


class FakeSuite:
    """A runner that needs no pytest: `test_calc` fails whenever calc.py's text
    differs from the clean one; `flaky` alternates; `broken` always fails."""

    def __init__(self, clean: str, break_on_change: bool = True, raise_: Exception | None = None) -> None:
        self.clean, self.break_on_change, self.raise_, self.calls = clean, break_on_change, raise_, 0

    def __call__(self, repo_dir: Path) -> dict[str, str]:
        self.calls += 1
        changed = (repo_dir / "shapes/calc.py").read_text() != self.clean
        if changed and self.raise_ is not None:
            raise self.raise_
        return {
            "tests/test_calc.py::test_calc": "failed" if changed and self.break_on_change else "passed",
            "tests/test_x.py::flaky": "passed" if self.calls % 2 else "failed",
            "tests/test_x.py::broken": "failed",
        }


def _fake_repo(tmp_path: Path) -> tuple[Path, str]:
    repo = _write_repo(tmp_path / "tiny")
    (repo / "shapes/seq.py").unlink()
    return repo, (repo / "shapes/calc.py").read_text()


def test_build_is_deterministic_and_never_counts_flaky_or_failing_tests(tmp_path: Path) -> None:
    repo, clean = _fake_repo(tmp_path)
    first = build_mutation_tasks(repo, tmp_path / "a", n=4, seed=3, run_tests=FakeSuite(clean))
    again = build_mutation_tasks(repo, tmp_path / "b", n=4, seed=3, run_tests=FakeSuite(clean))
    other = build_mutation_tasks(repo, tmp_path / "c", n=4, seed=4, run_tests=FakeSuite(clean))
    assert len(first.tasks) == 4 and first.tasks == again.tasks and first.tasks != other.tasks
    assert first.clean_passing == 1
    for task_id in first.tasks:
        task = load_task(tmp_path / "a" / task_id).model_dump()
        assert task["fail_to_pass"] == ["tests/test_calc.py::test_calc"] and task["pass_to_pass"] == []
        assert (tmp_path / "a" / task_id / "gold.patch").read_text() == (
            tmp_path / "b" / task_id / "gold.patch").read_text()


@pytest.mark.parametrize(("suite_kwargs", "reason"), [
    ({"break_on_change": False}, "no test broke"),
    ({"raise_": TimeoutError()}, "timeout"),
])
def test_build_invents_nothing_and_says_why(tmp_path: Path, suite_kwargs: dict, reason: str) -> None:
    repo, clean = _fake_repo(tmp_path)
    report = build_mutation_tasks(repo, tmp_path / "out", n=2, seed=0, run_tests=FakeSuite(clean, **suite_kwargs),
                                  max_attempts=5)
    assert report.tasks == [] and len(report.dropped) == 5
    assert {d.reason for d in report.dropped} == {reason}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["build_report.json"]


def test_candidates_that_do_not_parse_are_dropped_and_the_tree_restored(tmp_path: Path) -> None:
    repo, clean = _fake_repo(tmp_path)
    start = clean.index("a + b")
    bad = Mutation("flip_boolop", "shapes/calc.py", "add", 2, start, start + 5, "a + b", "a +* b", "")
    files = {"shapes/calc.py": clean}
    report = BuildReport(repo="", out="", seed=0, requested=1)
    assert _try(repo, files, [bad], FakeSuite(clean), {"t"}, report) == "syntax error"
    assert report.test_runs == 0 and (repo / "shapes/calc.py").read_text() == clean


def test_build_refuses_a_repository_whose_tests_do_not_pass(tmp_path: Path) -> None:
    repo, _ = _fake_repo(tmp_path)
    with pytest.raises(MutationBuildError, match="no test passes"):
        build_mutation_tasks(repo, tmp_path / "out", n=1, run_tests=lambda d: {"t::x": "failed"})


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_cli_builds_in_sandboxes_and_the_tasks_grade(tmp_path: Path) -> None:
    from atelier.tasks.grade import grade

    repo = _write_repo(tmp_path / "tiny")
    out = tmp_path / "suite"
    res = subprocess.run([sys.executable, "-m", "atelier.cli", "tasks", "build", "mutate", "--repo", str(repo),
                          "--out", str(out), "--n", "2", "--seed", "5"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "2 of 2 tasks written" in res.stdout
    task_dirs = sorted(p.parent for p in out.glob("*/task.toml"))
    assert len(task_dirs) == 2
    task = load_task(task_dirs[0])
    assert task.metadata.source == "mutation"
    assert grade(task, task.gold_patch).reward == 1.0
    assert grade(task, "").reward == 0.0


def test_task_test_command_puts_an_src_layout_on_the_path(tmp_path: Path) -> None:
    """Grading runs the task's command with nothing else on the path: an
    src/ layout must be importable through it, as it was while building."""
    from atelier.tasks.mutation_tasks import task_test_command

    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "__init__.py").write_text("X = 1\n")
    assert task_test_command(tmp_path).endswith("--rootdir=. -o pythonpath=src")
    flat = tmp_path / "flat"
    flat.mkdir()
    assert "pythonpath" not in task_test_command(flat)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_sandbox_runner_sees_what_grading_sees(tmp_path: Path) -> None:
    """No PYTHONPATH while searching: a test whose subprocess imports the
    package fails here as it fails at grading, so it is never PASS_TO_PASS
    of a task that grading would then refuse."""
    from atelier.tasks.mutation_tasks import sandbox_pytest_runner

    repo = tmp_path / "cli"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "__init__.py").write_text("X = 1\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_pkg.py").write_text(
        "import subprocess, sys\n\nimport pkg\n\n\ndef test_import():\n    assert pkg.X == 1\n\n\n"
        "def test_subprocess_import():\n"
        "    subprocess.run([sys.executable, '-c', 'import pkg'], check=True, cwd='/')\n")
    statuses = sandbox_pytest_runner(timeout=120)(repo)
    assert statuses == {"tests/test_pkg.py::test_import": "passed",
                        "tests/test_pkg.py::test_subprocess_import": "failed"}
