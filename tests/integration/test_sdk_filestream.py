"""``Sandbox.read_stream`` / ``write_stream`` and their ``AsyncSandbox`` forms (issue 37: the
e2b server's ``/files`` streams through them): files of any size in bounded memory, a write
published whole or not at all, owned by the user it names. Real runc sandboxes of the busybox
env (the fallback of a backend without ``FileStreams``: ``tests/unit/test_sdk_filestream.py``)."""

from __future__ import annotations

import asyncio
import os
import tracemalloc

import pytest

from envbuild.errors import RuntimeShimError
from runtime_shim import AsyncSandbox, Limits, Sandbox
from runtime_shim.backends.base import FileStreams
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.integration
ENV = "busybox-shell"
MIB = 1 << 20


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("sdkstream"))


@pytest.fixture(scope="module")
def sandbox(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        yield sb


def _ls(sb: Sandbox, d: str) -> list[str]:
    return sb.exec(["ls", "-a", d]).stdout.decode().split()


def test_a_stream_writes_and_reads_pieces_in_bounded_memory(sandbox):
    assert isinstance(sandbox.handle, FileStreams)
    piece = os.urandom(MIB)
    tracemalloc.start()
    try:
        with sandbox.write_stream("/tmp/s/big.bin") as w:
            for _ in range(48):
                w.write(piece)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 8 * MIB, peak  # never the whole 48 MiB
        tracemalloc.reset_peak()
        total = 0
        with sandbox.read_stream("/tmp/s/big.bin") as f:
            assert os.fstat(f.fileno()).st_size == 48 * MIB
            while chunk := f.read(MIB):
                assert chunk == piece
                total += len(chunk)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < 8 * MIB, peak
    finally:
        tracemalloc.stop()
    assert total == 48 * MIB
    assert sandbox.exec("wc -c < /tmp/s/big.bin").stdout.strip() == b"50331648"
    assert _ls(sandbox, "/tmp/s") == [".", "..", "big.bin"]  # no temporary file left


def test_a_write_is_published_whole_or_not_at_all(sandbox):
    sandbox.write_file("/tmp/w.txt", b"old")
    w = sandbox.write_stream("/tmp/w.txt")
    w.write(b"half of the new")
    assert sandbox.read_file("/tmp/w.txt") == b"old"  # nothing seen before commit
    w.abort()
    assert sandbox.read_file("/tmp/w.txt") == b"old" and _ls(sandbox, "/tmp").count("w.txt") == 1
    assert not [n for n in _ls(sandbox, "/tmp") if ".envbuild-" in n]
    with pytest.raises(ValueError, match="boom"):
        with sandbox.write_stream("/tmp/w.txt") as w:
            w.write(b"new")
            raise ValueError("boom")
    assert sandbox.read_file("/tmp/w.txt") == b"old"
    with sandbox.write_stream("/tmp/w.txt", mode=0o600) as w:
        w.write(b"new")
    assert sandbox.read_file("/tmp/w.txt") == b"new"
    assert sandbox.exec("stat -c %a /tmp/w.txt").stdout.strip() == b"600"
    with pytest.raises(RuntimeShimError, match="aborted"):
        w.commit()


def test_the_file_is_owned_by_the_user_from_the_start(sandbox):
    with sandbox.write_stream("/tmp/owned/mine.txt", user="1000:1001") as w:
        w.write(b"x")
    assert sandbox.exec("stat -c %u:%g /tmp/owned/mine.txt").stdout.strip() == b"1000:1001"
    # the directory the write made is root's, as write_file's
    assert sandbox.exec("stat -c %u /tmp/owned").stdout.strip() == b"0"
    with sandbox.write_stream("/tmp/owned/lock-user.txt") as w:  # default: the lock's user
        w.write(b"y")
    assert sandbox.exec("stat -c %u:%g /tmp/owned/lock-user.txt").stdout.strip() == b"0:0"


def test_paths_that_name_no_file_are_refused(sandbox):
    for path in ("/", "/tmp/..", "/tmp/."):
        with pytest.raises(RuntimeShimError, match="not a file name"):
            sandbox.write_stream(path)
    with pytest.raises(RuntimeShimError, match="No such file"):
        sandbox.read_stream("/tmp/not-there")


def test_async_streams(sandbox, built):
    store, node = built

    async def scenario():
        sb = await AsyncSandbox.attach(sandbox.id, store=store, node_dir=node)
        async with await sb.write_stream("/tmp/a/async.bin", user="7:7") as w:
            for i in range(4):
                await w.write(bytes([i]) * MIB)
        assert w.written == 4 * MIB
        f = await sb.read_stream("/tmp/a/async.bin")
        with f:
            data = await asyncio.get_running_loop().run_in_executor(None, f.read)
        assert data == b"".join(bytes([i]) * MIB for i in range(4))
        w = await sb.write_stream("/tmp/a/async.bin")
        await w.write(b"never")
        await w.abort()
        return (await sb.exec("stat -c %u:%s /tmp/a/async.bin")).stdout.strip()

    assert asyncio.run(scenario()) == f"7:{4 * MIB}".encode()


def test_an_fncall_stream_writes_into_the_next_calls_fresh_layer(built):
    """As ``write_file`` on FnCall: the layer a call used is reset before the write, so the
    next call sees the streamed file and nothing the previous call left."""
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node, backend="fncall") as fn:
        fn.call("echo left > /tmp/left")
        with fn.write_stream("/tmp/in.txt") as w:
            w.write(b"stream")
            w.write(b"ed\n")
        got = fn.call("cat /tmp/in.txt; ls -A /tmp")
        assert got.stdout == b"streamed\nin.txt\n", got


def test_an_existing_file_is_rewritten_in_place(sandbox):
    """Same inode (links and open readers see the new bytes) and a ``write`` event for a
    watcher, as ``write_file`` and E2B's envd give; a new file appears under its name."""
    from runtime_shim.isolation.watch import WatchEvent

    sandbox.exec("mkdir -p /tmp/inplace && echo old > /tmp/inplace/f && "
                 "ln /tmp/inplace/f /tmp/inplace/hard")
    inode = sandbox.exec("stat -c %i /tmp/inplace/f").stdout
    w = sandbox.watch("/tmp/inplace")
    try:
        with sandbox.write_stream("/tmp/inplace/f") as s:
            s.write(b"new\n")
        with sandbox.write_stream("/tmp/inplace/made") as s:
            s.write(b"made\n")
        got = []
        for _ in range(50):
            got += w.wait(0.1)
            if {WatchEvent("write", "f"), WatchEvent("create", "made")} <= set(got):
                break
        assert {WatchEvent("write", "f"), WatchEvent("create", "made")} <= set(got), got
    finally:
        w.close()
    assert sandbox.exec("stat -c %i /tmp/inplace/f").stdout == inode
    assert sandbox.read_file("/tmp/inplace/hard") == b"new\n"


@pytest.mark.parametrize("disk", [None, 256 * MIB], ids=["overlay", "disk-pool"])
def test_a_rewrite_in_place_takes_the_new_size(built, disk):
    """The new bytes are copied over the old ones and the file cut to their size: a shorter
    rewrite leaves nothing of the old tail, a longer one grows the file (same inode) — on the
    host's filesystem and on the node's btrfs disk pool (a disk cap)."""
    store, node = built
    limits = Limits(disk_bytes=disk) if disk else None
    with Sandbox.create(ENV, store=store, node_dir=node, limits=limits) as sb:
        sb.write_file("/tmp/resize", b"x" * (3 * MIB))
        inode = sb.exec("stat -c %i /tmp/resize").stdout
        for data in (b"short", os.urandom(MIB + 7), b""):
            with sb.write_stream("/tmp/resize") as s:
                s.write(data)
            assert sb.read_file("/tmp/resize") == data
            assert sb.exec("stat -c %i /tmp/resize").stdout == inode


def test_held_bytes_go_straight_into_an_existing_file(sandbox):
    """``hold``: an existing file's new bytes wait in memory (no hidden file beside it) and
    are written into it at ``commit`` (same inode); an abort leaves it as it was; past
    ``hold`` they spill into the hidden file and the write goes on from there."""
    sandbox.exec("mkdir -p /tmp/held && echo old > /tmp/held/f")
    inode = sandbox.exec("stat -c %i /tmp/held/f").stdout
    with sandbox.write_stream("/tmp/held/f", hold=MIB) as s:
        s.write(b"new ")
        s.write(bytearray(b"bytes"))
        assert _ls(sandbox, "/tmp/held") == [".", "..", "f"]  # nothing beside it
        assert sandbox.read_file("/tmp/held/f") == b"old\n"
    assert sandbox.read_file("/tmp/held/f") == b"new bytes"
    assert sandbox.exec("stat -c %i /tmp/held/f").stdout == inode
    with pytest.raises(RuntimeError), sandbox.write_stream("/tmp/held/f", hold=MIB) as s:
        s.write(b"dropped")
        raise RuntimeError("the upload broke")
    assert sandbox.read_file("/tmp/held/f") == b"new bytes"
    big = os.urandom(3 * MIB)
    with sandbox.write_stream("/tmp/held/f", hold=MIB) as s:
        s.write(big[:MIB])
        assert _ls(sandbox, "/tmp/held") == [".", "..", "f"]
        s.write(big[MIB:])  # past hold: spilled
        assert len(_ls(sandbox, "/tmp/held")) == 4  # the hidden file beside it
    assert sandbox.read_file("/tmp/held/f") == big
    assert _ls(sandbox, "/tmp/held") == [".", "..", "f"]
    assert sandbox.exec("stat -c %i /tmp/held/f").stdout == inode
