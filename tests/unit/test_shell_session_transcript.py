"""The pure part of ``runtime_shim.sdk.session``: how a command is sent (quoted for ``eval``,
then a marker line) and how a terminal's output is cut at the marker — bounded, with markers
of interrupted commands left out. The sessions themselves: tests/integration/test_sdk_session.py."""

from __future__ import annotations

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim.sdk.session import TIMED_OUT, _Transcript


def _marker(t: _Transcript, code: int, seq: int | None = None) -> bytes:
    return b"\n__envbuild_%s %d %d\n" % (t.nonce.encode(), t.seq if seq is None else seq, code)


def test_a_command_is_quoted_for_eval_and_followed_by_the_marker_line():
    t = _Transcript(1 << 20)
    line = t.next_line("echo 'it''s' \"$HOME\"\nls")
    assert line.startswith(b"eval 'echo '\\''it'\\'''\\''s'\\'' \"$HOME\"\nls'\n")
    assert line.endswith(b"printf '\\n%s_%s %s %d\\n' __envbuild " + t.nonce.encode()
                         + b" 1 \"$?\"\n")
    assert b"__envbuild_" + t.nonce.encode() not in line  # never whole in the input
    with pytest.raises(RuntimeShimError, match="NUL"):
        t.next_line("a\0b")


def test_output_is_what_came_before_the_current_marker():
    t = _Transcript(1 << 20)
    t.next_line("x")
    t.feed(b"partial out")
    assert t.take(0.0, False) is None
    t.feed(_marker(t, 3)[:10])
    assert t.take(0.0, False) is None
    t.feed(_marker(t, 3)[10:] + b"next")
    r = t.take(0.0, False)
    assert (r.stdout, r.exit_code, r.timed_out, r.output_truncated) == (b"partial out", 3,
                                                                      False, False)
    assert bytes(t.buf) == b"next"


def test_an_interrupted_commands_own_marker_is_left_out_and_the_code_is_124():
    t = _Transcript(1 << 20)
    t.next_line("sleep 100")
    t.feed(b"before ^C" + _marker(t, 130))
    t.next_line(None)  # the resync after ^C
    t.feed(b"\n" + _marker(t, 130))
    r = t.take(0.0, True)
    assert (r.stdout, r.exit_code, r.timed_out) == (b"before ^C\n", TIMED_OUT, True)


def test_a_long_output_keeps_its_head_and_finds_its_marker():
    t = _Transcript(1000)
    t.next_line("yes")
    for _ in range(2000):
        t.feed(b"y\n" * 50)
        assert len(t.buf) <= 1000 + 4096 + 100
    t.feed(_marker(t, 0))
    r = t.take(0.0, False)
    assert r.output_truncated and r.stdout.startswith(b"y\n" * 500) and r.exit_code == 0
    assert len(r.stdout) <= 1000 + 4096
