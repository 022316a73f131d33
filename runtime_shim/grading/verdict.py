"""A grade's outcome (``Verdict``) and how it is decided from the grade command's exit code
and JUnit report (pure).

The JUnit XML is written inside the grading sandbox by the grade command, in which the
agent's code runs: it is hostile input like everything a sandbox returns. It is read bounded
(``MAX_JUNIT_BYTES``), parsed by the standard library's expat (which refuses external
entities and, since expat 2.4, entity-expansion bombs), and only ``testcase`` elements are
looked at. A test the task names is ``passed`` only when its testcase is present exactly once
with no ``failure``, ``error`` or ``skipped`` child; a missing, repeated or skipped one fails
the task (a skip is how a planted ``conftest.py`` would pass everything, were it kept).
"""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any

VERDICT_VERSION = "envbuild.verdict.v1"
MEDIA_TYPE_VERDICT = "application/vnd.envbuild.verdict.v1+json"
#: a recorded verdict is an OCI artifact manifest of this type (``runtime_shim.grading.grader``)
VERDICT_ARTIFACT_TYPE = "application/vnd.envbuild.verdict.v1"
#: on a recorded verdict: the digest of the task lock it graded against
ANNOTATION_TASK_LOCK = "org.envbuild.task.lock"
#: recorded verdicts' refs: ``verdict/TASK/ID``
VERDICT_REF_PREFIX = "verdict/"
MAX_JUNIT_BYTES = 16 << 20
#: the grade command's output kept in a verdict (its tail)
OUTPUT_TAIL_BYTES = 8 << 10


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What grading one change set of one task gave.

    ``passed``: the grade command exited 0 (not killed at its timeout) and every test the task
    names in ``must_pass`` / ``keep_passing`` passed. ``tests``: each named test's outcome
    (``passed``, ``failed``, ``error``, ``skipped``, ``missing``, ``repeated``); empty when the
    task names none. ``change_set``: the digest of the layer of the agent's changes that was
    graded (what was kept); ``dropped``: each change left out and why (``{path, reason}``),
    ``dropped_more`` how many more were not listed. ``seconds``: ``changes`` (reading and
    filtering them), ``create``, ``run``, ``total``. ``record``: the digest of this verdict's
    record in the store, an artifact manifest whose config is this verdict's JSON and whose
    layer is the change set (``verdict/TASK/ID``)."""

    passed: bool
    exit_code: int | None
    timed_out: bool
    output: str
    tests: Mapping[str, str]
    change_set: str
    dropped: Sequence[Mapping[str, str]]
    dropped_more: int
    task: str
    source: str
    grading_lock: str
    seconds: Mapping[str, float]
    reason: str = ""
    record: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {"version": VERDICT_VERSION, **dataclasses.asdict(self)}
        doc["tests"], doc["dropped"] = dict(self.tests), [dict(d) for d in self.dropped]
        doc["seconds"] = {k: round(v, 4) for k, v in self.seconds.items()}
        return doc


def junit_outcomes(data: bytes) -> dict[str, list[str]]:
    """Each testcase of a JUnit report by test id → its outcomes (one per occurrence). The id
    is pytest's node id rebuilt from ``file`` or ``classname`` and ``name``
    (``tests/test_x.py::test_y``, ``tests/test_x.py::TestC::test_y``), and also the plain
    ``classname::name``. ``ValueError`` for a report that is too big or not XML."""
    if len(data) > MAX_JUNIT_BYTES:
        raise ValueError(f"JUnit report of {len(data)} bytes, over {MAX_JUNIT_BYTES}")
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise ValueError("JUnit report declares a DOCTYPE or entities")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as e:
        raise ValueError(f"JUnit report is not XML: {e}") from None
    out: dict[str, list[str]] = {}
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                break
        for test_id in _ids(case.get("classname") or "", case.get("name") or "",
                            case.get("file")):
            out.setdefault(test_id, []).append(outcome)
    return out


def _ids(classname: str, name: str, file: str | None) -> set[str]:
    """pytest's node id(s) for a testcase: classname ``tests.test_x.TestC`` → file
    ``tests/test_x.py`` and class ``TestC`` (a dotted part that starts upper-case is a
    class), unless the report gives ``file``."""
    ids = {f"{classname}::{name}"}
    parts = classname.split(".")
    classes: list[str] = []
    while parts and parts[-1][:1].isupper():
        classes.insert(0, parts.pop())
    module = file or ("/".join(parts) + ".py" if parts else "")
    if module:
        ids.add("::".join([module, *classes, name]))
    return ids


def decide(exit_code: int | None, timed_out: bool, named: Sequence[str],
           report: bytes | None) -> tuple[bool, dict[str, str], str]:
    """``(passed, tests, reason)`` from the grade command's end and its report (pure)."""
    tests: dict[str, str] = {}
    reasons: list[str] = []
    if timed_out:
        reasons.append("the grade command timed out")
    elif exit_code != 0:
        reasons.append(f"the grade command exited {exit_code}")
    if named:
        outcomes: dict[str, list[str]] = {}
        if report is None:
            reasons.append("no JUnit report")
        else:
            try:
                outcomes = junit_outcomes(report)
            except ValueError as e:
                reasons.append(str(e))
        for test_id in named:
            seen = outcomes.get(test_id, [])
            tests[test_id] = "missing" if not seen else "repeated" if len(seen) > 1 else seen[0]
        failing = [t for t, o in tests.items() if o != "passed"]
        if failing:
            reasons.append(f"{len(failing)} named test(s) did not pass: "
                           + ", ".join(f"{t} ({tests[t]})" for t in failing[:5]))
    return not reasons, tests, "; ".join(reasons)
