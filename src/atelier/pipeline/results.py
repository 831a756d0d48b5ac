"""The tables of measured figures, rendered from the files that hold them: the records of
adopted runs (`results/`, one `run.json` each, see `atelier.pipeline.record`) and the
benchmarks' reports (`benchmarks/results/`). A figure in the README, the docs or
`benchmarks/RESULTS.md` is never typed: it is rendered here.

A rendered table sits in a Markdown file between `<!-- results:NAME -->` and
`<!-- /results:NAME -->`; `render_block` replaces what is between. `atelier results render`
rewrites the README's and RESULTS.md's blocks (with `--check`, it only says which differ), and
the docs build renders the docs' pages from the same functions, so neither can drift from the
data (tests/test_results.py holds the README to it).

The tables:

- `versions_table` (the README's `demo` block): one row per recipe version, newest first, over
  its runs: the runs and seeds, the held-out attempts of each, the headline measure after SFT
  and after RL summed over the runs, the attempts that moved up and down, how many runs' tests
  were significant, the median wall time and the highest peak memory;
- `runs_tables` (the docs' results page): for each version, one row per run;
- `engine_table` (the README's and RESULTS.md's `engine` blocks): the newest record of
  `benchmarks/inference.py`, tokens/s of every engine it ran at every batch size;
- `benchmarks_table` (RESULTS.md's `benchmarks` block): one row per benchmark report, newest
  first: when, the commit, the machine, the load at start and end, the file.

A table is rendered for the page it goes into (`page_dir`, from the repository's root): links
are relative to it, and a page of the docs site (`page_dir="docs"`), which may link only to
pages of the site, names a file outside it in code instead.

A run's wall time is its stages' sum (`wall_s_total`) or, for a reconstructed record that has
none, the command's own (`command_wall_s`); memory is in GB (10^9 bytes), from MiB.
"""

from __future__ import annotations

import json
import posixpath
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

README_BLOCK = "demo"
ENGINE_BLOCK = "engine"
BENCHMARKS_BLOCK = "benchmarks"
DOCS = "docs"
"""The docs site's directory: its pages link only to one another."""


def load_records(directory: Path) -> list[dict[str, Any]]:
    """Every JSON record under `directory` (recursively), each with its `path`, in name order."""
    records = []
    for path in sorted(directory.rglob("*.json")) if directory.is_dir() else []:
        data = json.loads(path.read_text(encoding="utf-8"))
        data["path"] = path
        records.append(data)
    return records


def by_version(records: Iterable[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(version, its records) newest version first; records without a version are left out."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get("version"):
            groups[record["version"]["name"]].append(record)
    ordered = sorted(groups.values(), key=lambda rs: (rs[0]["version"].get("date", ""), rs[0]["version"]["name"]),
                     reverse=True)
    return [(rs[0]["version"], sorted(rs, key=lambda r: str(r["path"]))) for rs in ordered]


def minutes(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s"


def gigabytes(mib: float | None) -> str:
    return "—" if mib is None else f"{mib * 2 ** 20 / 1e9:.2f} GB"


def wall_s(record: dict[str, Any]) -> float | None:
    return record.get("wall_s_total") or record.get("command_wall_s")


def _measure(record: dict[str, Any], label: str) -> int | None:
    measure = record.get("headline", {}).get("measure", "pass")
    return ((record.get("evaluations") or {}).get(label) or {}).get(measure, {}).get("successes")


def _link(text: str, target: str | None, page_dir: str) -> str:
    """A Markdown link to `target` (a path from the repository's root) from a page in `page_dir`;
    from the docs site to a file outside `docs/`, the file's path in code."""
    if not target:
        return text
    if page_dir == DOCS and not target.startswith(DOCS + "/"):
        return f"`{target}`"
    return f"[{text}]({posixpath.relpath(target, page_dir or '.')})"


def versions_table(records: Sequence[dict[str, Any]], page_dir: str = "") -> str:
    """The README's table (see the module docstring) for a page in `page_dir` (from the root)."""
    rows = ["| recipe version | commit | runs (seeds) | held-out attempts a run | headline after SFT → after RL, "
            "all runs | attempts up / down | runs with p < 0.05 | wall time, median | peak memory, highest |",
            "|---|---|---|---|---|---|---|---|---|"]
    for version, runs in by_version(records):
        heads = [r.get("headline") or {} for r in runs]
        pairs = {h.get("pairs") for h in heads}
        measure = heads[0].get("measure", "pass")
        sft, rl = (sum(_measure(r, label) or 0 for r in runs) for label in ("after_sft", "after_rl"))
        seeds = ", ".join(str(s) for s in sorted({r.get("seed") for r in runs}))
        walls = [w for w in map(wall_s, runs) if w]
        peak = max((r.get("peak_pss_mb") for r in runs if r.get("peak_pss_mb")), default=None)
        rows.append(
            f"| {_link(version['name'], version.get('log'), page_dir)} | `{version['commit'][:7]}` "
            f"| {len(runs)} ({seeds}) | {'/'.join(str(p) for p in sorted(pairs, key=str))} "
            f"| `{measure}` {sft} → {rl} of {sum(h.get('pairs') or 0 for h in heads)} "
            f"| {sum(h.get('improved', 0) for h in heads)} / {sum(h.get('worsened', 0) for h in heads)} "
            f"| {sum(bool(h.get('significant')) for h in heads)} of {len(runs)} "
            f"| {minutes(statistics.median(walls)) if walls else '—'} | {gigabytes(peak)} |")
    return "\n".join(rows)


def runs_tables(records: Sequence[dict[str, Any]], page_dir: str = "docs") -> str:
    """The docs' page: a section per version, a row per run (see the module docstring)."""
    out = []
    for version, runs in by_version(records):
        out += [f"## {version['name']}", "",
                f"Commit `{version['commit'][:12]}`; " + _link("the log entry", version.get("log"), page_dir)
                + (f". {version['summary']}" if version.get("summary") else "."), "",
                "| seed | how it ran | stages | the whole command | peak memory (PSS) "
                "| headline before / after SFT / after RL | up / down, p |", "|---|---|---|---|---|---|---|"]
        for r in runs:
            head = r.get("headline") or {}
            counts = " / ".join("—" if (n := _measure(r, label)) is None else str(n)
                                for label in ("before", "after_sft", "after_rl"))
            p = head.get("p_value")
            verdict = "—" if p is None else f"{head.get('improved')} / {head.get('worsened')}, p = {p:.2g}" + (
                " (significant)" if head.get("significant") else "")
            how = (r.get("reconstructed") or {}).get("note") or f"atelier run {r.get('recipe') or ''}".strip()
            command = minutes(r.get("command_wall_s")) + (f" ({r['command']})" if r.get("command_wall_s") else "")
            out.append(f"| {r.get('seed')} | {how} | {minutes(r.get('wall_s_total'))} | {command} "
                       f"| {gigabytes(r.get('peak_pss_mb'))} | {counts} of {head.get('pairs', '—')} | {verdict} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _repo_path(record: dict[str, Any], repo: Path) -> str:
    return Path(record["path"]).resolve().relative_to(repo.resolve()).as_posix()


def benchmarks_table(records: Sequence[dict[str, Any]], repo: Path, page_dir: str = "benchmarks") -> str:
    rows = ["| benchmark | started (UTC) | commit | machine | load at start → end | record |",
            "|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: r.get("started_utc", ""), reverse=True):
        target = _repo_path(r, repo)
        rows.append(f"| {r.get('benchmark') or r.get('check', '?')} | {r.get('started_utc', '—')} "
                    f"| `{r.get('commit', '?')}` | {machine_name(r)} | {r.get('load_at_start', '—')} → "
                    f"{r.get('load_at_end', '—')} | {_link(Path(target).name, target, page_dir)} |")
    return "\n".join(rows)


def machine_name(record: dict[str, Any]) -> str:
    m = record.get("machine") or {}
    units = ", ".join(m.get("bf16_units") or []) or "no bf16 units"
    return f"{m.get('gpu') or m.get('cpu', '?')}, {m.get('cores', '?')} cores ({units})"


ENGINE_NAMES = {"builtin": "atelier's engine", "builtin1thread": "atelier's engine on one thread",
                "transformers_padded": "transformers, one padded `generate`",
                "vllm": "vLLM"}
"""What `benchmarks/inference.py` calls each engine, as a reader names it; the suffix is the dtype."""


def engine_label(row: str) -> str:
    """'builtin_bf16' -> "atelier's engine, bf16" (pure)."""
    name, _, dtype = row.rpartition("_")
    return f"{ENGINE_NAMES.get(name, name)}, {dtype}" if name else row


def engine_table(records: Sequence[dict[str, Any]], repo: Path, page_dir: str = "") -> str:
    """The newest inference benchmark's tokens/s per engine and batch (see the module docstring)."""
    runs = [r for r in records if r.get("benchmark") == "inference" and r.get("rows")]
    if not runs:
        return "No record of `benchmarks/inference.py` yet: run it to make one."
    r = max(runs, key=lambda r: r.get("started_utc", ""))
    batches = [str(b) for b in r.get("batches") or sorted({k for v in r["rows"].values() for k in v if k.isdigit()},
                                                          key=int)]
    agent = any("agent" in v for v in r["rows"].values())
    rows = ["| engine | " + " | ".join(f"batch {b}, tokens/s" for b in batches)
            + (" | agent workload, s |" if agent else " |"),
            "|---|" + "---|" * (len(batches) + agent)]
    for name, cells in r["rows"].items():
        figures = [f"{cells[b]['tokens_per_s']:.1f}" if b in cells else "—" for b in batches]
        if agent:
            figures.append(f"{cells['agent']['seconds']:.1f}" if "agent" in cells else "—")
        rows.append(f"| {engine_label(name)} | " + " | ".join(figures) + " |")
    ratios = r.get("ratios") or {}
    ratio = ", ".join(f"{b}: {ratios[b]['ratio']}x" for b in batches if (ratios.get(b) or {}).get("ratio"))
    skipped = "; ".join(f"{engine_label(name)} did not run ({why.split(':')[0]})"
                        for name, why in (r.get("skipped") or {}).items())
    target = _repo_path(r, repo)
    notes = [f"Median of {r.get('repeats', 1)} runs of {r.get('new_tokens', '?')} new tokens a sequence "
             f"({r.get('model', '?').rsplit('/', 1)[-1]}, {r.get('threads', '?')} threads), "
             f"{machine_name(r)}, commit `{r.get('commit', '?')}`, load {r.get('load_at_start', '—')} → "
             f"{r.get('load_at_end', '—')}: {_link(Path(target).name, target, page_dir)}."]
    if ratio:
        notes.append(f"The default engine over the best peer, by batch: {ratio}.")
    if skipped:
        notes.append(skipped + ".")
    return "\n".join(rows) + "\n\n" + " ".join(notes)


def render_block(text: str, name: str, table: str) -> str:
    """`text` with the block `name` holding `table`; a text without the block is an error."""
    pattern = re.compile(rf"(<!-- results:{re.escape(name)} -->\n).*?(<!-- /results:{re.escape(name)} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- results:{name} --> ... <!-- /results:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + table.rstrip("\n") + "\n" + m.group(2), text, count=1)


def render_blocks(text: str, tables: dict[str, str]) -> str:
    for name, table in tables.items():
        text = render_block(text, name, table)
    return text


def rendered_files(repo: Path) -> dict[Path, str]:
    """What README.md and benchmarks/RESULTS.md should hold, rendered from `results/` and
    `benchmarks/results/`."""
    readme, bench = repo / "README.md", repo / "benchmarks" / "RESULTS.md"
    runs, benchmarks = load_records(repo / "results"), load_records(repo / "benchmarks" / "results")
    return {
        readme: render_blocks(readme.read_text(encoding="utf-8"), {
            README_BLOCK: versions_table(runs), ENGINE_BLOCK: engine_table(benchmarks, repo)}),
        bench: render_blocks(bench.read_text(encoding="utf-8"), {
            ENGINE_BLOCK: engine_table(benchmarks, repo, "benchmarks"),
            BENCHMARKS_BLOCK: benchmarks_table(benchmarks, repo)}),
    }


def render(repo: Path, *, check: bool = False) -> list[Path]:
    """The files whose blocks differ from the data; rewritten unless `check`."""
    stale = []
    for path, text in rendered_files(repo).items():
        if path.read_text(encoding="utf-8") != text:
            stale.append(path)
            if not check:
                path.write_text(text, encoding="utf-8")
    return stale
