"""The store's pure pieces: open_store, VerifyingReader, descriptors, the public names."""

from __future__ import annotations

import io

import pytest

import envbuild.store
from envbuild.errors import DigestMismatch, SettingsError, StoreError
from envbuild.store import (
    Descriptor,
    KeyRecord,
    LocalStore,
    MemoryStore,
    VerifyingReader,
    digest_bytes,
    open_store,
    put_bytes,
)


def test_exported_names_are_sorted_and_complete():
    names = envbuild.store.__all__
    assert names == sorted(names)
    public = {n for n, v in vars(envbuild.store).items()
              if not n.startswith("_") and getattr(v, "__module__", "").startswith("envbuild.store")}
    assert public <= set(names), public - set(names)
    for name in names:
        assert hasattr(envbuild.store, name), name


def test_open_store_path_is_local(tmp_path):
    store = open_store(str(tmp_path / "cache"))
    assert isinstance(store, LocalStore)
    assert (tmp_path / "cache" / "oci-layout").exists()


def test_open_store_memory_is_fresh():
    a, b = open_store("memory://"), open_store("memory://")
    assert isinstance(a, MemoryStore)
    put_bytes(a, b"x")
    assert list(b.list()) == []


@pytest.mark.parametrize(("url", "want"), [
    ("s3://bucket", ("bucket", "")), ("s3://bucket/", ("bucket", "")),
    ("s3://bucket/a/b", ("bucket", "a/b/")), ("s3://bucket//a//b/", ("bucket", "a/b/")),
])
def test_s3_store_urls(url, want):
    # opening an S3Store talks to the server: tests/store runs it against moto
    from envbuild.store.s3 import parse_url

    assert parse_url(url) == want


def test_s3_url_without_bucket_is_refused():
    with pytest.raises(SettingsError) as e:
        open_store("s3://")
    assert "s3://BUCKET" in e.value.hint


@pytest.mark.parametrize("url", ["", "ftp://x/y", "gs://b"])
def test_open_store_refuses_unknown_urls(url):
    with pytest.raises(SettingsError) as e:
        open_store(url)
    assert e.value.hint


def test_memory_store_counts_calls():
    store = MemoryStore()
    d = put_bytes(store, b"x")
    store.exists(d)
    store.put(d, b"x")
    assert store.calls["put"] == 2
    assert store.calls["exists"] == 1
    assert store.calls["get"] == 0


DATA = b"0123456789" * 10
D = digest_bytes(DATA)


@pytest.mark.parametrize("size", [None, len(DATA)])
def test_verifying_reader_passes_good_bytes(size):
    with VerifyingReader(io.BytesIO(DATA), D, size=size) as r:
        assert r.read(7) + r.read() == DATA


@pytest.mark.parametrize(("data", "size", "why"), [
    (b"X" + DATA[1:], None, "hashes to"),
    (DATA[:-1], None, "hashes to"),
    (DATA[:-1], len(DATA), "read 99 bytes, expected 100"),
    (DATA + b"!", len(DATA), "longer than 100 bytes"),
])
def test_verifying_reader_raises_at_the_end(data, size, why):
    r = VerifyingReader(io.BytesIO(data), D, size=size, location="/x/blob")
    with pytest.raises(DigestMismatch, match=why) as e:
        while r.read(9):
            pass
    assert "/x/blob" in e.value.message and "/x/blob" in e.value.hint


def test_verifying_reader_close_closes_the_source():
    src = io.BytesIO(DATA)
    VerifyingReader(src, D).close()
    assert src.closed


def test_descriptor_round_trips_oci_json():
    d = Descriptor("application/vnd.oci.image.manifest.v1+json", D, 100, {"a": "b"})
    assert d.to_oci() == {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                          "digest": D, "size": 100, "annotations": {"a": "b"}}
    assert Descriptor.from_oci(d.to_oci()) == d
    for bad in ({"digest": D, "size": 1}, {"mediaType": "a/b", "digest": "x", "size": 1},
                {"mediaType": "a/b", "digest": D, "size": -1}, []):
        with pytest.raises(StoreError):
            Descriptor.from_oci(bad)


def test_key_record_json_round_trip_keeps_unknown_fields():
    obj = {"layer": D, "toc": D, "diff_id": D, "size": 3, "built_from": {"abi": "x"},
           "future_field": [1]}
    rec = KeyRecord.from_json(obj)
    assert rec.extra == {"future_field": [1]}
    assert rec.to_json() == obj
    with pytest.raises(StoreError, match="invalid digest"):
        KeyRecord.from_json({**obj, "toc": "sha256:nope"})
    with pytest.raises(StoreError, match="bad size"):
        KeyRecord.from_json({**obj, "size": "3"})
