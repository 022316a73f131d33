"""Lazy mode's node-level guarantees over real FUSE (passthrough and the libfuse fallback),
overlayfs and runc: identical files of different layers fetched once per node, N sandboxes
starting at once fetching each byte once within a bounded number of store requests in flight,
every fetched byte verified before a sandbox sees it, a store that stops answering turned into
EIO in bounded time (logged), and ``lazy="auto"`` falling back to a full pull when the daemon
cannot start. ``envbuild node ls`` reports the mode."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from envbuild.errors import EnvbuildError, RuntimeShimError
from envbuild.store import LocalStore
from runtime_shim.lazyfs import lazy_stats
from runtime_shim.lazyfs.control import daemon_request
from runtime_shim.node.nodecache import NodeCache
from runtime_shim.sdk.sandbox import Sandbox
from tests.conftest import require_root, require_tool
from tests.integration.test_container_runtime import make_busybox_root
from tests.integration.test_lazy_sandbox import _lock, _no_leftovers, _pack

pytestmark = pytest.mark.integration

SHARED = 2 << 20   # a file of frames of its own, in both layers


@pytest.fixture
def mode(lazy_mode):  # both read paths (tests/conftest.py)
    return lazy_mode


@pytest.fixture
def dup(tmp_path, mode):
    """A store with lock ``dup``: a busybox base holding ``/a/blob`` and ``/a/other``, and a
    second layer holding the same bytes as ``/b/blob`` (same content digest, other blob)."""
    require_root()
    require_tool("runc")
    require_tool("fusermount3")
    store = LocalStore(tmp_path / "store")
    payload = os.urandom(SHARED)
    base = make_busybox_root(tmp_path / "base")
    (base / "a").mkdir()
    (base / "a" / "blob").write_bytes(payload)
    (base / "a" / "other").write_bytes(os.urandom(SHARED))
    top = tmp_path / "top"
    (top / "b").mkdir(parents=True)
    (top / "b" / "blob").write_bytes(payload)
    layers = [_pack(store, base, tmp_path, "base"), _pack(store, top, tmp_path, "top")]
    _lock(store, "dup", layers)
    node_dir = tmp_path / "n"
    yield store, node_dir, layers, payload
    _no_leftovers(node_dir)


def _ping(node_dir: Path) -> dict:
    reply = daemon_request(node_dir / "node", {"op": "ping"}, 5.0)
    assert reply is not None
    return reply


def test_identical_files_of_two_layers_are_fetched_once(dup, mode):
    store, node_dir, layers, payload = dup
    node = NodeCache(node_dir / "node")
    with Sandbox.create("dup", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert _ping(node_dir)["mode"] == mode
        r = sb.exec("sha256sum /a/blob /b/blob")
        assert r.exit_code == 0, r.stderr
        a, b = (line.split()[0] for line in r.stdout.decode().splitlines())
        assert a == b
        top = lazy_stats(node.lazy_dir(layers[1].digest))
        if mode == "passthrough":
            # /b/blob came from the node's file cache: its layer fetched only footer and TOC
            assert top["frames_fetched"] == 0 and top["bytes_fetched"] == top["toc_bytes"], top
            files = list((node_dir / "node" / "files").iterdir())
            assert len([f for f in files if not f.name.startswith(".")]) >= 2  # busybox, blob
        else:  # the fallback dedupes pieces by content key: the same holds for the pieces
            assert top["bytes_fetched"] - top["toc_bytes"] < SHARED // 2, top


def _described(e: BaseException) -> str:
    """An error with what it carries: a failed start's context is runc's own message."""
    if isinstance(e, EnvbuildError):
        return "\n".join(e.render_lines())
    return repr(e)


def _daemon_complaints(node_dir: Path) -> list[str]:
    """The lazy daemon's errors and warnings (its log), for a failure's message."""
    log = node_dir / "node" / "lazy" / "daemon.log"
    if not log.exists():
        return []
    return [line for line in log.read_text(errors="replace").splitlines()
            if " ERROR " in line or " WARNING " in line or "Traceback" in line][-20:]


def test_a_burst_of_sandboxes_fetches_each_byte_once_within_the_concurrency_bound(
        dup, mode, monkeypatch):
    store, node_dir, layers, payload = dup
    monkeypatch.setenv("ENVBUILD_LAZY_FETCH_CONCURRENCY", "2")
    node = NodeCache(node_dir / "node")
    n = 4
    boxes: list[Sandbox] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)
    outs: list[bytes] = []

    def start() -> None:
        try:
            sb = Sandbox.create("dup", store=store, node_dir=node_dir, lazy="fuse")
            boxes.append(sb)
            barrier.wait(30)
            r = sb.exec("sha256sum /a/blob /a/other")
            assert r.exit_code == 0, r.stderr
            outs.append(r.stdout)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=start) for _ in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, ([_described(e) for e in errors], _daemon_complaints(node_dir))
        assert len(set(outs)) == 1
        base = lazy_stats(node.lazy_dir(layers[0].digest))
        ping = _ping(node_dir)
        assert ping["fetch_concurrency"] == 2
        assert 1 <= ping["max_requests_in_flight"] <= 2, ping
        assert ping["malloc"] == "tuned", ping   # one glibc arena, freed buffers kept
        # each needed byte once: the two files, busybox and readahead, not n times that
        data = base["bytes_fetched"] - base["toc_bytes"]
        assert data < 1.1 * (2 * SHARED + (4 << 20)), base
        if mode == "passthrough":
            assert base["passthrough_opens"] >= 2 and base["userspace_reads"] == 0, base
    finally:
        for sb in boxes:
            sb.close()


def test_a_corrupt_blob_is_eio_and_nothing_unverified_is_cached(dup, mode):
    store, node_dir, layers, payload = dup
    blob = store.blob_path(layers[0].digest)
    with Sandbox.create("dup", store=store, node_dir=node_dir, lazy="fuse") as sb:
        # flip a byte inside /a/blob's frame (its compressed bytes are the random payload)
        data = bytearray(blob.read_bytes())
        at = data.find(payload[4096:4160])
        assert at > 0
        data[at + 10] ^= 0xFF
        os.chmod(blob, 0o644)
        blob.write_bytes(bytes(data))
        r = sb.exec("cat /a/blob > /dev/null")
        assert r.exit_code != 0
        assert b"I/O error" in r.stderr or b"Input/output error" in r.stderr, r.stderr
        files = node_dir / "node" / "files"
        if files.is_dir():  # never the corrupt file's contents under its digest
            import hashlib
            want = hashlib.sha256(payload).hexdigest()
            assert not (files / want).exists()
        log = (node_dir / "node" / "lazy" / "daemon.log").read_text()
        assert "does not match its TOC digest" in log


def test_a_store_that_stops_answering_is_eio_in_bounded_time(dup, mode, monkeypatch):
    store, node_dir, layers, payload = dup
    monkeypatch.setenv("ENVBUILD_LAZY_FETCH_TIMEOUT", "2")
    blob = store.blob_path(layers[0].digest)
    with Sandbox.create("dup", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert sb.exec("cat /bin/busybox > /dev/null").exit_code == 0
        # the store hangs: the blob becomes a FIFO nobody writes (open blocks forever)
        os.unlink(blob)
        os.mkfifo(blob)
        try:
            t0 = time.monotonic()
            r = sb.exec("cat /a/other > /dev/null", timeout=60)
            took = time.monotonic() - t0
            assert not r.timed_out and r.exit_code != 0
            assert b"I/O error" in r.stderr or b"Input/output error" in r.stderr, r.stderr
            assert took < 10, took
            log = (node_dir / "node" / "lazy" / "daemon.log").read_text()
            assert "the store did not answer within 2 s" in log
            # what was fetched before still reads
            assert sb.exec("cat /bin/busybox > /dev/null").exit_code == 0
        finally:
            _unblock(blob)


def _unblock(fifo: Path) -> None:
    """Give a fetch stuck opening ``fifo`` an EOF (a short read: reported as corrupt)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: nobody is reading it
        pass


def test_a_daemon_that_cannot_start_is_an_error_and_its_switches_refused_natively(
        dup, mode, monkeypatch):
    """``lazy="fuse"`` whose daemon cannot start is an error; the FUSE switch that broke it
    is refused in one line by a native lazy create (it would change nothing there)."""
    store, node_dir, layers, payload = dup
    monkeypatch.setenv("ENVBUILD_LAZY_FETCH_CONCURRENCY", "many")  # the daemon exits 1
    with pytest.raises(RuntimeShimError, match="lazy layer daemon exited 1"):
        Sandbox.create("dup", store=store, node_dir=node_dir, lazy="fuse")
    for lazy in (True, "auto", "native"):
        with pytest.raises(RuntimeShimError, match="switch of the FUSE lazy stacks") as err:
            Sandbox.create("dup", store=store, node_dir=node_dir, lazy=lazy)
        assert "ENVBUILD_LAZY_FETCH_CONCURRENCY" in (err.value.hint or "")
        assert "\n" not in err.value.message
    assert not (node_dir / "node" / "native").exists()
    with pytest.raises(RuntimeShimError, match="lazy must be"):
        Sandbox.create("dup", store=store, node_dir=node_dir, lazy="yes")


def test_node_ls_reports_the_mode(dup, mode):
    store, node_dir, layers, payload = dup
    with Sandbox.create("dup", store=store, node_dir=node_dir, lazy="fuse"):
        from click.testing import CliRunner

        from envbuild.cli.main import cli

        res = CliRunner().invoke(cli, ["node", "ls"], env={"ENVBUILD_NODE_CACHE": str(node_dir)})
        assert res.exit_code == 0, res.output
        assert f"mode {mode}" in res.output, res.output
        if mode == "fuse":
            assert "disabled by $ENVBUILD_LAZY_PASSTHROUGH" in res.output
        assert res.output.count(" mounted") == 2


def test_a_node_that_has_the_files_fetches_none_of_them_again(tmp_path, monkeypatch):
    """A new daemon on a node whose file cache holds a layer's files (a node that ran the env
    before, or another env sharing the layer) guesses none of them: opening one extension
    module would fetch its siblings' frames (the extension readahead), every one of them
    already in ``files/``."""
    require_root()
    require_tool("runc")
    require_tool("fusermount3")
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    store = LocalStore(tmp_path / "store")
    base = make_busybox_root(tmp_path / "base")
    pkg = base / "opt" / "pkg"
    pkg.mkdir(parents=True)
    names = [f"m{i}.cpython-311-x86_64-linux-gnu.so" for i in range(4)]
    for name in names:
        (pkg / name).write_bytes(os.urandom(300_000))
    layers = [_pack(store, base, tmp_path, "base")]
    _lock(store, "warm", layers)
    node_dir = tmp_path / "n"
    node = NodeCache(node_dir / "node")
    try:
        with Sandbox.create("warm", store=store, node_dir=node_dir, lazy="fuse") as sb:
            assert _ping(node_dir)["mode"] == "passthrough"
            r = sb.exec(["cat", *(f"/opt/pkg/{n}" for n in names)])
            assert r.exit_code == 0 and len(r.stdout) == 4 * 300_000, r.stderr
        node.evict((), 0)   # the daemon exits with its mounts; files/ stays
        for d in ("chunks", "meta"):
            shutil.rmtree(node_dir / "node" / d, ignore_errors=True)
        with Sandbox.create("warm", store=store, node_dir=node_dir, lazy="fuse") as sb:
            r = sb.exec(["cat", f"/opt/pkg/{names[0]}"])
            assert r.exit_code == 0, r.stderr
            time.sleep(0.5)   # the extension readahead runs in the background
            r = sb.exec(["cat", *(f"/opt/pkg/{n}" for n in names[1:])])
            assert r.exit_code == 0 and len(r.stdout) == 3 * 300_000, r.stderr
            stats = lazy_stats(node.lazy_dir(layers[0].digest))
            # the busybox tree's files and the modules all came from files/: footer and TOC only
            assert stats["frames_fetched"] == 0, (stats, _daemon_complaints(node_dir))
            assert stats["bytes_fetched"] == stats["toc_bytes"], stats
    finally:
        _no_leftovers(node_dir)
