"""The words a user reads hold to what they describe: the README is a short guide whose tables are
rendered from the records and whose links resolve; the docs' reference pages cover every config
field and every command; the pitfalls page names tests that exist; the code cites only documents
the repository holds. (`mkdocs build --strict`, which `make test` runs, checks the site's links.)"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest
import typer.main

from atelier.cli.main import app
from atelier.cli.reference import RECIPES, cli_reference, config_reference
from atelier.pipeline.results import load_records, render, rendered_files, versions_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _tables(text: str) -> list[list[str]]:
    """The Markdown tables of `text`, each as its body rows (header and rule left out)."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            tables.append(rows[2:])
            rows = []
    return tables


def test_the_readme_is_a_short_guide() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert max(len(rows) for rows in _tables(text)) <= 12


def test_the_readme_tables_are_the_rendering_of_the_records() -> None:
    assert render(ROOT, check=True) == [], "run `atelier results render`"
    table = versions_table(load_records(ROOT / "results"))
    assert table in README.read_text(encoding="utf-8") and table.count("\n") >= 3


def test_a_changed_record_makes_the_readme_differ(tmp_path: Path) -> None:
    """The check can fail: a README whose table misses a version is not its rendering."""
    for name in ("README.md", "benchmarks/RESULTS.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text(encoding="utf-8"), encoding="utf-8")
    shutil.copytree(ROOT / "results", tmp_path / "results")
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    assert render(tmp_path, check=True) == []
    stale = (tmp_path / "README.md").read_text(encoding="utf-8").replace("| [ten passes]", "| [ten passes?]")
    (tmp_path / "README.md").write_text(stale, encoding="utf-8")
    assert render(tmp_path, check=True) == [tmp_path / "README.md"]
    assert render(tmp_path) == [tmp_path / "README.md"] and render(tmp_path, check=True) == []
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == rendered_files(ROOT)[README]


def test_every_relative_link_in_the_readme_resolves() -> None:
    links = [t for t in LINK.findall(README.read_text(encoding="utf-8")) if not re.match(r"[a-z]+:", t)]
    assert links
    missing = [t for t in links if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README links to what the repository does not hold: {missing}"


def test_the_configuration_reference_documents_every_field() -> None:
    page = config_reference()
    for _, module, name in RECIPES:
        assert f"### {name}" in page
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) > 200
    cells = [[cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]
    assert {len(c) for c in cells} == {4}
    undocumented = [c[0] for c in cells if not c[3]]
    assert not undocumented, f"config fields without a docstring: {undocumented}"


def test_the_cli_reference_has_every_command_and_option() -> None:
    page = cli_reference()

    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            if not sub.hidden:
                yield from walk(sub, f"{path} {name}")

    for path, command in walk(typer.main.get_command(app), "atelier"):
        section = page.split(f"\n## {path}\n", 1)
        assert len(section) == 2, f"no section for `{path}`"
        body = section[1].split("\n## ", 1)[0]
        for param in command.params:
            if param.name != "help" and not param.hidden and param.opts[0].startswith("-"):
                assert f"`{param.opts[0]}`" in body, f"`{path}` lacks {param.opts[0]}"
    assert "## atelier rank" not in page


def _cited_tests(text: str) -> list[tuple[str, str]]:
    return re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", text)


@pytest.mark.parametrize("page", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")
                                        if _cited_tests(p.read_text(encoding="utf-8"))))
def test_every_test_the_docs_name_exists(page: str) -> None:
    for path, name in _cited_tests((ROOT / page).read_text(encoding="utf-8")):
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert name in names, f"{page} names {path}::{name}, which does not exist"


def test_every_pitfall_names_the_test_that_guards_it() -> None:
    entries = re.split(r"\n- \*\*", (ROOT / "docs" / "pitfalls.md").read_text(encoding="utf-8"))[1:]
    assert len(entries) >= 20
    unguarded = [e.split("**")[0] for e in entries if "Guarded by" not in e or not _cited_tests(e)]
    assert not unguarded, f"pitfalls without a test: {unguarded}"


def test_the_code_cites_only_documents_the_repository_holds() -> None:
    cited = re.compile(r"(?<![\w/.-])((?:docs/(?:log|design|guides)/[\w.-]+|docs/pitfalls|benchmarks/RESULTS"
                       r"|recipes/[\w.-]+|experiments/[\w.-]+/README)\.md)\b")
    wrong = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "PITFALLS" in text or "REFERENCE.md" in text or "ARCHITECTURE.md" in text:
            wrong.append(f"{path.relative_to(ROOT)}: a document outside the repository")
        wrong += [f"{path.relative_to(ROOT)}: {doc}" for doc in cited.findall(text) if not (ROOT / doc).exists()]
    assert not wrong, "\n".join(wrong)


def test_log_entries_are_dated_and_titled() -> None:
    entries = sorted((ROOT / "docs" / "log").glob("*.md"))
    assert entries
    for entry in entries:
        date = re.match(r"(\d{4}-\d{2}-\d{2})-[a-z0-9-]+\.md$", entry.name)
        assert date, f"{entry.name}: not DATE-name.md"
        assert entry.read_text(encoding="utf-8").startswith(f"# {date.group(1)} — "), entry.name


def test_records_name_no_ones_directories() -> None:
    """Benchmark and run records write this checkout as `.` and the home directory as `~`."""
    home = str(Path.home())
    for record in [*(ROOT / "benchmarks" / "results").glob("*.json"), *(ROOT / "results").rglob("*.json")]:
        text = record.read_text()
        assert home not in text and "/home/" not in text, record.name


def test_a_benchmark_row_waits_for_a_busy_core_to_go_quiet() -> None:
    """`record.busy_cores()` sees a process spinning a core (as vLLM's CPU worker does after it
    answers), whatever else runs; `record.settle()` waits while cores are busy, and gives up after
    its bound on a machine that stays busy."""
    import subprocess
    import sys
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import record

    loop = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
    spin = subprocess.Popen([sys.executable, "-c", loop])
    try:
        time.sleep(0.2)
        assert record.busy_cores(0.5) >= 0.8
    finally:
        spin.kill()
        spin.wait()
    readings = iter([1.5, 1.0, 0.1, 2.0])
    assert record.settle(below=0.2, busy=lambda: next(readings)) == {"settle_s": 0.0, "busy_cores": 0.1}
    bounded = record.settle(below=0.2, most_s=0.3, busy=lambda: (time.sleep(0.05), 1.0)[1])
    assert 0.3 <= bounded["settle_s"] < 1.0 and bounded["busy_cores"] == 1.0
