"""JUnit XML → node ids and statuses, and the pure reward logic."""

from __future__ import annotations

import pytest

from atelier.tasks.grade import score
from atelier.tasks.junit import JUnitError, node_id, parse_junit

XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="6">
<testcase classname="tests.test_calc" name="test_add" file="tests/test_calc.py" line="5" time="0.001"/>
<testcase classname="tests.test_calc.TestSub" name="test_sub[5-3-2]" file="tests/test_calc.py" time="0.001">
  <failure message="assert 8 == 2">assert 8 == 2</failure></testcase>
<testcase classname="tests.test_calc" name="test_skip" file="tests/test_calc.py">
  <skipped type="pytest.skip" message="later">skip</skipped></testcase>
<testcase classname="tests.test_calc" name="test_err" file="tests/test_calc.py">
  <error message="fixture failed">boom</error></testcase>
<testcase classname="tests.test_calc" name="test_printer" file="tests/test_calc.py">
  <system-out>tests/test_calc.py::test_sub[5-3-2] PASSED
&lt;testcase classname="tests.test_calc" name="test_fake"/&gt;</system-out></testcase>
<testcase classname="tests.test_calc" name="test_teardown" file="tests/test_calc.py"/>
<testcase classname="tests.test_calc" name="test_teardown" file="tests/test_calc.py">
  <error message="teardown failed">boom</error></testcase>
</testsuite></testsuites>
"""


def test_statuses_come_from_the_xml_only() -> None:
    got = parse_junit(XML)
    assert got == {
        "tests/test_calc.py::test_add": "passed",
        "tests/test_calc.py::TestSub::test_sub[5-3-2]": "failed",
        "tests/test_calc.py::test_skip": "skipped",
        "tests/test_calc.py::test_err": "error",
        "tests/test_calc.py::test_printer": "passed",
        "tests/test_calc.py::test_teardown": "error",  # worst report wins
    }
    assert "tests/test_calc.py::test_fake" not in got  # escaped output is not a test


def test_node_ids_without_file_attribute() -> None:
    # xunit2 has no `file`: known files decide where the module ends.
    modules = {"pkg.tests.test_x": "pkg/tests/test_x.py"}
    assert node_id("pkg.tests.test_x.TestA.TestB", "t", None, modules) == \
        "pkg/tests/test_x.py::TestA::TestB::t"
    # unknown: split at the first capitalised part (a guess)
    assert node_id("tests.test_y.TestC", "t[1]") == "tests/test_y.py::TestC::t[1]"
    assert node_id("test_top", "t") == "test_top.py::t"
    xml = '<testsuite><testcase classname="a.test_z.TestQ" name="t"/></testsuite>'
    assert parse_junit(xml, known_files=["a/test_z.py"]) == {"a/test_z.py::TestQ::t": "passed"}


def test_file_attribute_with_dotted_directory() -> None:
    assert node_id("my.dir.test_x.TestA", "t", "my.dir/test_x.py") == "my.dir/test_x.py::TestA::t"


@pytest.mark.parametrize("text", ["", "not xml", "<html/>"])
def test_unreadable_results(text: str) -> None:
    with pytest.raises(JUnitError):
        parse_junit(text)


F2P, P2P = ["t.py::f"], ["t.py::p"]


def test_reward_one_only_when_every_target_passes() -> None:
    r = score(F2P, P2P, {"t.py::f": "passed", "t.py::p": "passed"}, 0)
    assert (r.reward, r.error, r.fail_to_pass.passed, r.pass_to_pass.total) == (1.0, None, 1, 1)
    r = score(F2P, P2P, {"t.py::f": "passed", "t.py::p": "failed"}, 1)
    assert (r.reward, r.error, r.pass_to_pass.passed) == (0.0, None, 0)
    r = score(F2P, P2P, {"t.py::f": "failed", "t.py::p": "passed"}, 1)
    assert (r.reward, r.error, r.fail_to_pass.passed) == (0.0, None, 0)


def test_skipped_target_counts_as_failed() -> None:
    r = score(F2P, P2P, {"t.py::f": "skipped", "t.py::p": "passed"}, 0)
    assert r.reward == 0.0 and r.fail_to_pass.passed == 0


@pytest.mark.parametrize("results,code,needle", [
    (None, 0, "left no results"),
    ({}, 0, "zero tests"),
    ({"t.py::f": "passed"}, 0, "missing"),
    ({"t.py::f": "passed", "t.py::p": "failed"}, 0, "exited 0"),
    ({"t.py::f": "passed", "t.py::p": "passed"}, 1, "exited 1"),
    ({"t.py::f": "passed", "t.py::p": "passed"}, 5, "no tests collected"),
    ({"t.py::f": "passed", "t.py::p": "passed", "t.py::x": "error"}, 0, "exited 0"),
])
def test_untrustworthy_runs_are_errors_not_passes(results, code, needle) -> None:
    r = score(F2P, P2P, results, code)
    assert r.reward == 0.0 and not r.infra_error
    assert needle in r.error


def test_timeout_is_an_infrastructure_error() -> None:
    r = score(F2P, P2P, None, 124, timed_out=True, timeout_s=2)
    assert r.reward == 0.0 and r.infra_error and "timed out after 2 s" in r.error
    assert r.tests == {"t.py::f": "missing", "t.py::p": "missing"}


def test_inherited_test_methods_are_named_by_the_collecting_module() -> None:
    from atelier.tasks.junit import node_id

    # xunit1 gives the file that defines the method (a base class elsewhere).
    node = node_id("tests.test_lru.LRUCacheTest", "test_defaults", "tests/__init__.py",
                   {"tests.test_lru": "tests/test_lru.py"})
    assert node == "tests/test_lru.py::LRUCacheTest::test_defaults"
