"""``put_file`` of a small blob asks the store nothing first (one write, which is a no-op for
a stored blob); a big one is looked up first (an upload saved when it is stored)."""

from __future__ import annotations

from envbuild.store import put_file
from envbuild.store.base import SMALL_BLOB
from envbuild.store.memory import MemoryStore


def test_a_small_blob_is_put_without_a_look_and_again_is_a_no_op(tmp_path):
    store = MemoryStore()
    f = tmp_path / "small"
    f.write_bytes(b"x" * 1000)
    info = put_file(store, f)
    assert store.calls["exists"] == 0 and store.calls["put"] == 1
    assert put_file(store, f) == info  # stored already: the put does nothing
    assert store.calls["exists"] == 0 and len(store.blobs) == 1


def test_a_big_blob_is_looked_up_first(tmp_path):
    store = MemoryStore()
    f = tmp_path / "big"
    f.write_bytes(b"y" * (SMALL_BLOB + 1))
    put_file(store, f)
    assert store.calls["exists"] == 1 and store.calls["put"] == 1
    put_file(store, f)
    assert store.calls["exists"] == 2 and store.calls["put"] == 1  # stored: no second put
