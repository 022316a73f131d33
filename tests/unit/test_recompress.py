"""Re-encoding a lock's layers (``envbuild.store.recompress``, ``sync(compression=…)``):
deterministic gzip, the tar checked against its diff_id, the config unchanged, a second push
a no-op, and what cannot be re-encoded refused by name."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile

import pytest
import zstandard

from envbuild.errors import DigestMismatch, SettingsError, StoreError
from envbuild.oci import MEDIA_TYPE_LAYER, MEDIA_TYPE_LAYER_GZIP, MEDIA_TYPE_LAYER_ZSTD
from envbuild.store import MemoryStore, get_json, put_bytes, put_json
from envbuild.store.base import MEDIA_TYPE_CONFIG, MEDIA_TYPE_INDEX
from envbuild.store.recompress import check_compression, reencode
from envbuild.store.sync import sync


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _lock(store: MemoryStore) -> tuple[str, list[bytes]]:
    """A lock of two zstd layers, one with a TOC annotation, as envbuild writes them."""
    tars = [_tar({"etc/a": b"a" * 5000}), _tar({"usr/b": b"b" * 70000})]
    layers = []
    for i, t in enumerate(tars):
        z = zstandard.ZstdCompressor().compress(t)
        ann = {"org.envbuild.toc.digest": "sha256:" + "0" * 64, "org.envbuild.name": f"l{i}"}
        layers.append({"mediaType": MEDIA_TYPE_LAYER_ZSTD, "digest": put_bytes(store, z),
                       "size": len(z), "annotations": ann})
    diff_ids = ["sha256:" + hashlib.sha256(t).hexdigest() for t in tars]
    config = put_json(store, {"architecture": "amd64", "os": "linux",
                              "rootfs": {"type": "layers", "diff_ids": diff_ids}},
                      media_type=MEDIA_TYPE_CONFIG)
    lock = put_json(store, {"schemaVersion": 2, "config": config.to_oci(), "layers": layers})
    store.put_ref("env/demo", lock.digest)
    return lock.digest, tars


def test_gzip_push_re_encodes_layers_deterministically():
    src, dst = MemoryStore(), MemoryStore()
    lock, tars = _lock(src)
    report = sync(src, dst, refs=["env/demo"], compression="gzip")
    pushed = report.refs["env/demo"]
    assert pushed != lock and dst.get_ref("env/demo").digest == pushed
    manifest, original = get_json(dst, pushed), get_json(src, lock)
    assert manifest["config"] == original["config"] and dst.exists(manifest["config"]["digest"])
    for layer, tar in zip(manifest["layers"], tars, strict=True):
        assert layer["mediaType"] == MEDIA_TYPE_LAYER_GZIP
        assert layer["annotations"] == {"org.envbuild.name": layer["annotations"][
            "org.envbuild.name"]}  # the TOC annotation is gone, the others stay
        with dst.get(layer["digest"]) as f:
            assert gzip.decompress(f.read()) == tar
    assert not any(d in dst.blobs for d in (x["digest"] for x in original["layers"]))
    assert "gzip" in report.summary() and report.records_copied == []

    again = sync(src, dst, refs=["env/demo"], compression="gzip")
    assert again.refs == report.refs and again.blobs_copied == []  # same bytes: nothing new
    other = MemoryStore()
    assert sync(src, other, refs=["env/demo"], compression="gzip").refs == report.refs


def test_none_push_layers_are_the_tars():
    src, dst = MemoryStore(), MemoryStore()
    _lock_digest, tars = _lock(src)
    manifest = get_json(dst, sync(src, dst, refs=["env/demo"], compression="none")
                        .refs["env/demo"])
    assert [x["mediaType"] for x in manifest["layers"]] == [MEDIA_TYPE_LAYER] * 2
    assert [dst.blobs[x["digest"]] for x in manifest["layers"]] == tars


def test_zstd_push_is_unchanged():
    src, dst = MemoryStore(), MemoryStore()
    lock, _ = _lock(src)
    assert sync(src, dst, refs=["env/demo"]).refs == {"env/demo": lock}
    assert set(dst.blobs) == set(src.blobs)


def test_what_cannot_be_re_encoded_is_refused():
    with pytest.raises(SettingsError, match="unknown compression 'lz4'"):
        check_compression("lz4")
    src, dst = MemoryStore(), MemoryStore()
    _lock(src)
    with pytest.raises(SettingsError, match="unknown compression"):
        sync(src, dst, refs=["env/demo"], compression="brotli")
    index = put_json(src, {"schemaVersion": 2, "manifests": []}, media_type=MEDIA_TYPE_INDEX)
    src.put_ref("env/multi", index.digest, media_type=MEDIA_TYPE_INDEX)
    with pytest.raises(StoreError, match="not an image manifest"):
        sync(src, dst, refs=["env/multi"], compression="gzip")
    assert dst.blobs == {}  # refused before anything was copied
    tar = _tar({"x": b"x"})
    z = zstandard.ZstdCompressor().compress(tar)
    with pytest.raises(DigestMismatch, match="diff_id"):
        b"".join(reencode(io.BytesIO(z), "gzip", "sha256:" + "1" * 64, "sha256:" + "2" * 64))
    with pytest.raises(StoreError, match="cannot decompress"):
        b"".join(reencode(io.BytesIO(b"not zstd"), "gzip", "sha256:" + "1" * 64, "x"))
