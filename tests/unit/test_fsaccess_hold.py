"""``FileWriter``'s ``hold`` on a plain directory as the root: ``holding`` says whether an
existing file's new bytes wait for the commit; a ``lent`` piece is held as it is, not copied
(``envbuild serve`` lends its reused upload buffer). The same on real sandboxes:
``tests/integration/test_sdk_filestream.py``."""

from __future__ import annotations

import os
import tracemalloc

from runtime_shim.isolation.fsaccess import FileWriter

MIB = 1 << 20


def _writer(root, path: str, hold: int) -> FileWriter:
    return FileWriter(str(root), path, uid=os.getuid(), gid=os.getgid(), hold=hold)


def test_only_an_existing_file_within_hold_is_held(tmp_path):
    (tmp_path / "old").write_bytes(b"old")
    for path, hold, holding in (("/old", MIB, True), ("/old", 0, False), ("/new", MIB, False)):
        w = _writer(tmp_path, path, hold)
        assert w.holding is holding, (path, hold)
        w.abort()
    assert sorted(os.listdir(tmp_path)) == ["old"]


def test_a_lent_piece_is_held_without_a_copy(tmp_path):
    (tmp_path / "f").write_bytes(b"old bytes")
    data = bytearray(os.urandom(4 * MIB))
    w = _writer(tmp_path, "/f", 8 * MIB)
    tracemalloc.start()
    try:
        w.write(memoryview(data), lent=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MIB, f"a lent piece of 4 MiB cost {peak} bytes"
    assert (tmp_path / "f").read_bytes() == b"old bytes"  # nothing written before the commit
    w.commit()
    assert (tmp_path / "f").read_bytes() == data


def test_a_piece_not_lent_is_copied(tmp_path):
    (tmp_path / "f").write_bytes(b"old")
    data = bytearray(b"new")
    w = _writer(tmp_path, "/f", MIB)
    w.write(data)
    data[:] = b"XXX"  # its owner may change it once write returned
    w.commit()
    assert (tmp_path / "f").read_bytes() == b"new"
