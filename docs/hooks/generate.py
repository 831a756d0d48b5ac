"""mkdocs hook: the pages generated from the code and the data at every build, so none can
drift from what they describe.

- `reference/configuration.md` and `reference/cli.md` (`atelier.cli.reference`);
- `results.md`: the records of adopted runs (`results/`) and the benchmarks' records
  (`benchmarks/results/`), rendered by `atelier.pipeline.results`;
- `log/index.md`: every entry of the lab log, newest first, with its first line.

The checkout's own `src/` goes first on `sys.path`, so the pages describe this code.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]


def results_page(root: Path) -> str:
    from atelier.pipeline.results import benchmarks_table, engine_table, load_records, runs_tables

    records, benchmarks = load_records(root / "results"), load_records(root / "benchmarks" / "results")
    return "\n".join([
        "# Results", "",
        "Every adopted run of a recipe, rendered from its record in `results/` (a run's `run.json`; "
        "the README's table sums the same records by recipe version), then the benchmarks' records in "
        "`benchmarks/results/`. A run's *stages* are the sum of its stages' wall time; *the whole command* "
        "is the time of the command that ran them, set-up included where it says so; memory is the run's "
        "peak PSS of the whole process tree, in GB (10^9 bytes). Records marked reconstructed were written "
        "from the figures of the lab log: no run directory of theirs was kept. "
        "`atelier results add RUN_DIR` keeps a new run's record; `atelier results render` puts it in "
        "the README.", "",
        runs_tables(records, "docs"),
        "## The rollout engine", "", engine_table(benchmarks, root, "docs"), "",
        "## Every benchmark record", "", benchmarks_table(benchmarks, root, "docs"), ""])


def log_index(log_dir: Path) -> str:
    lines = ["# Lab log", "",
             "Dated entries of every experiment, newest first, negative results kept. The recipes, the "
             "guides and the code's comments link here for the figures behind a choice; "
             "[the results](../results.md) hold each adopted run's record.", ""]
    for path in sorted(log_dir.glob("2*.md"), reverse=True):
        text = path.read_text(encoding="utf-8")
        title = text.splitlines()[0].lstrip("# ").strip()
        short = re.search(r"\*\*In short\.\*\*\s+(.+?)(?:\n\n|$)", text, re.S)
        first = (" " + " ".join(short.group(1).split()).split(". ")[0].rstrip(".") + ".") if short else ""
        lines.append(f"- [{title}]({path.name}){':' + first if first else ''}")
    return "\n".join(lines) + "\n"


def on_files(files, config):
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    from atelier.cli.reference import cli_reference, config_reference

    docs = Path(config["docs_dir"])
    pages = {"reference/configuration.md": config_reference(), "reference/cli.md": cli_reference(),
             "results.md": results_page(ROOT), "log/index.md": log_index(docs / "log")}
    for uri, content in pages.items():
        files.append(File.generated(config, uri, content=content))
    return files
