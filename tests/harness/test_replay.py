"""Gold patches replayed through the tools reproduce the patch exactly."""

from __future__ import annotations

import pytest

from atelier.harness.agent import run_episode
from atelier.harness.errors import HarnessError
from atelier.harness.replay import gold_patch_calls, gold_patch_script, parse_patch
from atelier.inference.scripted import ScriptedModel


def _make_patch(sandbox) -> str:
    """A patch over the test repository with every kind of change, made by hand in a fork."""
    fork = sandbox.fork()
    try:
        calc = fork.read_file("pkg/calc.py")
        fork.write_file("pkg/calc.py", calc.replace("return a - b", "return a + b").replace(
            "return a * b", "result = a * b\n    return result"))
        fork.write_file("docs/notes.txt", "value = 1\nvalue = 2\nother\n")   # a non-unique hunk core
        fork.write_file("pkg/new_module.py", "NEW = True\n")
        fork.exec(["rm", "/workspace/README.md"])
        return fork.diff()
    finally:
        fork.close()


def test_gold_patch_replay_reproduces_the_patch(sandbox, tokenizer):
    patch = _make_patch(sandbox)
    turns = gold_patch_calls(patch, read_original=sandbox.read_file)
    names = [[name for name, _ in calls] for calls in turns]
    assert names[0] == ["read_file", "read_file"]  # the modified files are read first
    assert sorted(sum(names[1:], [])) == ["delete_file", "edit_file", "edit_file", "write_file"]
    script = gold_patch_script(patch, read_original=sandbox.read_file, message="gold")
    traj = run_episode(ScriptedModel(tokenizer, script), sandbox, "replay")
    assert traj.exit_reason == "submitted" and all(c.ok for c in traj.tool_calls), traj.tool_calls
    assert traj.final_diff == patch


def test_edits_are_minimal_and_widened_only_until_unique(sandbox):
    patch = _make_patch(sandbox)
    edits = {args["path"]: args for calls in gold_patch_calls(patch, sandbox.read_file)
             for name, args in calls if name == "edit_file" and args["path"] == "docs/notes.txt"}
    # "value = 1\n" occurs twice, so the edit takes the next line along.
    assert edits["docs/notes.txt"]["old_string"] == "value = 1\nother\n"
    assert edits["docs/notes.txt"]["new_string"] == "value = 2\nother\n"


def test_patch_parsing_without_originals_and_refusals():
    patch = ("--- a/x.txt\n+++ b/x.txt\n@@ -1,2 +1,2 @@\n keep\n-old\n\\ No newline at end of file\n+new\n"
             "\\ No newline at end of file\n")
    (f,) = parse_patch(patch)
    assert f.path == "x.txt" and f.hunks[0].old == ["keep\n", "old"] and f.hunks[0].new == ["keep\n", "new"]
    assert gold_patch_calls(patch)[1] == [("edit_file", {"path": "x.txt", "old_string": "keep\nold",
                                                         "new_string": "keep\nnew"})]
    with pytest.raises(HarnessError, match="binary"):
        gold_patch_calls("diff --git a/b.bin b/b.bin\nGIT binary patch\nliteral 1\n")
    with pytest.raises(HarnessError, match="changes no files"):
        gold_patch_calls("")
    with pytest.raises(HarnessError, match="renames or copies"):
        gold_patch_calls("diff --git a/a.txt b/c.txt\nsimilarity index 100%\nrename from a.txt\nrename to c.txt\n")
    (quoted,) = parse_patch('--- "a/t\\tb.txt"\n+++ "b/t\\tb.txt"\n@@ -1 +1 @@\n-a\n+b\n')
    assert quoted.path == "t\tb.txt"   # git's C quoting undone


def test_a_hunk_without_a_short_unique_anchor_becomes_a_whole_file_write():
    original = "same\n" * 100
    patch = "--- a/r.txt\n+++ b/r.txt\n@@ -50,3 +50,3 @@\n same\n-same\n+changed\n same\n"
    (calls,) = gold_patch_calls(patch, read_original=lambda path: original)[1:]
    lines = original.splitlines(keepends=True)
    lines[50] = "changed\n"
    assert calls == [("write_file", {"path": "r.txt", "content": "".join(lines)})]


def test_reads_show_only_the_lines_around_each_change():
    """A replay must fit the policy's context: it reads windows, never whole long files."""
    patch = ("--- a/big.py\n+++ b/big.py\n@@ -100,3 +100,3 @@\n a\n-b\n+B\n c\n"
             "@@ -105,3 +105,3 @@\n d\n-e\n+E\n f\n@@ -400,2 +400,2 @@\n-y\n+Y\n z\n")
    reads = gold_patch_calls(patch)[0]
    assert reads == [("read_file", {"path": "big.py", "start_line": 92, "end_line": 116}),
                     ("read_file", {"path": "big.py", "start_line": 392, "end_line": 410})]
