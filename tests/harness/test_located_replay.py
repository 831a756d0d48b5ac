"""Located gold replays (`atelier.harness.replay.located_script`): pure logic, no sandbox or model."""

from __future__ import annotations

from atelier.harness.parsing import parse_tool_calls
from atelier.harness.replay import (
    changed_lines,
    definition_line,
    located_script,
    parse_patch,
    prompt_target,
    replay_script,
    trim_edit,
)

SOURCE = "".join(f"# line {i}\n" for i in range(1, 6)) + """\
class Box:
    def size(self):
        return 1

    def clamp(self, x, lo, hi):
        if x < lo:
            return lo
        if x < hi:
            return hi
        return x


def clamp(x):
    return x
"""
PATCH = """\
--- a/pkg/shapes.py
+++ b/pkg/shapes.py
@@ -10,7 +10,7 @@ class Box:
     def clamp(self, x, lo, hi):
         if x < lo:
             return lo
-        if x < hi:
+        if x > hi:
             return hi
         return x
 
"""
PROMPT = "Fix the failing behaviour of `Box.clamp` in pkg/shapes.py (see tests/test_shapes.py::test_clamp)."


def _calls(text: str) -> list[tuple[str, dict]]:
    return [(c.name, c.arguments) for c in parse_tool_calls(text).calls]


def test_prompt_target_and_definition() -> None:
    assert prompt_target(PROMPT) == ("Box.clamp", "pkg/shapes.py")
    assert prompt_target("Make it faster.") is None
    # The definition enclosing the change: the method at line 10, not the function at line 18 below it.
    assert definition_line(SOURCE, "Box.clamp", before=13) == (r"def clamp\b", 10)
    assert definition_line(SOURCE, "Box", before=13) == (r"class Box\b", 6)
    assert definition_line(SOURCE, "missing", before=13) is None


def test_changed_lines_leave_context_out() -> None:
    assert changed_lines(parse_patch(PATCH)[0].hunks) == (13, 13)


def test_located_script_finds_reads_edits_submits() -> None:
    script = located_script(PROMPT, PATCH, lambda path: SOURCE)
    assert script is not None and len(script) == 4
    (grep,), (read,), edits, (submit,) = [_calls(t) for t in script]
    assert grep == ("grep", {"pattern": r"def clamp\b", "path": "pkg/shapes.py"})
    assert read == ("read_file", {"path": "pkg/shapes.py", "start_line": 10, "end_line": 33})
    assert [name for name, _ in edits] == ["edit_file"]
    old, new = edits[0][1]["old_string"], edits[0][1]["new_string"]
    assert (old, new) == ("if x < hi:", "if x > hi:")   # trimmed: the text read_file shows
    assert SOURCE.count(old) == 1 and SOURCE.replace(old, new) == SOURCE.replace("x < hi", "x > hi")
    assert submit[0] == "submit"


def test_tasks_a_located_replay_cannot_serve_keep_the_harness_replay() -> None:
    assert located_script("Fix the bug.", PATCH, lambda path: SOURCE) is None
    other_file = PROMPT.replace("pkg/shapes.py", "pkg/other.py")
    assert located_script(other_file, PATCH, lambda path: SOURCE) is None
    script = replay_script("Fix the bug.", PATCH, lambda path: SOURCE)
    first = _calls(script[0])
    assert first[0][0] == "read_file" and first[0][1]["start_line"] <= 13 <= first[0][1]["end_line"]
    assert _calls(replay_script(PROMPT, PATCH, lambda path: SOURCE, kind="gold")[0])[0][0] == "read_file"


def test_trim_edit_keeps_the_same_change_and_uniqueness() -> None:
    old, new = "        if x < hi:\n", "        if x > hi:\n"
    assert trim_edit(SOURCE, old, new) == ("if x < hi:", "if x > hi:")
    # Not unique once trimmed ("return x" is also the function's last line): kept as given.
    assert trim_edit(SOURCE, "        return x\n", "        return -x\n") == ("        return x\n",
                                                                           "        return -x\n")
    # Trimming that would change what the edit makes (the indentation differs): kept as given.
    assert trim_edit(SOURCE, "        if x < hi:\n", "    if x < hi:\n") == ("        if x < hi:\n", "    if x < hi:\n")
