"""S3 faults: the server dies or drops off mid-push, a blob is corrupted on the server, the
endpoint is unreachable, two pushes race. Against a real moto_server on 127.0.0.1.

moto keeps its state in memory, so a *killed* server comes back empty: that test checks the
client fails clearly and in bounded time, and that the rerun against the restarted server
completes. The invariant "no ref or key record ever points at a missing blob" is checked
against a server that stays up behind a proxy that cuts every connection mid-push (a network
partition, or a crash of a server with durable storage, which is what real S3 is).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from envbuild.errors import DigestMismatch, StoreUnavailable
from envbuild.store import KEY_RECORDS, LocalStore, get_key_record, read_bytes
from envbuild.store.s3 import S3Store
from envbuild.store.sync import sync
from tests.conftest import REPO
from tests.store.s3server import CREDENTIALS, CuttableProxy, MotoServer, free_port, session
from tests.store.test_sync import make_lock

MiB = 1 << 20


@pytest.fixture
def server():
    s = MotoServer().start()
    yield s
    s.kill()


def big_lock(tmp_path, n_layers=4, size=3 * MiB):
    """A local store with a lock of a few multi-MiB layers (multipart with 1 MiB parts)."""
    store = LocalStore(tmp_path / "local")
    tag = os.urandom(size)
    manifest, layers, keys = make_lock(store, n_layers=n_layers, tag=tag)
    return store, manifest, layers, keys


def s3(endpoint, bucket, **kw) -> S3Store:
    kw.setdefault("part_size", MiB)
    kw.setdefault("max_attempts", 2)
    return S3Store(bucket, "shared", endpoint_url=endpoint, session=session(), **kw)


def consistent(store) -> None:
    """Every ref and key record in ``store`` points at blobs it has."""
    from envbuild.store.sync import walk

    for name in store.list_refs():
        for digest, _ in walk(store, store.get_ref(name))[0]:
            assert store.exists(digest), f"ref {name} reaches missing blob {digest}"
    for hex_key in store.list_records(KEY_RECORDS):
        rec = get_key_record(store, "sha256:" + hex_key)
        assert store.exists(rec.layer), f"key record {hex_key} points at a missing layer"


def test_server_killed_mid_push_fails_clearly_then_rerun_completes(server, tmp_path):
    local, manifest, layers, _ = big_lock(tmp_path)
    bucket = server.make_bucket()
    remote = s3(server.endpoint, bucket, concurrency=2)
    started = time.monotonic()

    def kill_after_first_blob(msg):
        if msg.startswith("copied"):
            server.kill()

    with pytest.raises(StoreUnavailable) as e:
        sync(local, remote, refs=["env/demo"], jobs=1, progress=kill_after_first_blob)
    assert time.monotonic() - started < 30
    assert "cannot reach S3 endpoint" in e.value.message and server.endpoint in e.value.message
    assert "\n" not in e.value.message

    server.start()  # same port, empty (moto's state is in memory)
    server.make_bucket(bucket)
    remote = s3(server.endpoint, bucket)
    consistent(remote)
    report = sync(local, remote, refs=["env/demo"])
    assert remote.get_ref("env/demo").digest == manifest
    consistent(remote)
    assert sorted(remote.list()) == sorted(local.list())
    assert report.refs == {"env/demo": manifest}


def test_connection_cut_mid_push_leaves_no_dangling_ref_or_record(server, tmp_path):
    local, manifest, layers, keys = big_lock(tmp_path, n_layers=6)
    bucket = server.make_bucket()
    proxy = CuttableProxy(server.port)
    try:
        remote = s3(proxy.endpoint, bucket, concurrency=2)
        copied = []

        def cut_after_two(msg):
            if msg.startswith("copied"):
                copied.append(msg)
                if len(copied) == 2:
                    proxy.cut()

        with pytest.raises(StoreUnavailable, match="cannot reach S3 endpoint"):
            sync(local, remote, refs=["env/demo"], jobs=1, progress=cut_after_two)
        direct = s3(server.endpoint, bucket)  # the server kept what it had acknowledged
        consistent(direct)
        assert direct.list_refs() == []
        present = set(direct.list())
        assert 2 <= len(present & set(layers)) < len(layers)
        multipart = server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        assert all(u["Key"].endswith(tuple(d[7:] for d in layers)) for u in multipart)

        proxy.restore()
        report = sync(local, s3(proxy.endpoint, bucket), refs=["env/demo"])
        assert set(report.blobs_copied).isdisjoint(present)  # only what was missing
        consistent(direct)
        assert direct.get_ref("env/demo").digest == manifest
        assert sorted(direct.list()) == sorted(local.list())
    finally:
        proxy.close()


def cli(*args, env_extra=None, timeout=60):
    env = {**os.environ, **CREDENTIALS, **(env_extra or {})}
    env.pop("AWS_ENDPOINT_URL", None)
    return subprocess.run([sys.executable, "-m", "envbuild.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_corrupted_blob_on_the_server_is_detected(server, tmp_path):
    from envbuild.errors import CorruptLayerError
    from envbuild.store.lazy import LazyLayer
    from tests.unit.test_lazy_layer import make_tree, put_layer

    local, manifest, layers, _ = big_lock(tmp_path, n_layers=2, size=64 << 10)
    bucket = server.make_bucket()
    remote = s3(server.endpoint, bucket)
    sync(local, remote, refs=["env/demo"])
    victim = layers[1]
    data = bytearray(read_bytes(remote, victim))
    data[len(data) // 2] ^= 1
    server.client().put_object(Bucket=bucket, Key=remote._blob_key(victim), Body=bytes(data))

    r = cli("--store", str(tmp_path / "b"), "--s3-endpoint", server.endpoint, "pull", "demo",
            "--from", f"s3://{bucket}/shared")
    assert r.returncode == 1, r.stderr
    assert f"error: blob {victim} at s3://{bucket}/shared/blobs/sha256/{victim[7:]} is corrupt" \
        in r.stderr
    b = LocalStore(tmp_path / "b")
    assert not b.exists(victim) and b.list_refs() == []
    with pytest.raises(DigestMismatch, match=victim):
        read_bytes(remote, victim)

    # lazily read layers are checked per file against the TOC
    digest, size, _ = put_layer(remote, make_tree(tmp_path / "t"))
    lazy = LazyLayer(remote, digest)
    c = lazy.stat("dir/sub/b.bin").chunks[0]
    blob = bytearray(read_bytes(remote, digest))
    blob[c.offset + 5] ^= 0xFF
    server.client().put_object(Bucket=bucket, Key=remote._blob_key(digest), Body=bytes(blob))
    with pytest.raises(CorruptLayerError, match=digest):
        lazy.read("dir/sub/b.bin")


def test_unreachable_endpoint_fails_within_15_seconds(tmp_path):
    port = free_port()
    started = time.monotonic()
    r = cli("--store", str(tmp_path / "b"), "--s3-endpoint", f"http://127.0.0.1:{port}", "pull",
            "demo", "--from", "s3://bucket/prefix")
    took = time.monotonic() - started
    assert r.returncode == 1 and took < 15, (took, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: open store s3://bucket/prefix/: cannot reach S3 "
                               f"endpoint http://127.0.0.1:{port}")
    assert lines[1].startswith("hint: check --s3-endpoint")


def test_two_pushes_of_the_same_layers_at_once_both_succeed(server, tmp_path):
    local, manifest, layers, _ = big_lock(tmp_path, n_layers=3, size=20 * MiB)  # multipart
    bucket = server.make_bucket()
    args = ["--store", str(tmp_path / "local"), "--s3-endpoint", server.endpoint, "push",
            "demo", "--to", f"s3://{bucket}/shared"]
    env = {**os.environ, **CREDENTIALS}
    env.pop("AWS_ENDPOINT_URL", None)
    procs = [subprocess.Popen([sys.executable, "-m", "envbuild.cli", *args], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    remote = s3(server.endpoint, bucket)
    assert remote.get_ref("env/demo").digest == manifest
    assert sorted(remote.list()) == sorted(local.list())
    consistent(remote)
    for d in layers:
        assert read_bytes(remote, d) == read_bytes(local, d)
