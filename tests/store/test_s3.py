"""S3Store only: key layout, derived index.json, multipart, resumed reads, failures, CLI.

Runs against a real ``moto_server`` on 127.0.0.1 (``tests/store/s3server.py``); nothing patches
boto3. The shared contract is in test_conformance.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time

import pytest

from envbuild.errors import DigestMismatch, StoreError, StoreUnavailable
from envbuild.store import RefConflict, digest_bytes, open_store, put_bytes, read_bytes
from envbuild.store.s3 import S3Store
from tests.store.s3server import free_port, moto_s3, s3_env, session  # noqa: F401
from tests.store.test_sync import make_lock

MiB = 1 << 20


@pytest.fixture
def bucket(moto_s3):
    return moto_s3.make_bucket()


def open_s3(server, bucket, prefix="p", **kw) -> S3Store:
    kw.setdefault("part_size", MiB)
    return S3Store(bucket, prefix, endpoint_url=server.endpoint, session=session(), **kw)


def keys(server, bucket) -> list[str]:
    resp = server.client().list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in resp.get("Contents", []))


def test_layout_matches_the_local_store(moto_s3, bucket):
    store = open_s3(moto_s3, bucket, "team/envs")
    d = put_bytes(store, b"blob")
    store.put_ref("env/a", d)
    store.put_record("keys/v1", "ab12", {"layer": d})
    assert keys(moto_s3, bucket) == sorted([
        "team/envs/envbuild-store.json", "team/envs/oci-layout", "team/envs/index.json",
        f"team/envs/blobs/sha256/{d[7:]}", "team/envs/keys/v1/ab12", "team/envs/refs.d/env/a"])
    index = json.loads(moto_s3.client().get_object(Bucket=bucket, Key="team/envs/index.json")
                       ["Body"].read())
    assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]] \
        == ["env/a"]
    store.delete_ref("env/a")
    index = json.loads(moto_s3.client().get_object(Bucket=bucket, Key="team/envs/index.json")
                       ["Body"].read())
    assert index["manifests"] == []


def test_unknown_store_version_is_refused(moto_s3, bucket):
    moto_s3.client().put_object(Bucket=bucket, Key="p/envbuild-store.json", Body=b'{"version":9}')
    with pytest.raises(StoreUnavailable, match="unsupported envbuild store version 9"):
        open_s3(moto_s3, bucket)


@pytest.mark.parametrize("sized", [True, False])
def test_parallel_multipart_upload(moto_s3, bucket, sized):
    store = open_s3(moto_s3, bucket, part_size=MiB, concurrency=4)
    data = bytes(range(256)) * (4096 * 7 + 17)  # ~7.1 MiB: 8 parts, the last one short
    d = digest_bytes(data)
    store.put(d, io.BytesIO(data), size=len(data) if sized else None)
    head = moto_s3.client().head_object(Bucket=bucket, Key=store._blob_key(d))
    assert head["ETag"].endswith('-8"')  # really multipart
    assert read_bytes(store, d) == data


def test_wrong_multipart_content_is_aborted(moto_s3, bucket):
    store = open_s3(moto_s3, bucket, part_size=MiB, concurrency=2)
    data = b"x" * (3 * MiB)
    with pytest.raises(DigestMismatch):
        store.put(digest_bytes(b"something else"), io.BytesIO(data))
    assert not list(store.list())
    uploads = moto_s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert uploads == []


def test_put_of_an_existing_blob_reads_nothing(moto_s3, bucket):
    store = open_s3(moto_s3, bucket)
    d = put_bytes(store, b"data")

    class Refuse(io.RawIOBase):
        def readinto(self, b):
            raise AssertionError("read an existing blob")

    store.put(d, Refuse())


def test_get_resumes_a_broken_body(moto_s3, bucket):
    from urllib3.exceptions import ProtocolError

    store = open_s3(moto_s3, bucket)
    data = hashlib.sha256(b"seed").digest() * 100_000  # 3.2 MB
    d = put_bytes(store, data)
    f = store.get(d)
    raw = f._raw
    real, broken = raw._body, {"done": False}

    class Breaking:
        def read(self, n):
            if not broken["done"] and raw._pos > 1000:
                broken["done"] = True
                raise ProtocolError("Connection broken: reset by peer")
            return real.read(min(n, 777))

        def close(self):
            real.close()

    raw._body = Breaking()
    assert f.read() == data
    assert broken["done"] and raw._resumes == 1


def test_concurrent_create_one_wins(moto_s3, bucket):
    store = open_s3(moto_s3, bucket)
    digests = [put_bytes(store, f"{i}".encode()) for i in range(6)]
    wins, conflicts = [], []

    def create(d):
        try:
            open_s3(moto_s3, bucket).put_ref("r", d, expect=None)
            wins.append(d)
        except RefConflict:
            conflicts.append(d)

    threads = [threading.Thread(target=create, args=(d,)) for d in digests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and len(conflicts) == 5
    assert store.get_ref("r").digest == wins[0]


def test_cas_unsupported_is_refused_not_faked(moto_s3, bucket):
    store = open_s3(moto_s3, bucket, cas=False)
    d = put_bytes(store, b"x")
    with pytest.raises(StoreError) as e:
        store.put_ref("r", d, expect=None)
    assert e.value.reference == "cas-unsupported"
    store.put_ref("r", d)  # unconditional writes still work
    assert store.get_ref("r").digest == d


def test_unreachable_endpoint_fails_fast_and_clearly():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as e:
        S3Store("bucket", "p", endpoint_url=f"http://127.0.0.1:{port}", session=session())
    assert time.monotonic() - started < 15
    assert f"127.0.0.1:{port}" in e.value.message and "cannot reach" in e.value.message
    assert "--s3-endpoint" in e.value.hint
    assert "\n" not in e.value.message


def test_missing_bucket_fails_at_once(moto_s3):
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="bucket 'no-such-bucket' does not exist") as e:
        open_s3(moto_s3, "no-such-bucket")
    assert time.monotonic() - started < 5
    assert e.value.hint


def test_open_store_url(s3_env, bucket):
    store = open_store(f"s3://{bucket}/some/prefix")
    assert isinstance(store, S3Store) and store.prefix == "some/prefix/"
    assert store.endpoint == s3_env.endpoint


def test_cli_push_and_pull(s3_env, bucket, tmp_path, capsys):
    from envbuild.cli.main import main
    from envbuild.store import LocalStore

    a = LocalStore(tmp_path / "a")
    manifest, layers, keys_ = make_lock(a)
    url = f"s3://{bucket}/shared"
    assert main(["--store", str(tmp_path / "a"), "push", "demo", "--to", url]) == 0
    out = capsys.readouterr()
    assert f"env/demo {manifest}" in out.out and "4 blob(s) copied" in out.err
    assert main(["--store", str(tmp_path / "b"), "pull", "demo", "--from", url]) == 0
    b = LocalStore(tmp_path / "b")
    assert b.get_ref("env/demo").digest == manifest
    assert sorted(b.list()) == sorted(a.list())
    assert b.list_records("keys/v1") == a.list_records("keys/v1")
    # a missing ref is a one-line error, exit 1
    assert main(["--store", str(tmp_path / "b"), "pull", "nope", "--from", url]) == 1
    assert "error: no ref 'nope'" in capsys.readouterr().err


def test_lazy_layer_over_s3_opens_with_two_requests(moto_s3, bucket, tmp_path):
    from envbuild.store.lazy import LazyLayer
    from tests.unit.test_lazy_layer import BIG, make_tree, put_layer

    store = open_s3(moto_s3, bucket)
    digest, size, toc = put_layer(store, make_tree(tmp_path / "t"))
    lazy = LazyLayer(store, digest, expected_toc_digest=toc)  # no size: a suffix range
    assert lazy.stats.requests == 2 and lazy.size == size
    assert lazy.read("big.bin", 100, 50) == BIG[100:150]
    assert lazy.stats.requests == 3
    moto_s3.client().put_object(Bucket=bucket, Key=store._blob_key(digest),
                                Body=read_bytes(store, digest)[:-1])
    from envbuild.errors import CorruptLayerError

    with pytest.raises(CorruptLayerError, match=digest):
        LazyLayer(store, digest)
