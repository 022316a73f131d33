"""How a lazy node fetches, over a real store over HTTP (moto S3), real FUSE (passthrough and
the libfuse fallback), overlayfs and runc: a large file streamed in parallel frames arrives
whole and verified; the first open of a Python extension module fetches its siblings and the
wheel's vendored libraries before anyone opens them; a recorded profile is prefetched in a
few coalesced ranged reads. What was fetched is read from the daemon (``lazy_stats``)."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from envbuild.store import open_store
from runtime_shim.lazyfs import PROFILE_NAMESPACE, lazy_stats
from runtime_shim.lazyfs.control import daemon_request
from runtime_shim.node.nodecache import NodeCache
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool
from tests.integration.test_container_runtime import make_busybox_root
from tests.integration.test_lazy_sandbox import _lock, _no_leftovers, _pack, _settled
from tests.store.s3server import moto_s3, s3_env  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

MiB = 1 << 20
SP = "venv/lib/python3.11/site-packages"
EXT = ".cpython-311-x86_64-linux-gnu.so"


@pytest.fixture
def mode(lazy_mode):  # both read paths (tests/conftest.py)
    return lazy_mode


@pytest.fixture
def s3(s3_env, tmp_path):  # noqa: F811  (fixture)
    require_root()
    require_tool("runc")
    require_tool("fusermount3")
    store = open_store(f"s3://{s3_env.make_bucket()}/lazy")
    node_dir = tmp_path / "n"
    yield store, node_dir
    _no_leftovers(node_dir)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_large_file_is_streamed_in_parallel_frames_and_arrives_verified(s3, mode, tmp_path):
    store, node_dir = s3
    root = make_busybox_root(tmp_path / "root")
    big = os.urandom(9 * MiB)  # three frames (cut every 4 MiB)
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(big)
    layer = _pack(store, root, tmp_path, "big")
    _lock(store, "big", [layer])
    with Sandbox.create("big", store=store, node_dir=node_dir, lazy="fuse") as sb:
        mp = NodeCache(node_dir / "node").lazy_dir(layer.digest)
        before = lazy_stats(mp)
        r = sb.exec("sha256sum /data/big.bin")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.decode().split()[0] == _digest(big)
        stats = lazy_stats(mp)
        assert stats["frames_fetched"] - before["frames_fetched"] >= 3
        if mode == "passthrough":  # one read per frame, written to files/ as it verified
            assert stats["requests"] - before["requests"] >= 3, stats
            assert (node_dir / "node" / "files" / _digest(big)).stat().st_size == len(big)
            assert not [f for f in os.listdir(node_dir / "node" / "files")
                        if f.endswith(".tmp")]
        assert sb.exec("cmp /data/big.bin /data/big.bin").exit_code == 0


def test_an_extension_modules_first_open_fetches_its_siblings_and_vendored_libs(
        s3, mode, tmp_path):
    store, node_dir = s3
    root = make_busybox_root(tmp_path / "root")
    pkg, libs = root / SP / "pkg", root / SP / "pkg.libs"
    pkg.mkdir(parents=True)
    libs.mkdir()
    # siblings over 1 MiB: no tar-order window or directory readahead takes them
    contents = {f"{SP}/pkg/a{EXT}": os.urandom(64 << 10),
                f"{SP}/pkg/b{EXT}": os.urandom(3 * MiB // 2),
                f"{SP}/pkg/c.abi3.so": os.urandom(3 * MiB // 2),
                f"{SP}/pkg.libs/libvendored.so": os.urandom(2 * MiB)}
    for path, data in contents.items():
        (root / path).write_bytes(data)
    (pkg / "unrelated.dat").write_bytes(os.urandom(2 * MiB))
    layer = _pack(store, root, tmp_path, "ext")
    _lock(store, "ext", [layer])
    with Sandbox.create("ext", store=store, node_dir=node_dir, lazy="fuse") as sb:
        mp = NodeCache(node_dir / "node").lazy_dir(layer.digest)
        assert sb.exec("true").exit_code == 0
        start = _settled(mp)
        assert sb.exec(f"cat /{SP}/pkg/a{EXT} > /dev/null").exit_code == 0
        stats = _settled(mp)
        # a, and in the background b, c and the vendored library; not unrelated.dat
        fetched = sum(len(d) for d in contents.values())
        got = stats["bytes_decompressed"] - start["bytes_decompressed"]
        assert fetched <= got < fetched + MiB, (got, stats)
        r = sb.exec(f"sha256sum /{SP}/pkg/b{EXT} /{SP}/pkg/c.abi3.so "
                    f"/{SP}/pkg.libs/libvendored.so")
        assert r.exit_code == 0, r.stderr
        assert [line.split()[0] for line in r.stdout.decode().splitlines()] == [
            _digest(contents[p]) for p in list(contents)[1:]]
        assert lazy_stats(mp)["requests"] == stats["requests"]  # nothing more was needed
        if mode == "passthrough":
            files = set(os.listdir(node_dir / "node" / "files"))
            assert {_digest(d) for d in contents.values()} <= files


def test_a_recorded_profile_is_prefetched_in_a_few_coalesced_reads(s3, mode, tmp_path):
    store, node_dir = s3
    root = make_busybox_root(tmp_path / "root")
    (root / "srv").mkdir()
    wanted = []
    for i in range(40):  # read every other file: 40 small files with 20 KiB gaps between
        (root / "srv" / f"f{i:02}-a").write_bytes(os.urandom(20 << 10))
        (root / "srv" / f"f{i:02}-b").write_bytes(os.urandom(20 << 10))
        wanted.append(f"/srv/f{i:02}-a")
    layer = _pack(store, root, tmp_path, "prof")
    _lock(store, "prof", [layer])
    with Sandbox.create("prof", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert sb.exec("cat " + " ".join(wanted) + " > /dev/null").exit_code == 0
        ping = daemon_request(node_dir / "node", {"op": "ping"}, 5.0)
        assert ping is not None and ping["boto3_loaded"] is False, ping
    NodeCache(node_dir / "node").evict((), 0)  # unmounting saves the profile
    assert store.list_records(PROFILE_NAMESPACE)
    # saved through the presigned PUT URL the create handed over: no boto3 in the daemon
    log = (node_dir / "node" / "lazy" / "daemon.log").read_text()
    assert "through its presigned URL" in log and "through the store instead" not in log, log
    other = tmp_path / "n2"
    try:
        with Sandbox.create("prof", store=store, node_dir=other, lazy="fuse") as sb:
            mp = NodeCache(other / "node").lazy_dir(layer.digest)
            stats = _settled(mp)
            assert stats["files_verified"] >= 40, stats
            # footer+TOC, busybox, and the 40 files in a handful of reads (not 40)
            assert stats["requests"] - 1 <= 8, stats
            t0 = time.monotonic()
            r = sb.exec("cat " + " ".join(wanted) + " | sha256sum")
            assert r.exit_code == 0, r.stderr
            assert time.monotonic() - t0 < 30
            assert lazy_stats(mp)["requests"] == stats["requests"]
            want = hashlib.sha256(b"".join((root / p.lstrip("/")).read_bytes()
                                           for p in wanted)).hexdigest()
            assert r.stdout.decode().split()[0] == want
    finally:
        _no_leftovers(other)

