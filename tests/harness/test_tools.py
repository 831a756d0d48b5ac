"""Every tool against a real bubblewrap sandbox, through the strict registry."""

from __future__ import annotations

import pytest

from atelier.harness.errors import FormatError, Submitted
from atelier.harness.tools import ToolsConfig, call_tool, default_tools
from atelier.harness.tools.search import last_part_pattern


@pytest.fixture(params=["bwrap", "local"])
def backend(request: pytest.FixtureRequest) -> str:
    """Every tool runs the same over an isolating and a plain backend."""
    return request.param


def test_registry_has_the_issue_tools_with_object_schemas():
    tools = default_tools()
    assert set(tools) == {"read_file", "list_dir", "glob", "grep", "codebase_search", "edit_file", "write_file",
                          "delete_file", "run_terminal", "todo_write", "submit"}
    for tool in tools.values():
        assert tool.parameters["type"] == "object" and tool.parameters["additionalProperties"] is False
        assert tool.openai_schema()["function"]["name"] == tool.name


def test_read_file_numbers_lines_and_ranges(call, ctx):
    out = call("read_file", path="pkg/calc.py").output
    assert out.splitlines()[3] == " 4\tdef add(a, b):"
    part = call("read_file", path="/workspace/pkg/calc.py", start_line=4, end_line=5).output
    assert part.startswith("4\tdef add(a, b):\n5\t    return a - b\n[lines 4-5 of 13")
    assert list(ctx.recent) == ["pkg/calc.py"]


def test_read_file_errors_say_what_to_do(call):
    assert "use list_dir" in call("read_file", path="pkg").output
    assert not call("read_file", path="missing.py").ok
    assert "binary file" in call("read_file", path="data.bin").output
    assert "past the end" in call("read_file", path="pkg/calc.py", start_line=99).output
    assert "outside the workspace" in call("read_file", path="/etc/passwd").output


def test_read_file_caps_long_files(sandbox, ctx):
    sandbox.write_file("long.txt", "".join(f"line {i}\n" for i in range(1, 1001)))
    ctx.config = ToolsConfig(read_max_lines=50)
    out = call_tool(default_tools(), ctx, "read_file", {"path": "long.txt"}).output
    assert out.splitlines()[-2].endswith("line 50") and "[lines 1-50 of 1000" in out


def test_strict_arguments_are_broken_calls_with_the_expected_shape():
    tools = default_tools()
    with pytest.raises(FormatError, match=r"unknown argument 'file'.*missing required argument 'path'"):
        call_tool(tools, None, "read_file", {"file": "a"})
    with pytest.raises(FormatError, match=r"start_line must be an integer, got string.*Expected read_file\(path"):
        call_tool(tools, None, "read_file", {"path": "a", "start_line": "3"})
    with pytest.raises(FormatError, match="must be an integer, got boolean"):
        call_tool(tools, None, "read_file", {"path": "a", "start_line": True})
    with pytest.raises(FormatError, match="unknown tool 'cat'"):
        call_tool(tools, None, "cat", {})
    with pytest.raises(FormatError, match=r"items\[0\].status must be one of"):
        call_tool(tools, None, "todo_write", {"items": [{"content": "x", "status": "done"}]})


def test_list_dir_with_depth(call):
    top = call("list_dir").output.splitlines()
    assert top == ["README.md", "data.bin", "docs/", "pkg/", "tests/"]
    deep = call("list_dir", path="pkg", depth=2).output.splitlines()
    assert deep == ["__init__.py", "calc.py", "http_headers.py"]
    assert not call("list_dir", path="nope").ok


def test_glob_matches_any_depth_and_paths(call):
    assert call("glob", pattern="*.py").output.splitlines() == [
        "pkg/__init__.py", "pkg/calc.py", "pkg/http_headers.py", "tests/__init__.py", "tests/test_calc.py"]
    assert call("glob", pattern="tests/test_*.py").output == "tests/test_calc.py"
    assert "no files match" in call("glob", pattern="*.rs").output


def test_grep_gives_file_line_and_caps(call, ctx):
    out = call("grep", pattern="def (add|mul)", include="*.py").output
    assert "pkg/calc.py:4:def add(a, b):" in out and "pkg/calc.py:8:def mul(a, b):" in out
    assert "no matches" in call("grep", pattern="zebra").output
    assert "regular expression" in call("grep", pattern="(").output
    ctx.config = ToolsConfig(grep_max_matches=1)
    capped = call_tool(default_tools(), ctx, "grep", {"pattern": "value", "path": "docs"}).output
    assert capped.splitlines()[0] == "docs/notes.txt:1:value = 1" and "[1 more matches" in capped


def test_grep_for_a_dotted_name_finds_its_last_part(call):
    out = call("grep", pattern=r"def Calc\.add\b", include="*.py").output
    assert out.splitlines() == ["no matches for 'def Calc\\\\.add\\\\b'; Python defines a dotted name (a method, "
                                "a nested function) under its last part, and 'def add\\\\b' matches:",
                                "pkg/calc.py:4:def add(a, b):"]
    assert call("grep", pattern="def Calc.zebra").output == "no matches for 'def Calc.zebra' in ."
    assert last_part_pattern(r"\bcache.CacheMemory.expire\(") == r"\bexpire\("
    assert last_part_pattern(r"\nlog.error") is None and last_part_pattern("zebra") is None


def test_codebase_search_ranks_by_words_and_paths(call, sandbox):
    out = call("codebase_search", query="where are HTTP headers parsed").output
    assert out.splitlines()[0].startswith("pkg/http_headers.py:1-3")
    out = call("codebase_search", query="multiply values by a factor").output
    assert out.splitlines()[0].startswith("pkg/calc.py:")
    # The index follows edits made after the first search.
    sandbox.write_file("pkg/zebra.py", "def zebra_stripes():\n    return 'zebra'\n")
    assert call("codebase_search", query="zebra stripes").output.startswith("pkg/zebra.py:1-2")
    assert "nothing in the workspace" in call("codebase_search", query="quaternion").output


def test_edit_file_unique_match(call, sandbox, ctx):
    out = call("edit_file", path="pkg/calc.py", old_string="return a - b", new_string="return a + b")
    assert out.ok and "5\t    return a + b" in out.output
    assert "return a + b" in sandbox.read_file("pkg/calc.py")
    assert ctx.recent["pkg/calc.py"] == "edited"


def test_edit_file_zero_matches_shows_nearest(call):
    out = call("edit_file", path="pkg/calc.py", old_string="def add(x, y):\n    return x - y", new_string="z")
    assert not out.ok
    assert "was not found in pkg/calc.py" in out.output and "lines 4-5" in out.output
    assert "4\tdef add(a, b):" in out.output and "% similar" in out.output
    ws = call("edit_file", path="pkg/calc.py", old_string="def add(a, b):\n  return a - b", new_string="z")
    assert "matches when whitespace is ignored" in ws.output


def test_edit_file_many_matches_and_replace_all(call, sandbox):
    out = call("edit_file", path="docs/notes.txt", old_string="value = 1", new_string="value = 2")
    assert not out.ok and "occurs 2 times" in out.output and "lines 1, 2" in out.output
    assert call("edit_file", path="docs/notes.txt", old_string="value = 1", new_string="value = 2",
                replace_all=True).ok
    assert sandbox.read_file("docs/notes.txt") == "value = 2\nvalue = 2\nother\n"
    assert "write_file" in call("edit_file", path="nope.py", old_string="a", new_string="b").output
    assert "nothing would change" in call("edit_file", path="docs/notes.txt", old_string="o", new_string="o").output


def test_write_and_delete_file(call, sandbox):
    assert call("write_file", path="new/mod.py", content="X = 1\n").output == "created new/mod.py (1 lines)"
    assert call("write_file", path="new/mod.py", content="X = 2\nY = 3").output.startswith("overwrote")
    assert sandbox.read_file("new/mod.py") == "X = 2\nY = 3"
    assert call("delete_file", path="new/mod.py").output == "deleted new/mod.py"
    assert "no such file" in call("delete_file", path="new/mod.py").output
    assert "is a directory" in call("delete_file", path="pkg").output
    assert call("delete_file", path="README.md").ok
    assert "deleted file mode" in sandbox.diff()


def test_run_terminal_exit_code_output_timeout_and_cap(call, ctx, sandbox):
    out = call("run_terminal", command="echo out; echo err >&2; exit 3").output
    assert out == "exit code: 3\nout\n[stderr]\nerr"
    slow = call("run_terminal", command="sleep 5", timeout=1).output
    assert slow.startswith("timed out after 1 s")
    ctx.config = ToolsConfig(command_timeout_s=1)
    capped = call_tool(default_tools(), ctx, "run_terminal", {"command": "sleep 5", "timeout": 300}).output
    assert "300 s was asked for, the limit is 1 s" in capped
    ctx.config = ToolsConfig(output_cap_chars=500)
    big = call_tool(default_tools(), ctx, "run_terminal", {"command": "seq 1 5000"}).output
    assert len(big) < 700 and "characters cut" in big and big.rstrip().endswith("5000")
    tests = call("run_terminal", command="python3 -m unittest -q tests.test_calc 2>&1").output
    assert tests.startswith("exit code: 1") and "FAILED (failures=1)" in tests
    assert "__pycache__" not in sandbox.diff()


def test_todo_write_keeps_state_and_submit_ends(call, ctx):
    out = call("todo_write", items=[{"content": "fix add", "status": "in_progress"}, {"content": "run tests"}])
    assert out.output == "to-do list:\n[~] fix add\n[ ] run tests"
    assert ctx.todos == [{"content": "fix add", "status": "in_progress"}, {"content": "run tests", "status": "pending"}]
    with pytest.raises(Submitted) as done:
        call("submit", message="all done")
    assert done.value.message == "all done"


@pytest.mark.parametrize("cgroups_writable", [True, False])
def test_run_terminal_says_a_command_ran_out_of_memory(repo, bwrap_ready, monkeypatch, cgroups_writable):
    """An agent's command killed for passing the memory limit is a tool result
    the agent reads (its own doing), not an infrastructure failure; without
    a memory cgroup (an ordinary user's case) the failed allocation gets a
    hint."""
    from atelier.harness.tools import ToolContext
    from atelier.sandbox import SandboxConfig, cgroups, create_sandbox

    if not cgroups_writable:
        monkeypatch.setattr(cgroups, "_candidate_parents", lambda controller: [])
    with create_sandbox(repo, SandboxConfig(memory_mb=128, timeout_s=30)) as sb:
        cgroup = getattr(sb, "_cgroup", None)
        out = call_tool(default_tools(), ToolContext(sb), "run_terminal",
                        {"command": "python3 -c 'bytearray(1024**3)'"})
        if cgroup is not None and cgroup.limits_memory:
            assert out.output.startswith("exit code: 137 (a process was killed for passing the "
                                         "sandbox's memory limit of 128 MiB)"), out.output
        else:  # RLIMIT_AS for one process: its own MemoryError, and a hint why
            assert out.output.startswith("exit code: 1 (an allocation may have failed: each process may "
                                         "use at most 128 MiB of address space)\n"), out.output
            assert "MemoryError" in out.output
        assert call_tool(default_tools(), ToolContext(sb), "run_terminal",
                         {"command": "echo fine"}).output == "exit code: 0\nfine"
