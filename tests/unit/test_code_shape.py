"""The size gate (issue 38): no module over 600 lines and no function over 60 in envbuild/
and runtime_shim/ unless a ``# shape:`` comment says why (``tests/shape.py`` measures, and
says why these numbers).

``KNOWN`` listed what was over the limits when the gate landed (49 modules and functions), each
with the engineer splitting it; a listed entry that is no longer over fails too, so the list
only shrinks. It is empty now: keep it so.
"""

from __future__ import annotations

from tests.shape import MAX_FUNCTION_LINES, oversized, report

KNOWN: set[str] = set()


def test_nothing_new_is_over_the_limits():
    new = {k: v for k, v in report().items() if k not in KNOWN}
    assert new == {}, "split these, or say why with a '# shape:' comment (tests/shape.py)"


def test_every_known_entry_is_still_over():
    assert KNOWN <= set(report()), sorted(KNOWN - set(report()))


def test_the_gate_sees_a_long_function_and_honours_the_reason():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    long = f"def f():\n{body}\n"
    assert list(oversized(long, "m.py")) == [("m.py:f", MAX_FUNCTION_LINES + 1)]
    assert list(oversized("# shape: a dispatch table\n" + long, "m.py")) == []
    decorated = f"# shape: one table\n@cache\n{long}"
    assert list(oversized(decorated, "m.py")) == []
