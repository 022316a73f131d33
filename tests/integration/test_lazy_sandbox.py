"""Lazy mode over real FUSE + overlayfs + runc: a sandbox whose layers are ``runtime_shim.lazyfs``
mounts served from the store, compared with a sandbox of the same lock over unpacked layers.

What the daemon fetched is read from the daemon itself (``lazy_stats``: its ``LazyStats``,
counted where the ranged reads are made) and cross-checked on disk (the node's chunk cache
stays empty until a file is read). Every test ends with no FUSE mount and no daemon left
(``_no_leftovers``), after ``evict`` — what ``envbuild node gc`` runs.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envbuild.errors import RuntimeShimError
from envbuild.layers import pack_tree
from envbuild.oci import MEDIA_TYPE_CONFIG
from envbuild.plan.lockspec import LockLayer, RuntimeConfig, make_lock, merge_config
from envbuild.store import LocalStore, MemoryStore, open_store, put_file, put_json
from envbuild.store.sync import sync
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.lazyfs import lazy_stats
from runtime_shim.node.nodecache import NodeCache
from runtime_shim.sdk.sandbox import Sandbox, layers_in_use
from tests.conftest import require_root, require_tool
from tests.integration.test_container_runtime import make_busybox_root
from tests.store.s3server import moto_s3, s3_env  # noqa: F401  (fixtures)

BIG = 3 << 20  # a file with frames of its own (lazy framing: >= 16 KiB, cut every 4 MiB)


@pytest.fixture(autouse=True, params=["passthrough", "fuse"])
def lazy_mode(request, monkeypatch):
    """Every test runs on both read paths: FUSE passthrough (required: ``on`` makes a daemon
    that cannot get it exit) and the libfuse fallback, forced by ``$ENVBUILD_LAZY_PASSTHROUGH``
    (the daemons inherit the environment)."""
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH",
                       "on" if request.param == "passthrough" else "off")
    return request.param


def _pack(store, tree: Path, tmp_path: Path, name: str, **kw) -> LockLayer:
    blob = tmp_path / f"{name}.blob"
    with open(blob, "wb") as out:
        info = pack_tree(tree, out, **kw)
    put_file(store, blob)
    return LockLayer(name=name, role="toolkit", key="sha256:" + "0" * 64, digest=info.digest,
                     diff_id=info.diff_id, size=info.size, toc_digest=info.toc_digest)


def _lock(store, name: str, layers: list[LockLayer]) -> str:
    lock = make_lock(name, layers, merge_config([RuntimeConfig()]))
    put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
    digest = put_json(store, lock.manifest).digest
    store.put_ref(f"env/{name}", digest)
    return digest


def _trees(tmp_path: Path) -> tuple[Path, Path]:
    """A busybox base with every kind of member, and an upper layer (packed from an overlayfs
    upper dir) that deletes a file, replaces a directory and makes another one opaque."""
    base = make_busybox_root(tmp_path / "base")
    for applet in ("find", "stat", "sha256sum", "sort", "xargs", "ls", "wc", "head", "readlink"):
        if not (base / "bin" / applet).exists():
            os.symlink("busybox", base / "bin" / applet)
    etc = base / "etc"
    (etc / "os-release").write_text("NAME=lazy\n")
    (etc / "gone").write_text("deleted by the upper layer\n")
    (base / "data").mkdir()
    (base / "data" / "big.bin").write_bytes(os.urandom(BIG))
    (base / "data" / "small.txt").write_text("small\n" * 100)
    (base / "data" / "empty").write_bytes(b"")
    os.link(base / "data" / "small.txt", base / "data" / "hard.txt")
    os.symlink("../data/small.txt", base / "data" / "link")
    os.chmod(base / "data" / "small.txt", 0o640)
    os.chown(base / "data" / "small.txt", 1000, 1000)
    (base / "data" / "suid").write_text("#!/bin/sh\n")
    os.chmod(base / "data" / "suid", 0o4755)
    os.setxattr(base / "data" / "big.bin", "user.origin", b"test")
    os.mkfifo(base / "data" / "fifo")
    (base / "data" / "deep" / "er").mkdir(parents=True)
    (base / "data" / "deep" / "er" / "f").write_text("deep\n")
    (base / "opq").mkdir()
    for i in range(3):
        (base / "opq" / f"old{i}").write_text(f"old {i}\n")
    (base / "replaced").mkdir()
    (base / "replaced" / "inside").write_text("x\n")
    for p in (base / "data" / "small.txt", base / "etc" / "os-release"):
        os.utime(p, (1_600_000_000, 1_600_000_000))
    upper = tmp_path / "upper"
    (upper / "etc").mkdir(parents=True)
    os.mknod(upper / "etc" / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))
    (upper / "opq").mkdir()
    os.setxattr(upper / "opq", "trusted.overlay.opaque", b"y")
    (upper / "opq" / "new").write_text("new\n")
    (upper / "replaced").write_text("now a file\n")
    (upper / "etc" / "added").write_text("from the upper layer\n")
    return base, upper


def two_layer_store(tmp_path: Path) -> tuple[LocalStore, list[LockLayer]]:
    """A local store with the two-layer lock ``two`` of ``_trees`` (every kind of member,
    whiteouts, an opaque dir, hardlinks, xattrs), and its layers: what the ``lock2`` fixtures
    (here, FUSE; test_lazy_native.py, native) stand on."""
    require_root()
    require_tool("runc")
    store = LocalStore(tmp_path / "store")
    base_tree, upper_tree = _trees(tmp_path)
    base = _pack(store, base_tree, tmp_path, "base", source_date_epoch=1_700_000_000)
    upper = _pack(store, upper_tree, tmp_path, "upper", overlay_upper=True,
                  source_date_epoch=1_700_000_000)
    _lock(store, "two", [base, upper])
    return store, [base, upper]


@pytest.fixture
def lock2(tmp_path):
    """``two_layer_store`` and a node dir; afterwards no FUSE mount and no daemon left."""
    require_tool("fusermount3")
    store, layers = two_layer_store(tmp_path)
    node_dir = tmp_path / "n"
    yield store, node_dir, layers
    _no_leftovers(node_dir)


def _no_leftovers(node_dir: Path) -> None:
    """After ``node gc``'s eviction: no sandbox, FUSE mount or lazyfs daemon of this node."""
    from runtime_shim.sdk.sandbox import gc_sandboxes

    gc_sandboxes(node_dir)
    NodeCache(node_dir / "node").evict(layers_in_use(node_dir), 0)
    assert mounted_targets_under(str(node_dir)) == []
    deadline = time.monotonic() + 5
    while _daemons(node_dir) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _daemons(node_dir) == []


def _daemons(node_dir: Path) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"runtime_shim.lazyfs" in cmd and os.fsencode(str(node_dir)) in cmd:
            found.append(int(d.name))
    return found


def _settled(mountpoint: Path) -> dict:
    """The daemon's stats once its background readahead has stopped fetching."""
    last = lazy_stats(mountpoint)
    for _ in range(100):
        time.sleep(0.1)
        now = lazy_stats(mountpoint)
        if now == last:
            return now
        last = now
    return last


def _pieces(node_dir: Path) -> int:
    """What the node holds on disk of fetched contents: verified pieces (the fuse fallback's
    chunk cache) and whole files (passthrough's file cache)."""
    chunks = node_dir / "node" / "chunks"
    files = node_dir / "node" / "files"
    n = sum(1 for sub in chunks.iterdir() if sub.is_dir() for _ in sub.iterdir()) \
        if chunks.is_dir() else 0
    return n + (sum(1 for f in files.iterdir() if not f.name.startswith("."))
                if files.is_dir() else 0)


LISTING = ("find / -xdev ! -path '/.envbuild*' ! -path '/proc*' ! -path '/sys*' "
           "! -path '/dev*' ! -path '/run*' ! -path '/tmp*' | sort | while read -r f; do "
           "if [ -d \"$f\" ] && [ ! -L \"$f\" ]; then stat -c '%n|%F|%a|%u|%g' \"$f\"; "
           "else stat -c '%n|%F|%a|%u|%g|%s|%Y|%h|%t,%T' \"$f\"; fi; done; "
           "find / -xdev -type f ! -path '/.envbuild*' ! -path '/proc*' ! -path '/sys*' "
           "| sort | xargs sha256sum; readlink /data/link; ls /opq")


def test_lazy_and_full_sandboxes_see_the_same_tree(lock2, lazy_mode):
    store, node_dir, layers = lock2
    with Sandbox.create("two", store=store, node_dir=node_dir) as full, \
            Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as lazy:
        assert full.info().lazy == "" and lazy.info().lazy == lazy_mode
        a, b = full.exec(LISTING), lazy.exec(LISTING)
        assert a.exit_code == 0, a.stderr
        assert b.exit_code == 0, b.stderr
        assert a.stdout.decode().splitlines() == b.stdout.decode().splitlines()
        out = b.stdout.decode()
        # the upper layer's whiteout, opaque dir and replacement are honoured
        assert "/etc/gone|" not in out and "/opq/old0" not in out
        assert "/opq/new|regular file|644" in out
        assert "/replaced|regular file|644|0|0|11|" in out and "/replaced/inside" not in out
        # the base's members, with their metadata
        assert "/data/small.txt|regular file|640|1000|1000|600|1600000000|2|" in out
        assert "/data/suid|regular file|4755|" in out
        assert "/data/fifo|fifo|" in out
        assert "/data/link|symbolic link|777|" in out
        assert hashlib.sha256(b"small\n" * 100).hexdigest() + "  /data/hard.txt" in out
        mp = NodeCache(node_dir / "node").lazy_dir(layers[0].digest)
        assert os.getxattr(mp / "data" / "big.bin", "user.origin") == b"test"
        ino = os.stat(mp / "data" / "small.txt").st_ino
        assert os.stat(mp / "data" / "hard.txt").st_ino == ino
        assert os.stat(mp / "data" / "small.txt").st_nlink == 2
        st = os.statvfs(mp)
        assert st.f_blocks * st.f_frsize >= BIG and st.f_flag & os.ST_RDONLY
        stats = lazy_stats(mp)
        if lazy_mode == "passthrough":  # every file the listing hashed: read by the kernel
            assert stats["mode"] == "passthrough" and stats["passthrough_opens"] >= 3, stats
            assert stats["userspace_reads"] == 0, stats
        else:
            assert stats["mode"] == "fuse", stats


def test_starts_before_contents_are_fetched_and_shares_the_mounts(lock2):
    store, node_dir, layers = lock2
    node = NodeCache(node_dir / "node")
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb:
        mounts = [node.lazy_dir(layer.digest) for layer in layers]
        before = [lazy_stats(mp) for mp in mounts]
        for s in before:  # footer + TOC only
            assert s["frames_fetched"] == 0 and s["files_verified"] == 0, s
            assert s["bytes_fetched"] == s["toc_bytes"] > 0
        assert _pieces(node_dir) == 0
        r = sb.exec("sha256sum /data/big.bin")
        assert r.exit_code == 0, r.stderr
        base = _settled(mounts[0])  # directory readahead runs in the background
        assert base["files_verified"] >= 2  # busybox and big.bin
        assert base["bytes_fetched"] >= BIG * 0.9  # random bytes do not compress
        assert _pieces(node_dir) > 0
        # a second sandbox shares the daemons, their chunk cache and the page cache: its
        # start and the same read fetch nothing more
        with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb2:
            assert [lazy_stats(mp)["pid"] for mp in mounts] == [s["pid"] for s in before]
            assert sb2.exec("sha256sum /data/big.bin").stdout == r.stdout
            assert lazy_stats(mounts[0])["requests"] == base["requests"]


def test_writes_go_to_the_sandbox_upper_dir(lock2):
    store, node_dir, layers = lock2
    node = NodeCache(node_dir / "node")
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb:
        r = sb.exec("echo new > /etc/new && echo more >> /data/small.txt && rm /etc/added "
                    "&& rm -r /data/deep && cat /data/small.txt | wc -l")
        assert r.exit_code == 0, r.stderr
        assert r.stdout == b"101\n"
        upper = sb.paths.upper
        assert (upper / "etc" / "new").read_text() == "new\n"
        assert (upper / "data" / "small.txt").read_text().endswith("small\nmore\n")
        st = os.lstat(upper / "etc" / "added")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0  # overlay whiteout
        base_mp = node.lazy_dir(layers[0].digest)
        assert (base_mp / "data" / "small.txt").read_text() == "small\n" * 100
        assert (base_mp / "data" / "deep" / "er" / "f").exists()
        with pytest.raises(OSError):
            (base_mp / "etc" / "x").write_text("no")
        with pytest.raises(OSError):
            os.unlink(base_mp / "etc" / "os-release")


def test_ensure_lazy_is_idempotent_and_replaces_a_dead_daemon(lock2):
    store, node_dir, layers = lock2
    node = NodeCache(node_dir / "node")
    layer = layers[0]
    url = str(store.root)
    mp = node.ensure_lazy(url, layer.digest, layer.toc_digest)
    pid = lazy_stats(mp)["pid"]
    assert node.ensure_lazy(url, layer.digest, layer.toc_digest) == mp
    assert lazy_stats(mp)["pid"] == pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pid in _daemons(node_dir) and time.monotonic() < deadline:
        time.sleep(0.01)
    # ENOTCONN: the stale mount, once the daemon's metadata server followed it (at once:
    # its control socket closed; a bounded wait, not a hang)
    while time.monotonic() < deadline:
        try:
            os.statvfs(mp)
        except OSError:
            break
        time.sleep(0.01)
    with pytest.raises(OSError):
        os.statvfs(mp)
    assert node.ensure_lazy(url, layer.digest, layer.toc_digest) == mp
    new_pid = lazy_stats(mp)["pid"]
    assert new_pid != pid
    assert (mp / "etc" / "os-release").read_text() == "NAME=lazy\n"
    assert mounted_targets_under(str(mp)) == [str(mp)]  # the stale mount is gone, not stacked
    assert node.unmount_lazy(keep=()) == [layer.digest]
    assert mounted_targets_under(str(node_dir)) == []


def test_node_gc_unmounts_the_stale_mount_of_a_dead_daemon(tmp_path):
    """``envbuild node gc`` (``evict``) right after the daemon died: its mounts answer ENOTCONN
    to every stat, and the node's listing must not stat them (the soak found ``list_lazy``
    failing there with a traceback). The dead mount is a real FUSE mount whose connection is
    closed before it answered anything, as a daemon killed mid-mount leaves it."""
    require_root()
    from runtime_shim.lazyfs.passthrough import _Conn

    node = NodeCache(tmp_path / "node")
    digest = "sha256:" + "ab" * 32
    mp = node.lazy_dir(digest)
    mp.mkdir(parents=True)
    os.close(_Conn(str(mp), "envbuild-lazy-dead").fd)
    with pytest.raises(OSError) as dead:
        os.stat(mp)
    assert dead.value.errno == errno.ENOTCONN
    assert node.evict([], 0) == [digest]
    assert mounted_targets_under(str(tmp_path)) == []


def test_node_gc_removes_the_probe_mount_of_a_daemon_killed_while_it_probed(tmp_path):
    """A daemon probes the kernel for FUSE passthrough on a scratch mount ``lazy/.probe-PID``
    when it starts; killed then (the soak), it left the mount. ``evict`` removes it."""
    require_root()
    from runtime_shim.lazyfs.passthrough import _Conn

    node = NodeCache(tmp_path / "node")
    gone = subprocess.Popen(["true"])
    gone.wait()
    probe = node.root / "lazy" / f".probe-{gone.pid}"
    probe.mkdir(parents=True)
    os.close(_Conn(str(probe), "envbuild-lazy-probe").fd)
    node.evict([], 0)
    assert mounted_targets_under(str(tmp_path)) == []
    assert not probe.exists()


def test_a_store_that_is_away_is_never_made_anew_by_the_daemon(lock2, tmp_path):
    """The soak moved the store away for two seconds: a lazy mount asked meanwhile made an
    empty store in its place (the daemon opened the store as a writer would), and moving the
    real one back failed. A reader never creates a store."""
    store, node_dir, layers = lock2
    node = NodeCache(node_dir / "node")
    away = tmp_path / "away"
    with pytest.raises(RuntimeShimError, match="cannot serve it") as e:
        node.ensure_lazy(str(away), layers[0].digest, layers[0].toc_digest)
    assert "no store at" in (e.value.context or ""), e.value.context
    assert not away.exists()
    node.unmount_lazy(keep=())


def test_a_daemon_that_cannot_serve_is_a_clear_error(lock2):
    store, node_dir, layers = lock2
    node = NodeCache(node_dir / "node")
    with pytest.raises(RuntimeShimError) as err:
        node.ensure_lazy(str(store.root), layers[0].digest, "sha256:" + "1" * 64)
    assert "the FUSE daemon cannot serve it" in err.value.message
    assert "TOC" in (err.value.context or "")
    assert mounted_targets_under(str(node_dir)) == []
    memory = MemoryStore()
    sync(store, memory, refs=["env/two"])
    with pytest.raises(RuntimeShimError, match="cannot serve layers"):
        Sandbox.create("two", store=memory, node_dir=node_dir, lazy="fuse")


def test_lazy_sandbox_from_s3(s3_env, tmp_path):  # noqa: F811  (fixture)
    require_root()
    require_tool("runc")
    require_tool("fusermount3")
    bucket = s3_env.make_bucket()
    store = open_store(f"s3://{bucket}/lazy")
    base_tree, upper_tree = _trees(tmp_path)
    base = _pack(store, base_tree, tmp_path, "base")
    upper = _pack(store, upper_tree, tmp_path, "upper", overlay_upper=True)
    _lock(store, "two", [base, upper])
    node_dir = tmp_path / "n"
    try:
        with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb:
            mp = NodeCache(node_dir / "node").lazy_dir(base.digest)
            assert lazy_stats(mp)["frames_fetched"] == 0
            r = sb.exec("cat /etc/os-release; ls /opq; test -e /etc/gone || echo gone; "
                        "sha256sum /data/big.bin")
            assert r.exit_code == 0, r.stderr
            want = hashlib.sha256((base_tree / "data" / "big.bin").read_bytes()).hexdigest()
            assert r.stdout.decode() == f"NAME=lazy\nnew\ngone\n{want}  /data/big.bin\n"
            assert lazy_stats(mp)["frames_fetched"] > 0
    finally:
        _no_leftovers(node_dir)


def test_the_daemon_runs_as_a_module(tmp_path):
    """``python -m runtime_shim.lazyfs --help`` works from anywhere (the daemon's entry)."""
    proc = subprocess.run([sys.executable, "-m", "runtime_shim.lazyfs", "--help"], cwd="/",
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert proc.returncode == 0 and "--mountpoint" in proc.stdout



def test_a_lazy_profile_is_recorded_then_prefetched(lock2, tmp_path):
    """The first lazy run of a stack records which files it read (saved when its mounts go);
    a cold node then prefetches them from the mount on, before any command reads them."""
    from runtime_shim.lazyfs import PROFILE_NAMESPACE, profile_key, read_profile

    store, node_dir, layers = lock2
    digests = [x.digest for x in layers]
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="fuse") as sb:
        assert sb.exec("cat /data/small.txt /etc/added >/dev/null").exit_code == 0
    NodeCache(node_dir / "node").evict((), 0)  # unmounting saves the profile
    assert store.list_records(PROFILE_NAMESPACE) == [profile_key(digests)]
    profile = read_profile(store, digests)
    # small.txt and hard.txt are one inode, read under the TOC's first name
    assert {"data/small.txt", "data/hard.txt"} & set(profile[digests[0]])
    assert "bin/busybox" in profile[digests[0]]
    assert profile[digests[1]] == ["etc/added"]
    other = tmp_path / "n2"
    try:
        with Sandbox.create("two", store=store, node_dir=other, lazy="fuse") as sb:
            mp = NodeCache(other / "node").lazy_dir(digests[0])
            stats = _settled(mp)
            assert stats["files_verified"] >= 2 and stats["frames_fetched"] > 0
            # reads of a stack that has a profile are not saved over it
            assert sb.exec("cat /etc/os-release /etc/added >/dev/null").exit_code == 0
        NodeCache(other / "node").evict((), 0)
        assert read_profile(store, digests) == profile
    finally:
        _no_leftovers(other)
