"""Tamper evidence (pure): canaries, the reporter's stream, and what they prove.

The grader (`atelier.tasks.grade`) runs the tests with the reporter
(`atelier.tasks.reporter`) and hands this module the raw bytes the reporter
wrote on its channel. `read_stream` checks every record (nonce, sequence,
process, closing record) and `verdict` turns the records into per-test
statuses and a list of tamper reasons. Nothing here touches a sandbox.

A run is `tampered` (reward 0, never an infrastructure error) when any of:
- the stream is missing, short (no closing record, a record count that does
  not match) or has records after the closing one;
- a line is not a record with this grading's nonce, a sequence number is out
  of order, or a record comes from another process (a forked child);
- the exit code of the process is not the one pytest returned;
- a guarded object of pytest, pluggy or unittest, `sys.exit`, `os._exit` or
  `atexit` changed, or test machinery was imported from the workspace;
- a test phase raised an exception but was reported as passed;
- an outcome-deciding hook is implemented by a file the patch changed (or by
  code with no file), or a skip was raised from a file the patch changed;
- a canary did not get its expected outcome.
Canaries and the closing of the session are only checked when pytest ran
the tests (exit 0 or 1): a collection, usage or internal error scores 0
whatever the records say, and a patch that breaks an import is wrong, not
tampering.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
from typing import Iterable

TAMPERED = "tampered: "
"""Prefix of `GradeResult.error` for a tampered run: callers that only keep
the error text (eval records, RL trajectories) still count tampering."""

WORKSPACE = "/workspace"
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def is_tampered(error: str | None) -> bool:
    """Whether a grading error says the run was tampered with."""
    return bool(error) and error.startswith(TAMPERED)


# --- canaries ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Canaries:
    path: str
    """Workspace-relative path of the canary module."""
    source: str
    expected: dict[str, str]
    """Node id → the status it must get."""
    functions: tuple[str, ...]
    """Plain test functions (collected whatever `python_functions` says)."""


def make_canaries(test_files: list[str], token: str, *, with_unittest: bool = True) -> Canaries:
    """A canary module next to the first test file, its names made from
    `token` (random hex): a test that must pass, one that must fail, one
    whose fixture errors, and a unittest case that must pass and one that
    must fail (a patched assertion method lets it pass)."""
    directory = posixpath.dirname(test_files[0]) if test_files else ""
    t = [token[i:i + 6] for i in range(0, 30, 6)]
    a, b = int(token[:4], 16) + 1, int(token[4:8], 16) + 2
    path = posixpath.join(directory, f"test_{t[0]}.py")
    fix, ok, bad, err = f"res_{t[1]}", f"test_{t[2]}_ok", f"test_{t[2]}_bad", f"test_{t[3]}"
    cls = f"Test{t[4].upper()}"
    source = (
        "import unittest\n\nimport pytest\n\n\n"
        f"@pytest.fixture\ndef {fix}():\n    raise RuntimeError('fails at setup')\n\n\n"
        f"def {ok}():\n    assert {a} + {b} == {a + b}\n\n\n"
        f"def {bad}():\n    assert {a} + {b} == {a + b + 1}\n\n\n"
        f"def {err}({fix}):\n    pass\n"
    )
    expected = {f"{path}::{ok}": "passed", f"{path}::{bad}": "failed", f"{path}::{err}": "error"}
    if with_unittest:
        source += (f"\n\nclass {cls}(unittest.TestCase):\n"
                   f"    def test_same(self):\n        self.assertEqual({a}, {a})\n\n"
                   f"    def test_differ(self):\n        self.assertEqual({a}, {b})\n")
        expected.update({f"{path}::{cls}::test_same": "passed",
                         f"{path}::{cls}::test_differ": "failed"})
    return Canaries(path, source, expected, (ok, bad, err))


# --- the stream ---------------------------------------------------------------
@dataclasses.dataclass
class Stream:
    records: list[dict]
    problems: list[str]
    """Tamper reasons found in the stream itself."""

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("k") == kind]

    def last(self, kind: str) -> dict | None:
        found = self.of(kind)
        return found[-1] if found else None


def read_stream(data: bytes, nonce: str, *, complete: bool = True) -> Stream:
    """Parse and check the reporter's bytes. `complete=False` (the run timed
    out) leaves out the reasons that only say the stream stops early."""
    records: list[dict] = []
    problems: list[str] = []
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines and complete:
        problems.append("the result stream ends in the middle of a record")
        lines.pop()
    foreign = 0
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or rec.get("n") != nonce:
            foreign += 1
            continue
        records.append(rec)
    if foreign:
        problems.append(f"{foreign} line(s) on the result channel without this grading's nonce: "
                        "something besides the reporter wrote on it")
    if not records:
        if complete:
            problems.append("no result stream: the reporter never wrote (the run did not start "
                            "pytest through it, or stopped it)")
        return Stream(records, problems)
    if records[0].get("k") != "start":
        problems.append("the result stream does not begin with the reporter's start record")
    pids = {r.get("pid") for r in records}
    if len(pids) > 1:
        problems.append(f"records from {len(pids)} processes: a forked process reported")
    if [r.get("i") for r in records] != list(range(len(records))):
        problems.append("records out of sequence: records were lost or a second writer used "
                        "the channel")
    ends = [i for i, r in enumerate(records) if r.get("k") == "end"]
    if ends:
        if ends[0] != len(records) - 1:
            problems.append("records after the closing record")
        if records[ends[0]].get("count") != ends[0] + 1:
            problems.append("the closing record's count does not match the records received")
    elif complete:
        problems.append("the result stream has no closing record: the run ended before pytest "
                        "returned (an early exit, a killed or removed reporter)")
    return Stream(records, problems)


# --- what the records prove ---------------------------------------------------
@dataclasses.dataclass
class Verdict:
    results: dict[str, str] | None
    """Node id → status, canaries included; None when no test was reported
    and the session never finished."""
    exit_code: int | None
    """pytest's exit code as the reporter saw it (`pytest.main`'s return)."""
    tamper: list[str]
    canaries_ok: bool | None = None
    """Whether every canary got the outcome it must (each wrong one is also
    a `tamper` reason); None when the tests did not run, so none was checked."""


def phase_status(phases: list[tuple[str, str]]) -> str | None:
    """A test's status from its reported (phase, outcome) pairs, as JUnit
    counts it: a failing setup or teardown is an error, the call decides
    otherwise, a skipped setup is a skip; None when the call never ran."""
    status: str | None = None
    for when, outcome in phases:
        if outcome == "error" or (outcome == "failed" and when != "call"):
            new = "error"
        elif when == "call" or outcome == "skipped":
            new = outcome
        else:
            continue
        if status is None or _RANK[new] > _RANK[status]:
            status = new
    return status


def changed_paths(patch: str) -> set[str]:
    """Workspace-relative paths a unified diff touches (both sides of a rename)."""
    paths: set[str] = set()
    for line in patch.splitlines():
        m = re.match(r"^diff --git a/(\S+) b/(\S+)", line)
        if m:
            paths.update(m.groups())
            continue
        m = re.match(r"^(?:---|\+\+\+) [ab]/(\S+)", line)
        if m:
            paths.add(m.group(1))
    return paths


def _relative(file: str, workspace: str = WORKSPACE) -> str | None:
    """`file` relative to the workspace (the test process's working
    directory, as its start record says), or None outside it."""
    root = workspace.rstrip("/") + "/"
    if file.startswith(root):
        return posixpath.normpath(file[len(root):])
    return None


def verdict(stream: Stream, *, process_exit: int | None, canaries: Canaries,
            changed: Iterable[str] = (), restored: Iterable[str] = ()) -> Verdict:
    """Statuses and tamper reasons from a checked stream. `changed`: files
    the patch touched; `restored`: files the grader put back before the run
    (their content is the task's whatever the patch did)."""
    tamper = list(stream.problems)
    suspicious = set(changed) - set(restored)
    start = stream.last("start")
    workspace = str((start or {}).get("cwd") or WORKSPACE)
    phases: dict[str, list[tuple[str, str]]] = {}
    for rec in stream.of("report"):
        node, when, outcome = str(rec.get("id")), str(rec.get("when")), str(rec.get("outcome"))
        phases.setdefault(node, []).append((when, outcome))
        if rec.get("raised") and outcome == "passed":
            tamper.append(f"{node}: the {when} phase raised {rec['raised']} but was reported passed")
    for rec in [*stream.of("report"), *stream.of("collect")]:
        at = _relative(str(rec.get("at") or ""), workspace)
        if at is not None and at in suspicious:
            tamper.append(f"{rec.get('id')}: skipped from {at}, a file the patch changed")
    if start and start.get("shadowed"):
        tamper.append("test machinery imported from the workspace: " + ", ".join(start["shadowed"]))
    for rec in stream.of("integrity"):
        tamper.append(f"test machinery changed ({rec.get('at')}): " + ", ".join(rec.get("changed", [])[:8]))
    for rec in stream.of("hook"):
        file = str(rec.get("file"))
        rel = _relative(file, workspace)
        if rel is None:
            tamper.append(f"{rec.get('hook')} is implemented by code outside the environment and "
                          f"the repository ({file})")
        elif rel in suspicious:
            tamper.append(f"{rec.get('hook')} is implemented in {rel}, a file the patch changed")
    results = {node: s for node, ph in phases.items() if (s := phase_status(ph)) is not None}
    finish, end = stream.last("finish"), stream.last("end")
    exit_code = end.get("code") if end else (finish.get("exitstatus") if finish else None)
    if end and finish and finish.get("exitstatus") != end.get("code"):
        tamper.append(f"pytest's session ended with status {finish.get('exitstatus')} "
                      f"but returned {end.get('code')}")
    if end and process_exit is not None and process_exit != end.get("code"):
        tamper.append(f"the process exited {process_exit} after pytest returned {end.get('code')}: "
                      "something ran after the session and changed the exit status")
    status = finish.get("exitstatus") if finish else (end.get("code") if end else None)
    ran = status in (0, 1)
    if end and not finish and ran:
        tamper.append("pytest returned without finishing the session through the reporter")
    wrong = []
    if ran:  # the tests ran (not a collection, usage or internal error, which score 0 anyway)
        for node, want in canaries.expected.items():
            got = results.get(node, "missing")
            if got != want:
                wrong.append(f"canary {node.rsplit('::', 1)[-1]} should have {want}, got {got}")
    return Verdict(results if (results or end or finish) else None, exit_code, tamper + wrong,
                   canaries_ok=not wrong if ran else None)
