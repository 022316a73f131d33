"""What only the registry backend does, against the real Debian ``docker-registry``: locks
tagged as themselves, refs sharing a manifest surviving a delete, CAS refused, what ``list``
sees, records as artifacts, deletes disabled, envbuild artifacts of an unknown version."""

from __future__ import annotations

import json
import time

import pytest

from envbuild.errors import StoreError, StoreUnavailable
from envbuild.store import digest_bytes, put_bytes, put_json
from envbuild.store.gc import gc
from envbuild.store.registry import (
    ARTIFACT_RECORD,
    EMPTY_DIGEST,
    MEDIA_TYPE_MANIFEST,
    RegistryStore,
)
from tests.store.registry_server import running_registry


def _lock(store, n: int = 2) -> tuple[str, list[str]]:
    layers = [put_bytes(store, f"layer {i}".encode() * 100) for i in range(n)]
    config = put_json(store, {"architecture": "amd64", "os": "linux"},
                      media_type="application/vnd.oci.image.config.v1+json")
    manifest = put_json(store, {
        "schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST, "config": config.to_oci(),
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": d,
                    "size": store.stat(d).size} for d in layers]})
    return manifest.digest, [config.digest, *layers]


@pytest.fixture
def store(docker_registry, request):
    repo = f"unit/t{abs(hash(request.node.nodeid)):x}"
    return RegistryStore(docker_registry.url(repo), auth_paths=[])


def test_a_lock_is_tagged_as_itself(store):
    lock, blobs = _lock(store)
    store.put_ref("env/demo", lock)
    got = store._get_manifest("demo", "test")
    assert got is not None and got[1] == lock and got[2] == MEDIA_TYPE_MANIFEST
    assert store.get_ref("env/demo").digest == lock
    assert sorted(store.list()) == sorted([lock, *blobs])  # what the tag reaches, nothing else


def test_refs_sharing_a_manifest_survive_deleting_one(store):
    lock, _ = _lock(store)
    for name in ("env/a", "env/b", "snap/c"):
        store.put_ref(name, lock)
    store.put_record("keys/v1", "ab" * 32, {"layer": lock})
    store.delete_ref("env/a")  # distribution deletes the manifest, i.e. all three tags...
    assert store.list_refs() == ["env/b", "snap/c"]  # ...and the others are put back
    assert store.get_ref("env/b").digest == store.get_ref("snap/c").digest == lock
    assert store.get_record("keys/v1", "ab" * 32) == {"layer": lock}
    assert store.exists(lock)  # the blob stays


def test_compare_and_swap_is_refused_not_raced(store):
    d = put_bytes(store, b"x")
    for expect in (None, d):
        with pytest.raises(StoreError) as e:
            store.put_ref("env/r", d, expect=expect)
        assert e.value.reference == "cas-unsupported"
    assert store.list_refs() == []


def test_records_are_artifacts_with_an_age(store):
    before = time.time()
    store.put_record("keys/v1", "cd" * 32, {"layer": "sha256:" + "1" * 64, "n": 1})
    body, _, _ = store._get_manifest("envbuild-key-" + "cd" * 32, "test")
    doc = json.loads(body)
    assert doc["artifactType"] == ARTIFACT_RECORD
    assert doc["config"]["digest"] == EMPTY_DIGEST
    assert doc["layers"][0]["digest"] == digest_bytes(b'{"layer":"sha256:' + b"1" * 64
                                                      + b'","n":1}')
    assert before - 1 <= store.record_mtime("keys/v1", "cd" * 32) <= time.time() + 1
    assert store.record_mtime("keys/v1", "ef" * 32) is None
    assert list(store.list()) == []  # a record's own blobs are not store blobs


def test_gc_deletes_nothing_from_a_registry(store):
    lock, blobs = _lock(store)
    stray = put_bytes(store, b"unreferenced")
    store.put_ref("env/demo", lock)
    gc(store, grace=0)
    assert all(store.exists(d) for d in [lock, *blobs, stray])


def test_unknown_envbuild_artifact_version_is_refused_by_name(store):
    store._ensure_empty()
    data = b"{}"
    store.put(digest_bytes(data), data)
    manifest = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST,
                "artifactType": "application/vnd.envbuild.ref.v9+json",
                "config": {"mediaType": "application/vnd.oci.empty.v1+json",
                           "digest": EMPTY_DIGEST, "size": 2},
                "layers": [{"mediaType": "application/octet-stream",
                            "digest": digest_bytes(data), "size": 2}]}
    store._put_manifest("future", json.dumps(manifest).encode(), MEDIA_TYPE_MANIFEST, "test")
    with pytest.raises(StoreError) as e:
        store.get_ref("env/future")
    assert e.value.reference == "unsupported-format"
    assert "ref.v9" in e.value.message and "upgrade" in e.value.hint


@pytest.mark.integration  # starts the real docker-registry
def test_deletes_disabled_in_the_registry(tmp_path):
    with running_registry(tmp_path / "reg", deletes=False) as reg:
        store = RegistryStore(reg.url("unit/nodelete"), auth_paths=[])
        d = put_bytes(store, b"keep me")
        store.put_ref("env/x", d)
        for call in (lambda: store.delete(d), lambda: store.delete_ref("env/x")):
            with pytest.raises(StoreError) as e:
                call()
            assert e.value.reference == "delete-unsupported"
            assert "storage: delete: enabled: true" in e.value.hint
        assert store.get_ref("env/x").digest == d


def test_not_a_registry(tmp_path):
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    try:
        with pytest.raises(StoreUnavailable, match="is not an OCI registry"):
            RegistryStore(f"docker://127.0.0.1:{server.server_port}/x", auth_paths=[])
    finally:
        server.shutdown()
        server.server_close()
