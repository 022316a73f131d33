"""The grader's pure parts: the change-set filter's rules, the verdict from exit code and JUnit
report, and the task lock's spec (``runtime_shim.grading.changes``, ``.verdict``,
``runtime_shim.node.tasklock``)."""

from __future__ import annotations

import pytest

from envbuild.errors import RuntimeShimError
from envbuild.layers import Entry
from runtime_shim.grading.changes import ChangeLimits, ChangeRules, Dropped, change_filter
from runtime_shim.grading.verdict import decide, junit_outcomes
from runtime_shim.node.tasklock import TaskSpec

ENV = "sha256:" + "a" * 64
SPEC = TaskSpec(name="t", env_lock=ENV, workdir="/workspace", run="pytest", timeout=60,
                editable=("/workspace/pkg",), must_pass=("tests/test_h.py::test_a",),
                keep_passing=("tests/test_core.py::TestC::test_b",),
                junit="/tmp/g/junit.xml", allow=("/workspace/pkg/setup.cfg",))
RULES = ChangeRules.of(SPEC, ["workspace/tests/test_h.py"])


def _why(path: str, type_: str = "file", linkname: str = "") -> str | None:
    return RULES.verdict_on(Entry(path=path, type=type_, linkname=linkname))


@pytest.mark.parametrize("path,type_,linkname,reason", [
    ("workspace/pkg/mod.py", "file", "", None),
    ("workspace/pkg/sub", "dir", "", None),
    ("workspace", "dir", "", None),                          # above: holds the kept files
    ("workspace/pkg/.wh.old.py", "file", "", None),          # the agent deleted its own file
    ("workspace/pkg/link", "symlink", "mod.py", None),
    ("workspace/pkg/setup.cfg", "file", "", None),           # the task allows it
    ("usr/bin/python3.11", "file", "", "outside the editable paths"),
    ("bin/sh", "symlink", "/tmp/x", "outside the editable paths"),
    ("usr", "dir", "", "outside the editable paths"),
    ("workspace/tests/.wh.test_core.py", "file", "", "outside the editable paths"),
    ("workspace/.wh..wh..opq", "file", "", "opaque directory outside the editable paths"),
    ("workspace/pkg/conftest.py", "file", "", "test settings (conftest.py)"),
    ("workspace/pkg/pyproject.toml", "file", "", "test settings (pyproject.toml)"),
    ("workspace/pkg/sitecustomize.py", "file", "", "interpreter start-up file (sitecustomize.py)"),
    ("workspace/pkg/x.pth", "file", "", "path configuration file (.pth), run at interpreter "
                                        "start-up"),
    ("workspace/pkg/.wh.conftest.py", "file", "", "deletes test settings (conftest.py)"),
    ("workspace/pkg/__pycache__/mod.cpython-311.pyc", "file", "",
     "compiled cache (rebuilt from the graded source)"),
    ("workspace/pkg/.git/hooks/pre-commit", "file", "",
     "git metadata (hooks, config, refs and objects stay the env's)"),
    ("workspace/pkg/link", "symlink", "/proc/self/environ",
     "symlink leaving the editable paths (-> /proc/self/environ)"),
    ("workspace/pkg/link", "symlink", "../tests/test_h.py",
     "symlink leaving the editable paths (-> ../tests/test_h.py)"),
    ("workspace/pkg/link", "symlink", "sub/../../../etc/passwd",
     "symlink leaving the editable paths (-> sub/../../../etc/passwd)"),
])
def test_rules(path, type_, linkname, reason):
    assert _why(path, type_, linkname) == reason


def test_open_task_rules_protect_hidden_named_tests_and_junit():
    spec = TaskSpec(name="t", env_lock=ENV, workdir="/workspace", run="pytest", timeout=60,
                    editable=("/workspace",), must_pass=("tests/test_h.py::test_a",),
                    junit="/workspace/.grade/junit.xml")
    rules = ChangeRules.of(spec, ["workspace/tests/test_h.py", "workspace/tests/h2/test_x.py"])
    why = {p: rules.verdict_on(Entry(path=p, type="file")) for p in (
        "workspace/tests/test_h.py", "workspace/tests/.wh.test_h.py",
        "workspace/tests/h2/__init__.py", "workspace/.grade/junit.xml",
        "workspace/tests/test_mine.py", "workspace/conftest.py")}
    assert why == {"workspace/tests/test_h.py": "a hidden test path",
                   "workspace/tests/.wh.test_h.py": "deletes a hidden test path",
                   "workspace/tests/h2/__init__.py": "changes how the hidden tests import",
                   "workspace/.grade/junit.xml": "the grade's JUnit report path",
                   "workspace/tests/test_mine.py": None,
                   "workspace/conftest.py": "test settings (conftest.py)"}


def test_filter_drops_hardlinks_to_dropped_files_and_caps_sizes():
    rules = ChangeRules.of(SPEC, [], ChangeLimits(max_file_bytes=10, max_total_bytes=15,
                                                  max_entries=100))
    dropped = Dropped()
    entries = [Entry(path="workspace", type="dir"),
               Entry(path="workspace/pkg/conftest.py", type="file", size=1),
               Entry(path="workspace/pkg/alias.py", type="hardlink",
                     linkname="workspace/pkg/conftest.py"),
               Entry(path="workspace/pkg/a.py", type="file", size=8),
               Entry(path="workspace/pkg/big.py", type="file", size=11),
               Entry(path="workspace/pkg/b.py", type="file", size=8),
               Entry(path="etc", type="dir")]
    kept = [e.path for e, _ in change_filter(rules, dropped)((e, None) for e in entries)]
    assert kept == ["workspace", "workspace/pkg/a.py"]
    assert {d["path"]: d["reason"] for d in dropped.listed} == {
        "/workspace/pkg/conftest.py": "test settings (conftest.py)",
        "/workspace/pkg/alias.py": "hardlink to dropped workspace/pkg/conftest.py",
        "/workspace/pkg/big.py": "file of 11 bytes, over the 10-byte limit",
        "/workspace/pkg/b.py": "change set over 15 bytes"}   # a dir outside is not listed


def test_dropped_lists_a_bounded_number():
    dropped = Dropped()
    for i in range(600):
        dropped.add(f"tmp/{i}", "outside the editable paths")
    assert len(dropped.listed) == 500 and dropped.more == 100


JUNIT = b"""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_h" name="test_a" time="0.001"/>
<testcase classname="tests.test_core.TestC" name="test_b"><failure message="x">boom</failure>
</testcase>
<testcase classname="tests.test_h" name="test_s"><skipped message="s"/></testcase>
</testsuite></testsuites>"""


def test_junit_outcomes_use_pytest_node_ids():
    out = junit_outcomes(JUNIT)
    assert out["tests/test_h.py::test_a"] == ["passed"]
    assert out["tests/test_core.py::TestC::test_b"] == ["failed"]
    assert out["tests/test_h.py::test_s"] == ["skipped"]
    assert out["tests.test_h::test_a"] == ["passed"]


def test_decide_needs_exit_zero_and_every_named_test_passed():
    named = ("tests/test_h.py::test_a",)
    assert decide(0, False, named, JUNIT) == (True, {"tests/test_h.py::test_a": "passed"}, "")
    passed, _, reason = decide(1, False, named, JUNIT)
    assert not passed and reason == "the grade command exited 1"
    passed, tests, reason = decide(0, False, ("tests/test_h.py::test_s", "tests/x.py::y"), JUNIT)
    assert not passed and tests == {"tests/test_h.py::test_s": "skipped",
                                    "tests/x.py::y": "missing"}
    passed, tests, _ = decide(0, False, named, JUNIT.replace(b"</testsuite>", (
        b'<testcase classname="tests.test_h" name="test_a"/></testsuite>')))
    assert not passed and tests == {"tests/test_h.py::test_a": "repeated"}
    assert decide(None, True, (), None)[0:3:2] == (False, "the grade command timed out")
    assert decide(0, False, (), None) == (True, {}, "")
    assert decide(0, False, named, None)[2].startswith("no JUnit report")


@pytest.mark.parametrize("report,message", [
    (b'<!DOCTYPE x [<!ENTITY a "aaaa">]><testsuites/>', "DOCTYPE"),
    (b"<testsuites>", "not XML"),
    (b" " * (16 << 20) + b"<x/>", "over"),
])
def test_hostile_reports_fail_the_named_tests(report, message):
    passed, tests, reason = decide(0, False, ("tests/test_h.py::test_a",), report)
    assert not passed and tests == {"tests/test_h.py::test_a": "missing"} and message in reason


def test_task_spec_round_trips_and_refuses_other_shapes():
    doc = SPEC.to_json()
    assert TaskSpec.from_json(doc, "here") == SPEC
    for bad in ({**doc, "version": "envbuild.task.v0"}, {**doc, "env_lock": "sha256:x"},
                {**doc, "workdir": "/workspace/../etc"}, {**doc, "editable": []},
                {**doc, "grade": {**doc["grade"], "timeout": 0}}, [doc],
                {**doc, "editable": ["relative"]}):
        with pytest.raises(RuntimeShimError):
            TaskSpec.from_json(bad, "here")
