"""The reporter: the grader's half of the result channel, run inside the tested interpreter.

This file is never imported from the workspace. The grader (`atelier.tasks.grade`)
sends its source text on the test process's stdin together with the run's
configuration (nonce, pytest arguments, canaries); `BOOTSTRAP`, given to
`python -I -c`, reads it all, closes stdin and runs `main`. Everything below
therefore happens before any code of the workspace is imported:

1. The stdout pipe (opened by the grader before the process started) is
   moved to a private descriptor, the channel; descriptor 1 becomes a copy of
   stderr, so whatever anything else prints lands in the log, never on the
   channel. stdin becomes /dev/null: the nonce cannot be read again.
2. pytest, its runner/report/collection modules, pluggy and unittest are
   imported from the environment (`-I`: no workspace entry on `sys.path`, no
   PYTHONPATH, no user site), so a `pytest.py` or `unittest.py` in the
   workspace shadows nothing; then the workspace goes on `sys.path` where
   `python -m pytest` (or the `pytest` script) would have put it.
3. `Guard` records the identity of the objects that decide and report
   outcomes (see `guarded`), and the plugin re-checks them before and after
   every test and at the end of the session.
4. `pytest.main` runs with the plugin registered first. The plugin writes one
   JSON line per event on the channel, each with the nonce, a sequence number
   and the pid; after `pytest.main` returns, `main` writes the closing record
   ("end", with the record count and the exit code). Only a run that reached
   that line writes it.

Records ("k"): "start"; "collected" (how many); "deselected"; "collect"
(a collector that failed or was skipped); "report" (one per test phase that
is not a passing setup/teardown: node id, phase, outcome, whether the phase
raised a real exception, where a skip was raised); "hook" (an outcome-deciding
hook implemented in a workspace file or in code with no file); "integrity"
(guarded objects that changed); "finish" (pytest's exit status, from
`pytest_sessionfinish`); "end".

Python 3.8+ and pytest 6+ compatible: it runs in the task's interpreter (with
pytest < 6, canaries must match `python_functions` to be collected).
"""

from __future__ import annotations

import json
import operator
import os
import sys

BOOTSTRAP = (
    "def _atelier_bootstrap():\n"
    "    import sys, json\n"
    "    data = json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
    "    scope = {'__name__': data['config']['module']}\n"
    "    exec(compile(data.pop('source'), '<atelier-reporter>', 'exec'), scope)\n"
    "    return scope['main'](data.pop('config'))\n"
    "raise SystemExit(_atelier_bootstrap())\n"
)
"""What `python -I -c` runs: read the reporter and its configuration from
stdin, run it. Nothing secret is on the command line."""

OUTCOME_HOOKS = (
    "pytest_runtest_protocol", "pytest_runtest_makereport", "pytest_runtest_logreport",
    "pytest_report_teststatus", "pytest_runtest_setup", "pytest_runtest_call",
    "pytest_runtest_teardown", "pytest_pyfunc_call", "pytest_runtestloop",
    "pytest_collection", "pytest_collection_modifyitems", "pytest_deselected",
    "pytest_collect_file", "pytest_pycollect_makeitem", "pytest_make_collect_report",
    "pytest_collectreport", "pytest_itemcollected", "pytest_sessionfinish",
)
"""Hooks whose implementations decide which tests run and what their
outcome is; a new implementation of one from a workspace file is reported."""

PRELOADED = ("pytest", "_pytest", "_pytest.runner", "_pytest.reports", "_pytest.python",
             "_pytest.main", "_pytest.unittest", "_pytest.skipping", "_pytest.outcomes",
             "_pytest.fixtures", "_pytest.nodes", "_pytest.config", "pluggy", "unittest",
             "unittest.case", "unittest.result", "atexit", "builtins", "os", "sys")
"""Imported from the environment before the workspace is on the path; their
`sys.modules` entries are guarded."""


def guarded() -> list[tuple[str, object, str]]:
    """(label, owner, attribute) of every guarded object: pytest's call,
    report, run and skip machinery, pluggy's hook calling, unittest's run and
    assertion methods, process exit and exit hooks."""
    import atexit
    import unittest.case
    import unittest.result

    import _pytest.outcomes
    import _pytest.python
    import _pytest.reports
    import _pytest.runner
    import _pytest.skipping
    import _pytest.unittest
    import pluggy

    spec: list[tuple[str, object, tuple[str, ...]]] = [
        ("_pytest.runner", _pytest.runner, ("runtestprotocol", "call_and_report", "call_runtest_hook",
                                            "pytest_runtest_makereport", "pytest_runtest_protocol",
                                            "check_interactive_exception", "CallInfo")),
        ("CallInfo", _pytest.runner.CallInfo, ("from_call", "__init__")),
        ("_pytest.reports", _pytest.reports, ("TestReport", "CollectReport", "BaseReport")),
        ("TestReport", _pytest.reports.TestReport, ("from_item_and_call", "__init__")),
        ("BaseReport", _pytest.reports.BaseReport, ("passed", "failed", "skipped", "outcome")),
        ("_pytest.python", _pytest.python, ("pytest_pyfunc_call", "Function")),
        ("Function", _pytest.python.Function, ("runtest", "setup", "_getobj")),
        ("_pytest.skipping", _pytest.skipping, ("pytest_runtest_makereport", "pytest_runtest_setup",
                                                "pytest_runtest_call", "evaluate_skip_marks",
                                                "evaluate_xfail_marks")),
        ("_pytest.unittest", _pytest.unittest, ("pytest_runtest_makereport", "TestCaseFunction")),
        ("TestCaseFunction", _pytest.unittest.TestCaseFunction,
         ("runtest", "addError", "addFailure", "addSkip", "addSuccess", "addExpectedFailure",
          "addUnexpectedSuccess", "_addexcinfo")),
        ("_pytest.outcomes", _pytest.outcomes, ("fail", "skip", "xfail", "exit", "Skipped",
                                                "Failed", "OutcomeException", "XFailed")),
        ("pluggy.HookCaller", _lookup("pluggy", "HookCaller") or _lookup("pluggy._hooks", "_HookCaller"),
         ("__call__", "call_historic", "get_hookimpls")),
        ("pluggy.PluginManager", pluggy.PluginManager, ("_hookexec", "register", "unregister")),
        ("pluggy._callers", sys.modules.get("pluggy._callers"), ("_multicall",)),
        ("unittest.TestCase", unittest.case.TestCase,
         tuple(n for n in vars(unittest.case.TestCase)
               if n.startswith(("assert", "fail", "_call", "run", "debug", "doCleanups", "_addSkip",
                                "_feedErrorsToResult", "skipTest", "_formatMessage", "_getAssertEqualityFunc",
                                "_baseAssertEqual")) or n == "__call__")),
        ("unittest.case", unittest.case, ("_Outcome", "TestCase", "SkipTest", "expectedFailure", "skip")),
        ("unittest._Outcome", unittest.case._Outcome, ("testPartExecutor",)),
        ("unittest.TestResult", unittest.result.TestResult,
         ("addFailure", "addError", "addSuccess", "addSkip", "addSubTest", "wasSuccessful")),
        ("sys", sys, ("exit",)),
        ("os", os, ("_exit", "abort", "kill", "fork", "write", "dup2", "close")),
        ("atexit", atexit, ("register", "unregister", "_run_exitfuncs")),
    ]
    out = []
    for label, owner, names in spec:
        if owner is None:
            continue
        for name in names:
            if name in vars(owner):
                out.append((f"{label}.{name}", owner, name))
    return out


def _lookup(module: str, name: str) -> object:
    return getattr(sys.modules.get(module), name, None)


class Guard:
    """Identities taken once, compared on every `changed()` call. The common
    case (nothing changed) is one C-level `itemgetter` and `is` per owner."""

    def __init__(self) -> None:
        # vars() of a class is a live view of its dict: taken once per owner, not per check.
        spaces: dict[int, object] = {}
        self.items = []
        groups: dict[int, tuple[object, list[str], list[object]]] = {}
        for label, owner, name in guarded():
            space = spaces.setdefault(id(owner), vars(owner))
            self.items.append((label, space, name, space[name]))
            group = groups.setdefault(id(owner), (space, [], []))
            group[1].append(name)
            group[2].append(space[name])
        self.groups = [(space, operator.itemgetter(*names), tuple(objs) if len(objs) > 1 else objs[0])
                       for space, names, objs in groups.values()]
        self.modules = {name: sys.modules[name] for name in PRELOADED if name in sys.modules}
        self.module_names = operator.itemgetter(*self.modules)
        self.module_objs = tuple(self.modules.values())
        self.reported: set[str] = set()

    def _same(self) -> bool:
        try:
            for space, get, expected in self.groups:
                now = get(space)
                if now is not expected and (type(now) is not tuple or len(now) != len(expected)
                                            or not all(map(operator.is_, now, expected))):
                    return False
            return all(map(operator.is_, self.module_names(sys.modules), self.module_objs))
        except KeyError:
            return False

    def changed(self) -> list[str]:
        """Labels of guarded objects that are no longer what they were, each
        reported once."""
        if self._same():
            return []
        bad = [label for label, space, name, obj in self.items if space.get(name) is not obj]
        bad += [f"sys.modules[{name!r}]" for name, mod in self.modules.items()
                if sys.modules.get(name) is not mod]
        new = [b for b in bad if b not in self.reported]
        self.reported.update(new)
        return new


def emitter(fd: int, nonce: str):
    """`emit(kind, **fields)`: one JSON line on `fd`. A write error stops the
    channel for good (the grader then sees a short stream)."""
    state = {"i": 0, "broken": False}
    write, dumps, getpid = os.write, json.dumps, os.getpid

    def emit(kind: str, **fields: object) -> None:
        if state["broken"]:
            return
        record = {"n": nonce, "i": state["i"], "pid": getpid(), "k": kind, **fields}
        if kind == "end":
            record["count"] = state["i"] + 1
        state["i"] += 1
        data = (dumps(record, default=str) + "\n").encode("utf-8", "replace")
        try:
            while data:
                data = data[write(fd, data):]
        except OSError:
            state["broken"] = True

    return emit


def _path_of(node) -> str:
    return str(getattr(node, "path", None) or node.fspath)


def _skip_location(report) -> str | None:
    longrepr = getattr(report, "longrepr", None)
    if report.skipped and isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[0])
    return None


def trusted_roots(pytest) -> tuple[str, ...]:
    """Directories whose code is the environment's, not the patch's: the
    interpreter's prefixes and the site directory pytest came from."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix,
             os.path.dirname(os.path.dirname(pytest.__file__))}
    roots |= {os.path.realpath(r) for r in roots}
    return tuple(r.rstrip("/") + "/" for r in roots)


def _untrusted_hooks(hook, plugin, last_impls: dict[str, list], seen_impls: set[int], cwd_prefix: str,
                     trusted: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(hook, file, function) of each outcome-hook implementation not seen before that lives
    outside the `trusted` roots or inside the working directory (`plugin`'s own excepted)."""
    found = []
    for name in OUTCOME_HOOKS:
        caller = getattr(hook, name, None)
        if caller is None:
            continue
        impls = caller.get_hookimpls()
        if impls == last_impls.get(name):  # identity per element, in C
            continue
        last_impls[name] = impls
        for impl in impls:
            if id(impl.function) in seen_impls:
                continue
            seen_impls.add(id(impl.function))
            code = getattr(impl.function, "__code__", None)
            file = getattr(code, "co_filename", "") or ""
            if impl.plugin is plugin:
                continue
            if file.startswith(cwd_prefix) or not file.startswith(trusted) or not os.path.isfile(file):
                found.append((name, file, getattr(impl.function, "__qualname__", "?")))
    return found


def _collect_canary(pytest, collector, name: str, obj):
    """The canary test function `name`, collected whatever `python_functions` says (pytest 6+)."""
    return pytest.Function.from_parent(collector, name=name, callobj=obj) if hasattr(
        pytest.Function, "from_parent") else None


def _report_fields(report, call, skip_types: tuple[type, ...]) -> dict | None:
    """What a test phase's report says (outcome, the exception raised, where a skip came from,
    xfail); None for a passing setup or teardown, which says nothing new."""
    excinfo = call.excinfo
    raised = None
    if excinfo is not None and not isinstance(excinfo.value, skip_types):
        raised = type(excinfo.value).__name__
    if report.when != "call" and report.passed and raised is None:
        return None
    extra = {"raised": raised, "at": _skip_location(report), "xfail": hasattr(report, "wasxfail")}
    return {"id": report.nodeid, "when": report.when, "outcome": report.outcome,
            **{k: v for k, v in extra.items() if v}}


def make_plugin(pytest, emit, guard: Guard, cwd: str, canary_file: str | None,
                canary_functions: list[str]):
    """The plugin object (its name is random: `-p no:NAME` cannot block it). It reports hook
    implementations from files outside `trusted_roots` or inside `cwd`."""
    # A class built here: its hook markers need the pytest just imported, and its methods close
    # over the emitter and guard, which must not be reachable as module globals.
    import unittest

    trusted_roots_, cwd_prefix = trusted_roots(pytest), cwd.rstrip("/") + "/"
    skip_types = (pytest.skip.Exception, unittest.SkipTest)

    class Reporter:
        __name__ = f"atelier_{os.urandom(6).hex()}"

        def __init__(self) -> None:
            self.config, self.started = None, False
            self.seen_impls: set[int] = set()
            self.last_impls: dict[str, list] = {}

        def check(self, where: str) -> None:
            changed = guard.changed()
            if changed:
                emit("integrity", at=where, changed=changed)
            if self.config is None:
                return
            for name, file, function in _untrusted_hooks(self.config.pluginmanager.hook, self, self.last_impls,
                                                         self.seen_impls, cwd_prefix, trusted_roots_):
                emit("hook", at=where, hook=name, file=file, function=function)

        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionstart(self, session) -> None:
            self.config = session.config
            self.check("sessionstart")

        @pytest.hookimpl(tryfirst=True)
        def pytest_pycollect_makeitem(self, collector, name, obj):
            # The canaries are collected whatever `python_functions` says.
            if canary_file and name in canary_functions and _path_of(collector) == canary_file:
                return _collect_canary(pytest, collector, name, obj)
            return None

        def pytest_collectreport(self, report) -> None:
            if not report.passed:
                emit("collect", id=report.nodeid, outcome=report.outcome, at=_skip_location(report))

        def pytest_deselected(self, items) -> None:
            emit("deselected", ids=[item.nodeid for item in items])

        @pytest.hookimpl(trylast=True)
        def pytest_collection_finish(self, session) -> None:
            emit("collected", count=len(session.items))
            self.check("collection")

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtest_protocol(self, item, nextitem):
            # Nothing runs between two tests' protocols: the check after one is the check before the next.
            if not self.started:
                self.started = True
                self.check(f"before {item.nodeid}")
            yield
            self.check(f"after {item.nodeid}")

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtest_makereport(self, item, call):
            outcome = yield
            try:
                report = outcome.get_result()
            except BaseException as exc:  # the hook itself failed: say so
                emit("report", id=item.nodeid, when=call.when, outcome="error", raised=type(exc).__name__)
                return
            fields = _report_fields(report, call, skip_types)
            if fields is not None:
                emit("report", **fields)

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session, exitstatus) -> None:
            self.check("sessionfinish")
            emit("finish", exitstatus=int(exitstatus))

    return Reporter()


def main(config: dict) -> int:
    """Run pytest as the grader asked, reporting on the channel; returns the
    exit code."""
    chan = os.dup(1)  # not inheritable: subprocesses of the tests never get it
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.dont_write_bytecode = True
    emit = emitter(chan, config.pop("nonce"))
    cwd = os.getcwd()
    for name in PRELOADED:
        __import__(name)
    import pytest

    guard = Guard()
    shadowed = [name for name in PRELOADED
                if str(getattr(sys.modules[name], "__file__", "") or "").startswith(cwd.rstrip("/") + "/")]
    emit("start", pytest=pytest.__version__, python=sys.version.split()[0], shadowed=shadowed, cwd=cwd)
    script = config.get("script")
    sys.path.insert(0, os.path.dirname(script) if script else cwd)
    args = list(config["args"])
    sys.argv = [script or os.path.join(os.path.dirname(pytest.__file__), "__main__.py"), *args]
    canary = config.get("canary_file")
    plugin = make_plugin(pytest, emit, guard, cwd, canary and os.path.join(cwd, canary),
                         list(config.get("canary_functions", ())))
    run = pytest.main
    code = int(run(args, plugins=[plugin]))
    emit("end", code=code)
    return code
