"""Meta layers over real FUSE passthrough, overlayfs and runc: once a lazy sandbox fetched its
files, a later sandbox of the same lock gets each layer's meta layer (metacopy files in a
read-only overlay with the node's file cache as its data-only layer) right above the layer's
FUSE mount, so opening and reading those files never reaches the daemon — with the same tree
as a full sandbox (whiteouts, opaque dirs, hardlinks, xattrs), plain copy-ups, generations
built once and shared, data pinned against the file cache's eviction, and nothing left after
the node's eviction (``_no_leftovers``)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from runtime_shim.lazyfs import lazy_stats, metalayer
from runtime_shim.lazyfs.control import daemon_request
from runtime_shim.lazyfs.passthrough import OPEN
from runtime_shim.node.nodecache import NodeCache
from runtime_shim.sdk.sandbox import Sandbox
from tests.integration.test_lazy_sandbox import LISTING, lock2  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def passthrough(monkeypatch):
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    monkeypatch.delenv(metalayer.ENV_SWITCH, raising=False)


def _lowerdirs(sb) -> list[str]:
    """The lower dirs of the sandbox's root overlay (mounted in its own mount namespace)."""
    with open(f"/proc/{sb.host_pid}/mountinfo", encoding="utf-8") as f:
        for line in f:
            if line.split()[4] == "/":
                opts = line.split(" - ", 1)[1].split()[2]
                low = next(o for o in opts.split(",") if o.startswith("lowerdir="))
                return low.removeprefix("lowerdir=").split(":")
    raise AssertionError(f"{sb.id} has no root mount")


def _opens(mp: Path) -> int:
    return int(lazy_stats(mp)["requests_by_opcode"].get(str(OPEN), 0))


def _quiet(node_dir: Path) -> None:
    """Wait until no fetch landed in the file cache for a while (background fetches), and no
    meta build runs or is promised (the one a sandbox's close starts: a create does not wait
    for it)."""
    files = node_dir / "node" / "files"
    while time.time() - os.stat(files).st_mtime < 0.3 or _building(node_dir):
        time.sleep(0.05)


def _building(node_dir: Path) -> int:
    reply = daemon_request(node_dir / "node", {"op": "ping"}, 10.0)
    return int((reply or {}).get("meta_building", 0))


def test_a_rerun_opens_fetched_files_without_the_daemon(lock2):  # noqa: F811
    store, node_dir, layers = lock2
    node = NodeCache(node_dir / "node")
    mounts = [node.lazy_dir(x.digest) for x in layers]
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as first:
        assert not any("/meta/" in d for d in _lowerdirs(first))  # nothing yet
        assert first.info().lazy == "passthrough"
        a = first.exec(LISTING)  # reads every file: all fetched
        assert a.exit_code == 0, a.stderr
        # and the base's files the upper layer hides (whiteout, opaque dir, replaced dir),
        # read on the base's own mount before the close builds the meta layers: they are in
        # its meta layer, and must stay hidden
        hidden = ["etc/gone", "opq/old0", "opq/old1", "replaced/inside"]
        for p in hidden:
            assert (mounts[0] / p).read_bytes()
    _quiet(node_dir)
    with Sandbox.create("two", store=store, node_dir=node_dir) as full, \
            Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert sb.info().lazy == "passthrough+meta"
        lowers = _lowerdirs(sb)
        metas = [d for d in lowers if "/meta/" in d]
        assert len(metas) == 2, lowers
        for p in hidden:  # in the base's meta layer, below the upper layer's FUSE mount
            assert (Path(metas[1]) / p).is_file()
        # each meta layer sits right above its layer's FUSE mount (topmost first)
        assert lowers[:4] == [metas[0], str(mounts[1]), metas[1], str(mounts[0])], lowers
        before = [_opens(mp) for mp in mounts]
        b, f = sb.exec(LISTING), full.exec(LISTING)
        assert b.exit_code == 0 and f.exit_code == 0, (b.stderr, f.stderr)
        assert b.stdout.decode().splitlines() == f.stdout.decode().splitlines()
        assert b.stdout == a.stdout
        out = b.stdout.decode()
        assert "/etc/gone|" not in out and "/opq/old" not in out  # whiteout, opaque dir
        assert "/replaced|regular file|644|0|0|11|" in out and "/replaced/inside" not in out
        r = sb.exec("cat /etc/gone /opq/old0 /replaced/inside; ls /opq")
        assert r.stdout == b"new\n", r
        for p in hidden[:2] + hidden[3:]:
            assert f"can't open '/{p}'".encode() in r.stderr, r
        assert "/data/small.txt|regular file|640|1000|1000|600|1600000000|2|" in out
        assert "/data/suid|regular file|4755|" in out
        # every file was opened and hashed again: none of those opens reached the daemon
        assert [_opens(mp) for mp in mounts] == before
        r = sb.exec("stat -c %i /data/small.txt /data/hard.txt")
        ino = r.stdout.decode().split()
        assert len(ino) == 2 and ino[0] == ino[1], r  # a hardlink stays one inode
        merged = Path(f"/proc/{sb.host_pid}/root")  # the root, as the sandbox sees it
        assert os.getxattr(merged / "data" / "big.bin", "user.origin") == b"test"
        assert "trusted.overlay.metacopy" not in os.listxattr(merged / "data" / "big.bin")
        assert os.statvfs(merged).f_blocks > 0
        # writes copy the data up into a plain upper dir (no metacopy, no redirect)
        w = sb.exec("chmod 600 /data/small.txt && echo more >> /data/big.bin && "
                    "tail -c 5 /data/big.bin && wc -c < /data/small.txt")
        assert w.exit_code == 0, w.stderr
        assert w.stdout.decode().split() == ["more", "600"]
        for p in ("small.txt", "big.bin"):
            up = sb.paths.upper / "data" / p
            names = os.listxattr(up)
            assert "trusted.overlay.metacopy" not in names, names
            assert "trusted.overlay.redirect" not in names, names
        assert (sb.paths.upper / "data" / "small.txt").read_bytes() == b"small\n" * 100
        from click.testing import CliRunner

        from envbuild.cli.main import cli

        res = CliRunner().invoke(cli, ["node", "ls"], env={"ENVBUILD_NODE_CACHE": str(node_dir)})
        assert res.exit_code == 0, res.output
        assert f"meta {layers[0].digest}  g-" in res.output and "mounted" in res.output


def test_generations_are_built_once_shared_and_pinned(lock2):  # noqa: F811
    store, node_dir, layers = lock2
    node = NodeCache(node_dir / "node")
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert sb.exec("sha256sum /data/small.txt").exit_code == 0
    _quiet(node_dir)
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as one:
        gen = [d for d in _lowerdirs(one) if "/meta/" in d]
        assert len(gen) == 1 and layers[0].digest[7:] in gen[0]  # only the base had a fetch
        built = os.stat(Path(gen[0]).parent).st_ino
        with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as two:
            assert [d for d in _lowerdirs(two) if "/meta/" in d] == gen
            assert os.stat(Path(gen[0]).parent).st_ino == built  # shared, not rebuilt
            # read more: big.bin is fetched (through FUSE), the next create gets a new
            # generation; the running sandboxes keep theirs
            big = two.exec("sha256sum /data/big.bin")
            assert big.exit_code == 0
        _quiet(node_dir)
        with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as three:
            gen3 = [d for d in _lowerdirs(three) if "/meta/" in d]
            assert len(gen3) == 1 and gen3 != gen
            assert os.path.isdir(gen[0])  # the first sandbox still uses the old one
            # the file cache evicts big.bin: the generation's hardlink keeps it readable
            digest = hashlib.sha256((Path(gen3[0]) / "data" / "big.bin").read_bytes()).hexdigest()
            (node_dir / "node" / "files" / digest).unlink()
            assert three.exec("sha256sum /data/big.bin").stdout == big.stdout
            assert one.exec("cat /data/small.txt | wc -l").stdout == b"100\n"
        # the first sandbox still uses the old generation: eviction keeps it
        node.unmount_lazy(keep=[x.digest for x in layers])
        assert os.path.isdir(gen[0]) and os.path.isdir(gen3[0])
    # no mount refers to the old generation any more: removed; the current one stays
    node.unmount_lazy(keep=[x.digest for x in layers])
    assert not os.path.exists(gen[0]) and os.path.isdir(gen3[0])
    node.unmount_lazy(keep=())
    assert not (node_dir / "node" / "meta").exists()


def test_a_create_right_after_a_close_does_not_wait_for_the_build_it_started(lock2):  # noqa: F811
    """The close of a lazy sandbox starts the meta build of what it fetched (and waits for it
    at most ``CLOSE_WAIT`` s); a create while that build still runs takes the generation there
    is (here: none, the FUSE mount alone) at once instead of waiting for it, and the create
    after the build gets the meta layer."""
    import fcntl

    store, node_dir, layers = lock2
    node = NodeCache(node_dir / "node")
    base = layers[0].digest.removeprefix("sha256:")
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as first:
        assert first.exec("sha256sum /data/small.txt /data/big.bin").exit_code == 0
        # the base layer's build cannot finish while we hold its lock (as if it were slow)
        fd = os.open(node.root / "locks" / f"{base}.meta.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        t_close = time.monotonic()
    # the close waited for the build, but a bounded time
    assert time.monotonic() - t_close < metalayer.CLOSE_WAIT + 1.5
    try:
        t0 = time.monotonic()
        with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as second:
            took = time.monotonic() - t0
            lowers = _lowerdirs(second)
            assert not any(base in d for d in lowers if "/meta/" in d), lowers
            assert str(node.lazy_dir(layers[0].digest)) in lowers
            assert second.exec("cat /data/small.txt | wc -l").stdout == b"100\n"
        # the build was running (blocked on the lock) all along: the create did not wait
        assert took < 1.5, took
        assert _building(node_dir) >= 1
    finally:
        os.close(fd)
    _quiet(node_dir)
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as third:
        metas = [d for d in _lowerdirs(third) if "/meta/" in d]
        assert any(base in d for d in metas), metas
        assert third.exec("cat /data/small.txt | wc -l").stdout == b"100\n"


def test_a_close_waits_for_its_build_so_the_next_create_has_the_meta_layer(lock2):  # noqa: F811
    store, node_dir, layers = lock2
    base = layers[0].digest.removeprefix("sha256:")
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as first:
        assert first.exec("cat /data/small.txt /etc/os-release > /dev/null").exit_code == 0
    # no waiting here: the close returned once the build it started was done
    assert _building(node_dir) == 0
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as second:
        assert second.info().lazy == "passthrough+meta"
        metas = [d for d in _lowerdirs(second) if "/meta/" in d]
        assert any(base in d for d in metas), metas
        assert (Path(next(d for d in metas if base in d)) / "data" / "small.txt").is_file()


def test_switched_off_or_on_the_fuse_fallback_there_is_no_meta_layer(lock2, monkeypatch):  # noqa: F811
    store, node_dir, layers = lock2
    node = NodeCache(node_dir / "node")
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert sb.exec("sha256sum /data/small.txt").exit_code == 0
    _quiet(node_dir)
    monkeypatch.setenv(metalayer.ENV_SWITCH, "off")
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert not any("/meta/" in d for d in _lowerdirs(sb))
        mp = node.lazy_dir(layers[0].digest)
        n = _opens(mp)
        assert sb.exec("cat /data/small.txt").exit_code == 0
        assert _opens(mp) > n  # through the daemon, as before
    # the fuse fallback has no file cache: no meta layer either
    node.unmount_lazy(keep=())  # the daemon leaves with its last mount
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "off")
    monkeypatch.delenv(metalayer.ENV_SWITCH)
    for _ in range(2):
        with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb:
            assert sb.info().lazy == "fuse"
            assert sb.exec("sha256sum /data/small.txt").exit_code == 0
            assert not any("/meta/" in d for d in _lowerdirs(sb))
    assert not (node_dir / "node" / "meta").exists()
