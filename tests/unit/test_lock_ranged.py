"""``resolve`` of a lock in a store with plain-HTTP ranges (an ``S3Store``): manifest and
config each in one ranged read, with ``get_json``'s bounds and errors (a fake store: a
``MemoryStore`` that says it has fast ranges and counts what it is asked)."""

from __future__ import annotations

import pytest

from envbuild.canonical import canonical_json
from envbuild.errors import DigestMismatch, EnvbuildError, LockNotFound, StoreUnavailable
from envbuild.oci import MEDIA_TYPE_MANIFEST as MANIFEST
from envbuild.store import MemoryStore, put_bytes
from runtime_shim.node.locks import MAX_LOCK_JSON, resolve


class RangedStore(MemoryStore):
    fast_ranges = True

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []
        self.unreachable = False

    def get_range(self, digest, offset, length):
        self.asked.append(f"range {offset}+{length}")
        if self.unreachable:
            raise StoreUnavailable("read range: cannot reach S3 endpoint (test)")
        return super().get_range(digest, offset, length)

    def stat(self, digest):
        self.asked.append("stat")
        return super().stat(digest)

    def get(self, digest):
        self.asked.append("get")
        return super().get(digest)


def _lock(store, manifest) -> str:
    return put_bytes(store, manifest if isinstance(manifest, bytes) else canonical_json(manifest))


def test_a_lock_is_two_ranged_reads_and_nothing_else():
    store = RangedStore()
    cfg = put_bytes(store, canonical_json({"rootfs": {"diff_ids": []},
                                           "config": {"Env": ["A=1"]}}))
    digest = _lock(store, {"mediaType": MANIFEST, "config": {"digest": cfg}, "layers": []})
    store.asked.clear()
    lock = resolve(store, digest)
    assert lock.digest == digest and dict(lock.env) == {"A": "1"}
    assert store.asked == [f"range 0+{MAX_LOCK_JSON + 1}"] * 2


def test_ranged_reads_keep_the_bounds_and_errors():
    store = RangedStore()
    big = _lock(store, b'{"pad": "%s"}' % (b"x" * MAX_LOCK_JSON))
    with pytest.raises(EnvbuildError, match="too large for a JSON document"):
        resolve(store, big)
    deep = _lock(store, b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(EnvbuildError, match="nested too deeply"):
        resolve(store, deep)
    with pytest.raises(LockNotFound):
        resolve(store, "sha256:" + "0" * 64)
    # bytes that do not match their digest (a store that lies) are refused
    good = _lock(store, {"mediaType": MANIFEST, "config": {"digest": big}, "layers": []})
    store.blobs[good] = b'{"mediaType": "x"}'
    with pytest.raises(DigestMismatch):
        resolve(store, good)


def test_a_ranged_read_without_an_answer_falls_back_to_the_stores_own_reads():
    store = RangedStore()
    cfg = put_bytes(store, canonical_json({"rootfs": {"diff_ids": []}}))
    digest = _lock(store, {"mediaType": MANIFEST, "config": {"digest": cfg}, "layers": []})
    store.unreachable = True
    store.asked.clear()
    assert resolve(store, digest).digest == digest
    assert store.asked == [f"range 0+{MAX_LOCK_JSON + 1}", "stat", "get"] * 2
