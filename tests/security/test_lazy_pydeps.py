"""Hostile ``.pyc`` files given to the import scanner (``runtime_shim.lazyfs.pydeps.scan``,
run on every pyc of a layer when its import index is made, ``pyindex``): truncated, huge
lengths, deep nesting, cyclic refs, object bombs, wrong magic, random bytes — each answered
with ``[]`` (or what is readable) in bounded time and memory, never an exception."""

from __future__ import annotations

import importlib.util
import py_compile
import random
import struct
import sys
import time
import tracemalloc

import pytest

from runtime_shim.lazyfs import pydeps
from runtime_shim.lazyfs.pydeps import Import, scan

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                                reason="the scanner reads CPython 3.11 pycs; the suite runs 3.11")

HEAD = importlib.util.MAGIC_NUMBER + struct.pack("<I", 3) + b"\0" * 8


def _real(tmp_path) -> bytes:
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom . import a, b\nclass K:\n    import json\n"
                   "def f():\n    import sys\n" + "x = 1\n" * 200)
    out = tmp_path / "m.pyc"
    py_compile.compile(str(src), str(out), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    return out.read_bytes()


def _bounded(data: bytes, seconds: float = 2.0, memory: int = 64 << 20) -> list[Import]:
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        got = scan(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - t0 < seconds
    assert peak < memory
    assert isinstance(got, list)
    return got


def test_every_truncation_of_a_real_pyc_is_nothing(tmp_path):
    data = _real(tmp_path)
    assert scan(data) == [Import("os", 0, ()), Import("", 1, ("a", "b")),
                          Import("json", 0, ())]
    for end in range(len(data) - 1):
        assert _bounded(data[:end]) == []


def test_every_flipped_byte_of_a_real_pyc_is_bounded(tmp_path):
    data = bytearray(_real(tmp_path))
    rng = random.Random(13)
    for _ in range(3000):
        bad = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(16, len(bad))] = rng.randrange(256)
        _bounded(bytes(bad))


@pytest.mark.parametrize("body", [
    b"\xe3" + b"\0" * 20 + b"s" + struct.pack("<i", 0x7FFFFFFF),      # code of 2 GiB
    b"(" + struct.pack("<i", 0x7FFFFFFF),                              # a tuple of 2^31 items
    b"(" + struct.pack("<i", -5),
    b"l" + struct.pack("<i", -0x7FFFFFFF),                             # a long of 2^31 digits
    b"a" + struct.pack("<i", 1 << 30) + b"abc",                       # a 1 GiB string
    b"[" * 200_000,                                                    # deep nesting
    b")\x01" * 100_000 + b"N",
    b"\xa9\x01r\x00\x00\x00\x00",                                     # a tuple holding itself
    b"r" + struct.pack("<i", 7),                                       # a ref to nothing
    b"{" + b"N" * 100_000,                                             # a dict never closed
    b"0", b"?", b"\xff", b"",
])
def test_hostile_marshal_bodies_are_nothing(body):
    assert _bounded(HEAD + body) == []


def test_object_bombs_stop_at_the_object_budget():
    # a tuple of a million Nones: within the size limit, over MAX_OBJECTS
    n = pydeps.MAX_OBJECTS + 10
    assert _bounded(HEAD + b"(" + struct.pack("<i", n) + b"N" * n, seconds=5) == []


def test_wrong_magic_and_oversized_input_are_not_read(tmp_path):
    data = _real(tmp_path)
    for magic in (b"\0\0\r\n", b"\x6f\x0d\x0d\x0a", b"\xcb\x0d\x0d\x0a"):  # ?, 3.10, 3.12
        assert _bounded(magic + data[4:]) == []
    t0 = time.monotonic()
    assert scan(data + b"\0" * pydeps.MAX_PYC) == []
    assert time.monotonic() - t0 < 0.1


def test_random_bytes_never_raise():
    rng = random.Random(1311)
    for _ in range(2000):
        _bounded(HEAD + bytes(rng.randrange(256) for _ in range(rng.randint(0, 300))))
