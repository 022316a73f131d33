"""push / pull / remote build cache (``envbuild.store.sync``) between any two backends."""

from __future__ import annotations

import threading

import pytest

from envbuild.errors import RefNotFound
from envbuild.oci import ANNOTATION_KEY, MEDIA_TYPE_CONFIG, MEDIA_TYPE_LAYER_ZSTD
from envbuild.store import (
    KeyRecord,
    MemoryStore,
    digest_bytes,
    get_key_record,
    put_bytes,
    put_json,
    put_key_record,
    read_bytes,
)
from envbuild.store.sync import pull_cached, resolve_ref, sync


def make_lock(store, name: str = "env/demo", n_layers: int = 2, tag: bytes = b""):
    """A lock like envbuild's: layers (with key records), config, manifest, ref."""
    layers, keys = [], []
    for i in range(n_layers):
        blob = tag + f"layer {i} ".encode() * 1000
        digest = put_bytes(store, blob)
        key = digest_bytes(tag + f"key {i}".encode())
        put_key_record(store, key, KeyRecord(layer=digest, toc=digest, diff_id=digest,
                                             size=len(blob)))
        layers.append({"mediaType": MEDIA_TYPE_LAYER_ZSTD, "digest": digest, "size": len(blob),
                       "annotations": {ANNOTATION_KEY: key}})
        keys.append(key)
    config = put_json(store, {"rootfs": {"type": "layers", "diff_ids": [x["digest"] for x in layers]}},
                      media_type=MEDIA_TYPE_CONFIG)
    manifest = put_json(store, {"schemaVersion": 2,
                                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                                "config": config.to_oci(), "layers": layers})
    store.put_ref(name, manifest.digest)
    return manifest.digest, [x["digest"] for x in layers], keys


def test_sync_copies_everything_then_the_ref(backend):
    src, dst = MemoryStore(), backend.store
    manifest, layers, keys = make_lock(src)
    report = sync(src, dst, refs=["env/demo"])
    assert report.refs == {"env/demo": manifest}
    assert set(report.blobs_copied) == set(src.blobs)
    assert sorted(report.records_copied) == sorted(keys)
    assert dst.get_ref("env/demo").digest == manifest
    for d in src.blobs:
        assert read_bytes(dst, d) == src.blobs[d]
    for k in keys:
        assert get_key_record(dst, k) == get_key_record(src, k)
    again = sync(src, dst, refs=["env/demo"])  # only what the destination lacks
    assert again.blobs_copied == [] and again.records_copied == []
    assert again.blobs_present == len(src.blobs)


def test_ref_is_published_last():
    src = MemoryStore()
    manifest, layers, _ = make_lock(src)
    seen = []

    class Watching(MemoryStore):
        def put_ref(self, name, digest, **kw):
            seen.append(set(self.blobs))  # what is present when the ref is written
            return super().put_ref(name, digest, **kw)

        def put_record(self, namespace, name, obj):
            assert obj["layer"] in self.blobs, "a key record before its layer"
            return super().put_record(namespace, name, obj)

    dst = Watching()
    sync(src, dst, refs=["env/demo"])
    assert seen == [set(src.blobs)]


def test_failed_copy_publishes_nothing():
    src = MemoryStore()
    manifest, layers, keys = make_lock(src)
    src.blobs[layers[1]] = b"corrupt"
    dst = MemoryStore()
    with pytest.raises(Exception):  # noqa: B017 - which error is the store's; nothing published is the test
        sync(src, dst, refs=["env/demo"])
    assert dst.list_refs() == []
    for k in keys:
        rec = get_key_record(dst, k)
        assert rec is None or dst.exists(rec.layer)


def test_pull_cached_takes_only_missing_keys():
    remote, local = MemoryStore(), MemoryStore()
    _, layers, keys = make_lock(remote)
    assert pull_cached(remote, local, [keys[0], digest_bytes(b"unknown")]) == [keys[0]]
    assert get_key_record(local, keys[0]).layer == layers[0]
    assert local.exists(layers[0]) and not local.exists(layers[1])
    assert pull_cached(remote, local, [keys[0]]) == []


def test_resolve_ref():
    store = MemoryStore()
    make_lock(store)
    assert resolve_ref(store, "demo") == "env/demo"
    assert resolve_ref(store, "env/demo") == "env/demo"
    with pytest.raises(RefNotFound, match="no ref"):
        resolve_ref(store, "nope")


def test_two_syncs_at_once_both_succeed(backend):
    src = MemoryStore()
    manifest, _, _ = make_lock(src, n_layers=4)
    errors = []

    def run():
        try:
            sync(src, backend.reopen(), refs=["env/demo"], jobs=2)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert backend.store.get_ref("env/demo").digest == manifest
    assert sorted(backend.store.list()) == sorted(src.blobs)
