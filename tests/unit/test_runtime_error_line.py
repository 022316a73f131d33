"""``runtime_error_line``: the one-line cause a start error shows, from hostile-ish output."""

from __future__ import annotations

from runtime_shim.isolation.runc import MAX_CAUSE_CHARS, runtime_error_line


def test_takes_runcs_last_error_message_unquoted():
    out = ('time="2026-12-02T11:54:59Z" level=warning msg="first"\n'
           'time="2026-12-02T11:54:59Z" level=error msg="runc run failed: open \\"/x\\": '
           'no such file"\n')
    assert runtime_error_line(out) == 'runc run failed: open "/x": no such file'


def test_falls_back_to_the_last_non_empty_line():
    assert runtime_error_line("crun: one\ncrun: cgroups in hybrid mode\n\n") == \
        "crun: cgroups in hybrid mode"
    assert runtime_error_line("") is None
    assert runtime_error_line("\n  \n") is None


def test_is_bounded_and_printable():
    line = runtime_error_line("x" * 10_000 + "\x1b[31m\x07")
    assert line is not None and len(line) == MAX_CAUSE_CHARS and line.endswith("...")
    assert all(c.isprintable() for c in line)
    assert runtime_error_line('level=error msg="a\\x1b[2Jb"') == "a\\x1b[2Jb"

