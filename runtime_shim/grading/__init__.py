"""Trusted grading (issue 35): an agent's changes, filtered, graded in a fresh sandbox of the
task's env lock plus its hidden layer; the outcome is a ``Verdict`` recorded in the store.

- ``changes``  which of the agent's changes are graded (the change-set filter, pure)
- ``verdict``  the ``Verdict`` and how it is decided from exit code and JUnit report (pure)
- ``grader``   ``grade(task, source)``: read, filter, pack, run, decide, record
- ``aio``      ``grade_async``: the same, awaited
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from envbuild._lazy import lazy_exports

_EXPORTS = {
    "ChangeLimits": "runtime_shim.grading.changes",
    "Verdict": "runtime_shim.grading.verdict",
    "grade": "runtime_shim.grading.grader",
    "grade_async": "runtime_shim.grading.aio",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from runtime_shim.grading.aio import grade_async  # noqa: F401
    from runtime_shim.grading.changes import ChangeLimits  # noqa: F401
    from runtime_shim.grading.grader import grade  # noqa: F401
    from runtime_shim.grading.verdict import Verdict  # noqa: F401

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
