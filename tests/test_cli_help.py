"""What `--help` shows a user: paragraphs the terminal wraps (never a docstring's own line
breaks), and one real example per command, checked against the command's own parser."""

from __future__ import annotations

import re
import shlex

import pytest
import typer.main
from typer.testing import CliRunner

from atelier.cli import main as cli


def _commands(command, path: tuple[str, ...] = ("atelier",)):
    """(path, click command) of every visible command and group under `command`, groups first."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        if not sub.hidden:
            yield from _commands(sub, (*path, name))


ROOT = typer.main.get_command(cli.app)
COMMANDS = [(path, cmd) for path, cmd in _commands(ROOT) if not hasattr(cmd, "commands")]
GROUPS = [(path, cmd) for path, cmd in _commands(ROOT) if hasattr(cmd, "commands")]
RUNNABLE_GROUPS = [(path, cmd) for path, cmd in GROUPS if cmd.invoke_without_command]
"""Groups that are commands too (`atelier tasks build --suite ...`)."""


def test_plain_help_joins_lines_and_sets_the_example_apart() -> None:
    doc = """First line of a sentence
    that goes on. Example: atelier run x.toml

    Second paragraph,
      indented."""
    assert cli.plain_help(doc) == ("First line of a sentence that goes on.\n\nExample: atelier run x.toml\n\n"
                                   "Second paragraph, indented.")
    assert cli.plain_help(None) is None


def test_the_command_tree_is_the_expected_one() -> None:
    names = {" ".join(path[1:]) for path, _ in COMMANDS}
    assert {"run", "train", "pretrain", "eval", "base-eval", "agent", "serve", "report", "results render",
            "models pull", "tasks grade", "tasks build mutate", "sandbox run"} <= names
    assert "rank" not in names


@pytest.mark.parametrize("path, command", COMMANDS + RUNNABLE_GROUPS, ids=lambda v: " ".join(v)
                         if isinstance(v, tuple) else "")
def test_every_command_has_one_example_that_its_parser_takes(path, command) -> None:
    paragraphs = (command.help or "").split("\n\n")
    assert all("\n" not in p for p in paragraphs), f"{' '.join(path)}: a paragraph keeps a line break"
    examples = [p for p in paragraphs if p.startswith("Example: ")]
    assert len(examples) == 1, f"{' '.join(path)}: {len(examples)} examples"
    words = shlex.split(examples[0].removeprefix("Example: "))
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):   # the environment it runs in
        words = words[1:]
    assert tuple(words[:len(path)]) == path, f"the example runs another command: {examples[0]}"
    # Unknown options and missing arguments raise; paths need not exist (resilient parsing).
    ctx = command.make_context(path[-1], list(words[len(path):]), resilient_parsing=True)
    assert not set(words[len(path):]) & set(getattr(command, "commands", {})), f"a subcommand: {examples[0]}"
    for param in command.params:
        if param.required:
            assert ctx.params.get(param.name) not in (None, (), []), f"{examples[0]} leaves out {param.name}"


def _panel_rows(text: str, title: str) -> list[tuple[str, str]]:
    """(name, description line) of each row of the rich panel `title` in `text`."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith("╭") and title in line:
            inside = True
        elif line.startswith("╰"):
            inside = False
        elif inside and line.startswith("│"):
            cell = line.strip("│").rstrip()
            name, _, desc = cell.strip().partition(" ") if not cell.startswith("  ") else ("", "", cell.strip())
            rows.append((name, desc.strip()))
    return rows


def _breaks_early(lines: list[str], width: int) -> list[str]:
    """Lines of one wrapped paragraph that end before the next word would have filled them: a line
    wrapped at `width` columns plus a space and the next line's first word is longer than that."""
    return [line for line, nxt in zip(lines, lines[1:]) if nxt and len(line) + 1 + len(nxt.split()[0]) <= width]


@pytest.mark.parametrize("path", [path for path, _ in GROUPS], ids=lambda p: " ".join(p))
def test_command_lists_wrap_only_at_the_width(path) -> None:
    result = CliRunner().invoke(cli.app, [*path[1:], "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    cells: list[list[str]] = []
    for name, desc in _panel_rows(result.output, "Commands"):
        if name:
            cells.append([desc])
        elif cells:
            cells[-1].append(desc)
    assert cells
    width = max(len(line) for cell in cells for line in cell)   # the column's width, or just under it
    early = [line for cell in cells for line in _breaks_early(cell, width)]
    assert not early, f"broken mid-sentence in `{' '.join(path)} --help`: {early}"


@pytest.mark.parametrize("path, command", COMMANDS, ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_a_commands_own_help_wraps_only_at_the_width(path, command) -> None:
    result = CliRunner().invoke(cli.app, [*path[1:], "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    body = result.output.split("╭")[0].split("\n")[3:]   # after the usage line, before the first panel
    paragraphs = "\n".join(line.strip() for line in body).strip().split("\n\n")
    early = [line for p in paragraphs for line in _breaks_early(p.splitlines(), 80 - 2)]   # rich pads 1 a side
    assert not early, f"broken mid-sentence in `{' '.join(path)} --help`: {early}"


@pytest.mark.parametrize("path, command", COMMANDS + RUNNABLE_GROUPS, ids=lambda v: " ".join(v)
                         if isinstance(v, tuple) else "")
def test_no_help_text_holds_what_the_terminal_would_take_for_markup(path, command) -> None:
    """Rich reads `[name]` as a style tag and prints nothing for it (an "[mtp] section" showed as
    " section"); help says "the mtp table" instead."""
    texts = [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]
    tags = [t for text in texts for t in re.findall(r"\[[a-z][a-z0-9_.-]*\]", text)]
    assert not tags, f"{' '.join(path)}: {tags}"
