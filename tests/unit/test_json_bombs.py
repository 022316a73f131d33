"""JSON from outside (store blobs, lock manifests and configs, OCI layouts): bounded in size
and nesting, and a wrong shape is one error, never a ``RecursionError``/``AttributeError``
traceback."""

from __future__ import annotations

import json

import pytest

from envbuild.canonical import JsonLimitError, canonical_json, load_json, read_json_file
from envbuild.errors import EnvbuildError, RuntimeShimError, StoreError
from envbuild.store import get_json, put_bytes
from envbuild.store.memory import MemoryStore
from runtime_shim.node import locks
from runtime_shim.node.locks import MAX_LOCK_JSON, resolve

DEEP = b"[" * 100_000 + b"]" * 100_000
MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def test_load_json_bounds_size_and_depth(tmp_path):
    assert load_json(b'{"a": [1]}') == {"a": [1]}
    with pytest.raises(JsonLimitError, match="nested too deeply"):
        load_json(DEEP)
    with pytest.raises(RecursionError):
        json.loads(DEEP)  # what callers catching ValueError let through before
    with pytest.raises(JsonLimitError, match="over the 10-byte limit"):
        load_json(b'{"a": "0123456789"}', max_bytes=10)
    (tmp_path / "f.json").write_bytes(b"[" + b"1," * 1000 + b"1]")
    with pytest.raises(JsonLimitError, match="2002 bytes, over the 2001-byte limit"):
        read_json_file(tmp_path / "f.json", max_bytes=2001)  # reads max_bytes + 1 only
    with pytest.raises(JsonLimitError, match="more than 4000000 values"):
        load_json(b"[" + b"[]," * 4_000_001 + b"[]]")  # 12 MB, 1.2 GB as lists
    assert issubclass(JsonLimitError, ValueError)


def test_get_json_refuses_deep_and_large_blobs():
    store = MemoryStore()
    deep = put_bytes(store, DEEP)
    with pytest.raises(StoreError, match="nested too deeply"):
        get_json(store, deep)
    big = put_bytes(store, b"[" + b"0," * 1000 + b"0]")
    with pytest.raises(StoreError, match="too large for a JSON document"):
        get_json(store, big, max_size=1000)


def _lock(store, manifest) -> str:
    digest = put_bytes(store, manifest if isinstance(manifest, bytes) else canonical_json(manifest))
    store.put_ref("env/x", digest, media_type=MANIFEST)
    return digest


@pytest.mark.parametrize("manifest, match", [
    (DEEP, "nested too deeply"),
    ([1, 2], "is not an OCI image manifest"),
    ({"mediaType": MANIFEST, "config": "sha256:x"}, "is not an OCI image manifest"),
    ({"mediaType": MANIFEST, "config": {"digest": ["x"]}}, "config digest"),
    (b'{"mediaType": "%s", "config": {}, "pad": "%s"}' % (MANIFEST.encode(),
                                                         b"x" * MAX_LOCK_JSON),
     "too large for a JSON document"),
])
def test_hostile_lock_manifests_are_one_error(manifest, match):
    store = MemoryStore()
    _lock(store, manifest)
    with pytest.raises(EnvbuildError, match=match):
        resolve(store, "env/x")


@pytest.mark.parametrize("config, layers", [
    (DEEP, []),
    (b"[]", []),
    (canonical_json({"rootfs": {"diff_ids": ["sha256:" + "0" * 64]}}), ["not a descriptor"]),
    (canonical_json({"rootfs": {"diff_ids": ["sha256:" + "0" * 64]}}),
     [{"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd"}]),  # no digest
    (canonical_json({"rootfs": {"diff_ids": []}, "config": ["Env"]}), []),
])
def test_hostile_lock_configs_are_one_error(config, layers):
    store = MemoryStore()
    cfg = put_bytes(store, config)
    _lock(store, {"mediaType": MANIFEST, "config": {"digest": cfg}, "layers": layers})
    with pytest.raises((RuntimeShimError, StoreError)) as ei:
        resolve(store, "env/x")
    assert "\n" not in str(ei.value)


def test_a_sane_lock_still_resolves():
    store = MemoryStore()
    cfg = put_bytes(store, canonical_json({"rootfs": {"diff_ids": []},
                                           "config": {"Env": ["A=1"], "Cmd": ["sh"]}}))
    digest = _lock(store, {"mediaType": MANIFEST, "config": {"digest": cfg}, "layers": []})
    lock = resolve(store, "env/x")
    assert lock.digest == digest and dict(lock.env) == {"A": "1"} and lock.cmd == ("sh",)
    assert locks.MAX_LOCK_JSON == 4 << 20
