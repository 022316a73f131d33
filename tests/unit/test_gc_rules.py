"""GC rules one by one: grace period, concurrent writers, partial writes, key records as roots
or dropped cache, snapshot parents, young locks, dangling and unreadable roots."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

from envbuild.errors import StoreError
from envbuild.store import (
    KEY_RECORDS,
    KeyRecord,
    LocalStore,
    MemoryStore,
    digest_bytes,
    put_bytes,
    put_key_record,
    read_bytes,
)
from envbuild.store.gc import gc, parse_duration
from tests.unit.test_gc_property import OLD, age_everything, make_lock


def key_record(store, key: bytes, layer: str) -> str:
    k = digest_bytes(key)
    put_key_record(store, k, KeyRecord(layer=layer, toc=digest_bytes(b"t"),
                                       diff_id=digest_bytes(b"d"), size=store.stat(layer).size))
    return k


def test_parse_duration():
    assert parse_duration("24h") == 86400
    assert parse_duration("90m") == 5400
    assert parse_duration("0") == 0
    assert parse_duration("1.5d") == 1.5 * 86400
    with pytest.raises(StoreError, match="not a duration"):
        parse_duration("soon")


def test_young_unreachable_blob_survives_the_grace_period():
    store = MemoryStore()
    old = put_bytes(store, b"old garbage")
    young = put_bytes(store, b"young garbage")
    store.mtimes[old] = time.time() - 7200
    report = gc(store, grace=3600)
    assert store.exists(young) and not store.exists(old)
    assert report.young == 1 and [i.name for i in report.deleted] == [old]


def test_blob_of_unknown_age_is_never_deleted():
    store = MemoryStore()
    store.blobs[digest_bytes(b"x")] = b"x"  # no mtime: age unknown
    gc(store, grace=0)
    assert store.exists(digest_bytes(b"x"))


def test_put_just_before_gc_then_record_after_survives():
    """A build: blob put, GC runs (grace > 0), then the key record is written."""
    store = MemoryStore()
    layer = put_bytes(store, b"fresh layer")
    gc(store, grace=60)
    key_record(store, b"k", layer)
    assert read_bytes(store, layer) == b"fresh layer"


def test_blob_stored_during_gc_is_never_deleted_even_with_grace_0():
    store = MemoryStore()
    start = time.time()
    layer = put_bytes(store, b"written after gc started")
    store.mtimes[layer] = start + 1
    gc(store, grace=0, now=start)
    assert store.exists(layer)


def test_young_lock_keeps_its_old_layers_and_parent():
    """pack-diff/build stored a lock (young) but not yet its ref: what it names stays."""
    store = MemoryStore()
    base = put_bytes(store, b"base layer")
    parent = make_lock(store, [base])
    age_everything(store)
    snap_layer = put_bytes(store, b"snapshot layer")
    snap = make_lock(store, [base, snap_layer], parent=parent)
    gc(store, grace=3600)
    assert all(store.exists(d) for d in (base, parent, snap_layer, snap))


def test_snapshot_ref_keeps_parent_lock_chain():
    store = MemoryStore()
    a, b, c = (put_bytes(store, x) for x in (b"a", b"b", b"c"))
    root = make_lock(store, [a])
    mid = make_lock(store, [a, b], parent=root)
    leaf = make_lock(store, [a, b, c], parent=mid)
    store.put_ref("snap/leaf", leaf)
    age_everything(store)
    gc(store, grace=0)
    assert all(store.exists(d) for d in (a, b, c, root, mid, leaf))


def test_key_records_are_roots_by_default():
    store = MemoryStore()
    layer = put_bytes(store, b"cached layer")
    key_record(store, b"k", layer)
    age_everything(store)
    gc(store, grace=0)
    assert store.exists(layer)


def test_drop_cache_drops_old_unused_records_first_then_layers():
    store = MemoryStore()
    used, unused, fresh = (put_bytes(store, x) for x in (b"used", b"unused", b"fresh"))
    store.put_ref("env/e", make_lock(store, [used]))
    k_used = key_record(store, b"used", used)
    k_unused = key_record(store, b"unused", unused)
    age_everything(store)
    k_fresh = key_record(store, b"fresh", fresh)  # young record: kept, keeps its layer
    store.mtimes[fresh] = OLD
    report = gc(store, grace=3600, drop_cache=True)
    names = set(store.list_records(KEY_RECORDS))
    assert names == {k_used.removeprefix("sha256:"), k_fresh.removeprefix("sha256:")}
    assert store.exists(used) and store.exists(fresh) and not store.exists(unused)
    kinds = [i.kind for i in report.deleted]
    assert kinds.index("record") < kinds.index("blob")
    assert f"{KEY_RECORDS}/{k_unused.removeprefix('sha256:')}" in {i.name for i in report.deleted}


def test_dangling_ref_is_reported_and_marks_nothing():
    store = MemoryStore()
    lock = make_lock(store, [put_bytes(store, b"l")])
    store.put_ref("env/gone", lock)
    store.delete(lock)
    age_everything(store)
    report = gc(store, grace=0)
    assert any("env/gone" in d for d in report.dangling)


def test_corrupt_lock_stops_gc_before_deleting_anything():
    store = MemoryStore()
    lock = make_lock(store, [put_bytes(store, b"l")])
    store.put_ref("env/e", lock)
    put_bytes(store, b"garbage")
    store.blobs[lock] = b"{not json"
    age_everything(store)
    before = dict(store.blobs)
    with pytest.raises(StoreError) as e:
        gc(store, grace=0)
    assert e.value.reference == "gc-unmarkable" and "env/e" in e.value.message
    assert store.blobs == before


def test_ref_written_during_gc_is_re_marked(monkeypatch):
    """A writer that points a new ref at an old, unreachable lock between GC's first mark and
    its sweep: the second look at the refs keeps it."""
    store = MemoryStore()
    layer = put_bytes(store, b"layer")
    lock = make_lock(store, [layer])
    age_everything(store)
    calls = {"n": 0}
    real = store.list_refs

    def list_refs():
        calls["n"] += 1
        if calls["n"] == 2:  # the re-mark pass: the writer published meanwhile
            store.put_ref("env/late", lock)
        return real()

    monkeypatch.setattr(store, "list_refs", list_refs)
    gc(store, grace=0)
    assert store.exists(lock) and store.exists(layer)


# -- partial writes (LocalStore temp files) ---------------------------------------------------


def test_stale_temp_files_are_removed_live_ones_kept(tmp_path):
    store = LocalStore(tmp_path / "s")
    blobs = tmp_path / "s" / "blobs" / "sha256"
    stale, live = blobs / ".tmp-00000000000000aa", blobs / ".tmp-00000000000000bb"
    stale.write_bytes(b"half a blob")
    live.write_bytes(b"being written")
    os.utime(stale, (OLD, OLD))
    report = gc(store, grace=0)
    assert not stale.exists() and live.exists()
    assert [i.name for i in report.deleted if i.kind == "partial"] == [
        "blobs/sha256/.tmp-00000000000000aa"]


class _SlowStream(io.RawIOBase):
    """A stream that hands out half the data, then waits for ``go`` before the rest."""

    def __init__(self, data: bytes, started: threading.Event, go: threading.Event) -> None:
        self.parts = [data[: len(data) // 2], data[len(data) // 2:]]
        self.started, self.go = started, go

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        if not self.parts:
            return b""
        if len(self.parts) == 1:
            self.started.set()
            assert self.go.wait(10)
        return self.parts.pop(0)


def test_blob_being_written_during_gc_survives(tmp_path):
    store = LocalStore(tmp_path / "s")
    data = os.urandom(1 << 16)
    digest = digest_bytes(data)
    started, go = threading.Event(), threading.Event()
    errors = []

    def writer():
        try:
            store.put(digest, _SlowStream(data, started, go), size=len(data))
            key_record(store, b"k", digest)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    assert started.wait(10)
    age_everything(store)  # even an old-looking store around it
    report = gc(store, grace=0)
    go.set()
    t.join(10)
    assert not errors
    assert read_bytes(store, digest) == data
    assert not [i for i in report.deleted if i.kind == "partial"]


@pytest.mark.parametrize("kind", ["memory", "local"])
def test_exec_log_blobs_are_kept_and_a_replay_reads_them(kind, tmp_path):
    """A fleet exec log's file write over 1 MiB is a blob named only by the log: gc keeps it
    (so the log still replays), and still deletes old garbage beside it."""
    from runtime_shim.fleet import execlog

    store = MemoryStore() if kind == "memory" else LocalStore(tmp_path / "store")
    big = os.urandom(execlog.MAX_INLINE + 1)
    execlog.start(store, "eb-0123456789ab", lock=digest_bytes(b"lock"), node_id="n" * 56)
    execlog.append(store, "eb-0123456789ab", 1, "write", path="/big", data=big, mode=0o600)
    garbage = put_bytes(store, b"nobody's")
    age_everything(store)
    report = gc(store, grace=0)
    assert [i.name for i in report.deleted if i.kind == "blob"] == [garbage]
    (entry,) = execlog.read(store, "eb-0123456789ab").entries
    assert entry.data == big and entry.mode == 0o600
    # a malformed index record marks nothing and does not stop gc
    store.put_record(execlog.BLOB_INDEX, "eb-0123456789ab.00000002", {"blob": "../x"})
    gc(store, grace=0)
    assert execlog.read(store, "eb-0123456789ab").entries[0].data == big


def test_a_layers_import_index_goes_with_its_blob():
    """The record beside a layer blob (``PYIMPORT_RECORDS``: its import index) is deleted
    with the blob; one whose blob is gone is deleted once older than the grace period; a
    young orphan (its blob being stored right now) and a kept blob's record stay."""
    from envbuild.store import PYIMPORT_RECORDS

    store = MemoryStore()
    kept, dropped = put_bytes(store, b"kept layer"), put_bytes(store, b"dropped layer")
    key_record(store, b"k", kept)
    rec = {"version": 1}
    for d in (kept, dropped, "sha256:" + "1" * 64, "sha256:" + "2" * 64):
        store.put_record(PYIMPORT_RECORDS, d[7:], rec)
    store.mtimes[dropped] = store.mtimes[kept] = time.time() - 7200
    store.record_mtimes[(PYIMPORT_RECORDS, "1" * 64)] = time.time() - 7200   # an old orphan
    report = gc(store, grace=3600)
    assert not store.exists(dropped) and store.exists(kept)
    assert sorted(store.list_records(PYIMPORT_RECORDS)) == sorted([kept[7:], "2" * 64])
    assert {i.name for i in report.deleted if i.kind == "record"} == {
        f"{PYIMPORT_RECORDS}/{dropped[7:]}", f"{PYIMPORT_RECORDS}/{'1' * 64}"}
