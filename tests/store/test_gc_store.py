"""Blob and record ages, partial writes and GC against every backend (``conftest.BACKENDS``)."""

from __future__ import annotations

import time

import pytest

from envbuild.store import KEY_RECORDS, MEDIA_TYPE_LAYER_ZSTD, BlobInfo, digest_bytes, put_bytes, read_bytes
from envbuild.store.gc import gc

SLACK = 2.0  # S3 LastModified has one-second resolution


@pytest.mark.needs("blob-age")
def test_stat_and_list_info_report_when_a_blob_was_stored(store):
    before = time.time()
    d = put_bytes(store, b"aged blob")
    after = time.time()
    info = store.stat(d)
    assert info.mtime is not None and before - SLACK <= info.mtime <= after + SLACK
    assert info == BlobInfo(d, len(b"aged blob"))  # mtime is not part of equality
    listed = {i.digest: i for i in store.list_info()}
    assert listed[d].size == 9 and abs(listed[d].mtime - info.mtime) <= SLACK


def test_record_mtime(store):
    assert store.record_mtime(KEY_RECORDS, "a" * 64) is None
    before = time.time()
    store.put_record(KEY_RECORDS, "a" * 64, {"layer": digest_bytes(b"x")})
    mtime = store.record_mtime(KEY_RECORDS, "a" * 64)
    assert mtime is not None and before - SLACK <= mtime <= time.time() + SLACK
    store.delete_record(KEY_RECORDS, "a" * 64)
    assert store.record_mtime(KEY_RECORDS, "a" * 64) is None


def test_quiet_store_has_no_partial_writes(store):
    put_bytes(store, b"done")
    assert list(store.list_partials()) == []


@pytest.mark.needs("blob-age", "list-unreferenced")
def test_gc_end_to_end(store):
    layer = put_bytes(store, b"layer")
    garbage = put_bytes(store, b"garbage")
    store.put_ref("env/e", layer, media_type=MEDIA_TYPE_LAYER_ZSTD)
    dry = gc(store, grace=0, now=time.time() + 10, dry_run=True)
    assert [i.name for i in dry.deleted] == [garbage] and store.exists(garbage)
    young = gc(store, grace=3600)
    assert young.deleted == [] and young.young == 1 and store.exists(garbage)
    report = gc(store, grace=0, now=time.time() + 10)
    assert [i.name for i in report.deleted] == [garbage]
    assert not store.exists(garbage) and read_bytes(store, layer) == b"layer"


def test_s3_unfinished_multipart_upload_is_a_partial_write(backend):
    if not hasattr(backend.store, "client"):
        return
    store = backend.store
    key = store._blob_key(digest_bytes(b"never finished"))
    up = store.client.create_multipart_upload(Bucket=store.bucket, Key=key)
    partials = list(store.list_partials())
    assert [p.name for p in partials] == [f"{key}#{up['UploadId']}"]
    assert partials[0].mtime > 0  # moto answers a fixed 2010 "Initiated"; S3 the real one
    report = gc(store, grace=0, now=time.time() + 7200)
    assert [i.kind for i in report.deleted] == ["partial"]
    assert list(store.list_partials()) == []
    store.delete_partial(partials[0])  # idempotent
