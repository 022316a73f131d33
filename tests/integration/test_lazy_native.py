"""Native lazy layers over the real kernel: metadata trees in overlays over the node's object
store, filled by the fanotify filler (``runtime_shim.lazyfs.native``), in real runc sandboxes,
compared with sandboxes over unpacked layers."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from pathlib import Path

import pytest

from envbuild.store import LocalStore
from runtime_shim.isolation.mount import mounted_targets_under, unmount
from runtime_shim.lazyfs import native
from runtime_shim.lazyfs.objects import ObjectStore
from runtime_shim.node.nodecache import NodeCache
from runtime_shim.sdk.sandbox import Sandbox, gc_sandboxes, layers_in_use
from tests.conftest import require_root, require_tool
from tests.lazy_layers import BIG, LISTING, make_env, member_trees, pack_layer, two_layer_store
from tests.store.s3server import moto_s3, s3_env  # noqa: F401  (fixtures)


@pytest.fixture
def lock2(tmp_path, node_dir):
    """``two_layer_store`` and ``node_dir`` (whose teardown checks that nothing is left)."""
    store, layers = two_layer_store(tmp_path)
    return store, node_dir, layers


def test_native_and_full_sandboxes_see_the_same_tree(lock2):
    """``lazy=True`` is the native filler: whiteouts, opaque dirs, replacements, modes,
    owners, hardlinks (nlink 2), fifos, symlinks and xattrs as a full pull's."""
    store, node_dir, layers = lock2
    with Sandbox.create("two", store=store, node_dir=node_dir) as full, \
            Sandbox.create("two", store=store, node_dir=node_dir, lazy=True) as lazy:
        assert full.info().lazy == "" and lazy.info().lazy == "native"
        objects = ObjectStore(node_dir / "node")
        big = objects.path(hashlib.sha256(
            (node_dir.parent / "base" / "data" / "big.bin").read_bytes()).hexdigest())
        assert not objects.complete(os.path.basename(big))   # nothing fetched yet
        a, b = full.exec(LISTING), lazy.exec(LISTING)
        assert a.exit_code == 0, a.stderr
        assert b.exit_code == 0, b.stderr
        assert a.stdout.decode().splitlines() == b.stdout.decode().splitlines()
        out = b.stdout.decode()
        assert "/etc/gone|" not in out and "/opq/old0" not in out
        assert "/opq/new|regular file|644" in out
        assert "/replaced|regular file|644|0|0|11|" in out and "/replaced/inside" not in out
        assert "/data/small.txt|regular file|640|1000|1000|600|1600000000|2|" in out
        assert "/data/fifo|fifo|" in out and "/data/link|symbolic link|777|" in out
        assert objects.complete(os.path.basename(big)) and os.stat(big).st_size == BIG
        x = lazy.exec("getfattr -n user.origin /data/big.bin 2>&1 || "
                      "busybox getfattr -n user.origin /data/big.bin 2>&1; true")
        mnt = native.nativetree.mount_dir(str(node_dir / "node"), layers[0].digest[7:])
        assert os.getxattr(Path(mnt) / "data" / "big.bin", "user.origin") == b"test", x


def test_writes_go_to_the_sandbox_upper_dir_and_the_layer_stays_read_only(lock2):
    """Ported from the FUSE suite: a lazy sandbox's writes, appends, deletes (whiteouts) and
    removed dirs land in its upper dir; the native layer's mount is unchanged and read-only."""
    store, node_dir, layers = lock2
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy=True) as sb:
        assert sb.info().lazy == "native"
        r = sb.exec("echo new > /etc/new && echo more >> /data/small.txt && rm /etc/added "
                    "&& rm -r /data/deep && cat /data/small.txt | wc -l")
        assert r.exit_code == 0, r.stderr
        assert r.stdout == b"101\n"
        upper = sb.paths.upper
        assert (upper / "etc" / "new").read_text() == "new\n"
        assert (upper / "data" / "small.txt").read_text().endswith("small\nmore\n")
        st = os.lstat(upper / "etc" / "added")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0  # overlay whiteout
        base_mp = Path(native.nativetree.mount_dir(str(node_dir / "node"), layers[0].digest[7:]))
        assert (base_mp / "data" / "small.txt").read_text() == "small\n" * 100
        assert (base_mp / "data" / "deep" / "er" / "f").exists()
        with pytest.raises(OSError):
            (base_mp / "etc" / "x").write_text("no")
        with pytest.raises(OSError):
            os.unlink(base_mp / "etc" / "os-release")


def _env(tmp_path: Path, name: str, extra: dict[str, bytes], store=None):
    """A store with lock ``name``: a busybox layer, and a layer holding ``extra``."""
    from tests.integration.test_container_runtime import make_busybox_root

    require_root()
    require_tool("runc")
    store = store or LocalStore(tmp_path / "store")
    base = make_busybox_root(tmp_path / f"{name}-base")
    (base / "bin" / "sha256sum").exists() or os.symlink("busybox", base / "bin" / "sha256sum")
    top = tmp_path / f"{name}-top"
    for rel, data in extra.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(data)
    layers = [pack_layer(store, base, tmp_path, f"{name}-base", source_date_epoch=1_700_000_000),
              pack_layer(store, top, tmp_path, f"{name}-top", source_date_epoch=1_700_000_000)]
    make_env(store, name, layers)
    return store, layers


@pytest.fixture
def node_dir(tmp_path):
    """A test's node dir; afterwards no sandbox, no mount (the native ones and the tree
    tmpfs) and no filler left, after what `node gc` runs."""
    node_dir = tmp_path / "n"
    yield node_dir
    gc_sandboxes(node_dir)   # the native mounts go, then the filler
    NodeCache(node_dir / "node").evict(layers_in_use(node_dir), 0)
    assert mounted_targets_under(str(node_dir)) == []
    assert native.filler_request(str(node_dir / "node"), {"op": "ping"}, 1.0) is None


def _filler_log(node_dir: Path) -> str:
    return (node_dir / "node" / "objects" / "filler.log").read_text()


def test_a_corrupt_blob_is_an_io_error_and_a_log_line_never_zeros(tmp_path, node_dir):
    from envbuild.layers import LayerReader

    data = os.urandom(1 << 20)
    store, layers = _env(tmp_path, "bad", {"data/f.bin": data})
    blob = store.blob_path(layers[1].digest)
    with LayerReader.open_file(blob) as r:
        chunk = r.stat("data/f.bin").chunks[0]
    raw = bytearray(blob.read_bytes())
    raw[chunk.offset + chunk.csize // 2] ^= 0xFF
    os.chmod(blob, 0o644)
    blob.write_bytes(bytes(raw))
    with Sandbox.create("bad", store=store, node_dir=node_dir, lazy="native") as sb:
        got = sb.exec("sha256sum /data/f.bin; echo rc=$?")
        out = got.stdout.decode() + got.stderr.decode()
        assert hashlib.sha256(bytes(len(data))).hexdigest() not in out   # not zeros
        assert hashlib.sha256(data).hexdigest() not in out
        assert "Input/output error" in out and "rc=1" in out, out
        # and again: still an error (the mark stays), not a hole
        got = sb.exec("head -c 100 /data/f.bin | wc -c; echo rc=$?")
        assert "Input/output error" in got.stdout.decode() + got.stderr.decode()
    assert "readers get EIO" in _filler_log(node_dir)


def test_execve_and_mmap_of_lazily_filled_files(tmp_path, node_dir):
    import mmap

    data = os.urandom(300_000)
    store, layers = _env(tmp_path, "mm", {"data/m.bin": data})
    with Sandbox.create("mm", store=store, node_dir=node_dir, lazy="native") as sb:
        # busybox itself is an unfilled placeholder: the loader's reads and mmaps fill it
        got = sb.exec("echo hello")
        assert got.exit_code == 0 and got.stdout == b"hello\n", got.stderr
        mnt = Path(native.nativetree.mount_dir(str(node_dir / "node"), layers[1].digest[7:]))
        with open(mnt / "data" / "m.bin", "rb") as f, \
                mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            assert m[:] == data
        got = sb.exec("sha256sum /data/m.bin")
        assert got.stdout.decode().split()[0] == hashlib.sha256(data).hexdigest()


def test_two_layers_sharing_a_file_share_one_object(tmp_path, node_dir):
    shared = os.urandom(200_000)
    store, a = _env(tmp_path, "one", {"lib/shared.so": shared, "a": b"a"})
    _, b = _env(tmp_path, "other", {"usr/lib/copy.so": shared, "b": b"b"}, store=store)
    hexd = hashlib.sha256(shared).hexdigest()
    root = str(node_dir / "node")
    with Sandbox.create("one", store=store, node_dir=node_dir, lazy="native") as s1, \
            Sandbox.create("other", store=store, node_dir=node_dir, lazy="native") as s2:
        assert s1.exec("sha256sum /lib/shared.so").stdout.decode().split()[0] == hexd
        fills = native.filler_request(root, {"op": "ping"})["fills"]
        assert s2.exec("sha256sum /usr/lib/copy.so").stdout.decode().split()[0] == hexd
        assert native.filler_request(root, {"op": "ping"})["fills"] == fills  # no new fill
        trees = [native.nativetree.tree_dir(root, x[1].digest[7:]) for x in (a, b)]
        assert os.getxattr(trees[0] + "/lib/shared.so", "trusted.overlay.redirect") == \
            os.getxattr(trees[1] + "/usr/lib/copy.so", "trusted.overlay.redirect") == \
            b"/" + hexd.encode()
        objs = ObjectStore(root)
        assert objs.complete(hexd) and os.stat(objs.path(hexd)).st_nlink == 1


@pytest.mark.parametrize("phase", ["fetch", "copy"])
def test_a_filler_killed_mid_fill_is_correct_or_eio_never_wrong_and_resumes(
        tmp_path, node_dir, phase):
    """SIGKILL the filler (its worker) while a ``sha256sum`` of a large file waits for its
    fill — while the fill fetches (its spool exists) or while it copies into the object —:
    the reader gets the right digest or EIO, never another digest; a new worker resumes."""
    import signal
    import threading

    data = os.urandom(96 << 20)
    want = hashlib.sha256(data).hexdigest()
    store, _ = _env(tmp_path, "big", {"data/huge": data})
    del data
    root = str(node_dir / "node")
    objects = ObjectStore(root)
    with Sandbox.create("big", store=store, node_dir=node_dir, lazy="native") as sb:
        sb.exec("true")
        worker = native.filler_request(root, {"op": "ping"})["pid"]
        result: list = []
        t = threading.Thread(target=lambda: result.append(
            sb.exec("sha256sum /data/huge; echo rc=$?")))
        t.start()
        killed = False
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline and t.is_alive():
            if phase == "fetch":
                busy = any(n.startswith("fill-") for n in os.listdir(objects.root + "/tmp"))
            else:
                busy = os.path.exists(objects.path(want)) and \
                    os.stat(objects.path(want)).st_size > 0 and not objects.complete(want)
            if busy:
                os.kill(worker, signal.SIGKILL)
                killed = True
            time.sleep(0.0005)
        t.join(120)
        assert killed, f"the fill was never seen in its {phase} phase"
        out = result[0].stdout.decode() + result[0].stderr.decode()
        assert (want in out and "rc=0" in out) or \
            ("Input/output error" in out and "rc=1" in out), out
        got = sb.exec("sha256sum /data/huge")   # a new worker resumes the fill
        assert got.exit_code == 0 and got.stdout.decode().split()[0] == want, got.stderr
        assert native.filler_request(root, {"op": "ping"})["pid"] != worker
        assert objects.complete(want) and os.stat(objects.path(want)).st_size == 96 << 20


def test_envbuild_run_lazy_of_the_busybox_env_is_native_node_ls_and_gc(envbuild_cli):
    """``envbuild run --lazy`` is the native filler (``--lazy-native``: the same, strict)."""
    assert envbuild_cli("build").code == 0
    result = envbuild_cli("run", "--lazy", "busybox-shell", "sh", "-c",
                          "cat /etc/hostname >/dev/null; ls /bin | wc -l; echo ok")
    assert result.code == 0, result.err
    assert result.out.endswith("ok\n")
    node_dir = envbuild_cli.node
    assert mounted_targets_under(str(node_dir / "node" / "native")) != []  # shared, kept up
    ls = envbuild_cli("node", "ls")
    assert ls.code == 0 and "native filler pid" in ls.out, ls.out + ls.err
    gc = envbuild_cli("node", "gc")
    assert gc.code == 0, gc.err
    assert mounted_targets_under(str(node_dir / "node" / "native")) == []
    assert native.filler_request(str(node_dir / "node"), {"op": "ping"}, 1.0) is None
    assert mounted_targets_under(str(node_dir)) == []   # the tree tmpfs too


def test_only_root_talks_to_the_filler(tmp_path, node_dir):
    """The socket is in a 0700 root dir; and were it reachable, the filler answers only uid 0."""
    import shutil
    import subprocess
    import tempfile

    root = str(node_dir / "node")
    os.makedirs(root)
    native.ensure_filler(root)
    sock = os.path.join(root, "objects", "filler.sock")
    probe = ("import socket,sys\ns=socket.socket(socket.AF_UNIX)\n"
             "try:\n s.connect(sys.argv[1])\nexcept OSError as e:\n print('refused', e.errno)\n"
             " sys.exit()\ntry:\n s.sendall(b'{\"op\": \"ping\"}\\n')\n"
             " print('reply', repr(s.recv(100)))\n"
             "except (BrokenPipeError, ConnectionError):\n print('hung up')\n")

    def as_nobody(path: str) -> str:
        return subprocess.run(["/usr/bin/python3", "-c", probe, path], user=65534, group=65534,
                              capture_output=True, text=True, timeout=30).stdout.strip()
    assert as_nobody(sock) == "refused 13"   # EACCES: the dir is root's alone
    # were the socket reachable (a hardlink in a dir anyone may enter), the filler hangs up on
    # any uid but 0 without reading the request
    open_dir = tempfile.mkdtemp(dir="/tmp")
    try:
        os.chmod(open_dir, 0o755)
        os.link(sock, os.path.join(open_dir, "s"))
        os.chmod(sock, 0o666)
        assert as_nobody(os.path.join(open_dir, "s")) in ("reply b''", "hung up")
    finally:
        os.chmod(sock, 0o600)
        shutil.rmtree(open_dir)
    assert native.filler_request(root, {"op": "ping"})["ok"]


def test_an_object_store_of_another_user_is_refused(tmp_path, node_dir):
    from envbuild.errors import RuntimeShimError

    root = node_dir / "node"
    (root / "objects").mkdir(parents=True)
    os.chown(root / "objects", 65534, 65534)
    with pytest.raises(RuntimeShimError, match="not a directory of root's"):
        native.ensure_filler(str(root))
    os.rmdir(root / "objects")
    os.symlink("/tmp", root / "objects")
    with pytest.raises(RuntimeShimError, match="not a directory of root's"):
        native.ensure_filler(str(root))
    os.unlink(root / "objects")


def test_a_killed_holder_leaves_the_worker_serving(tmp_path, node_dir):
    """SIGTERM does not stop a holder while native layers are mounted; SIGKILLed, the group
    outlives it while the worker holds it: reads still get filled."""
    import signal

    data = os.urandom(500_000)
    store, _ = _env(tmp_path, "hold", {"data/a": data, "data/b": data[::-1]})
    root = str(node_dir / "node")
    with Sandbox.create("hold", store=store, node_dir=node_dir, lazy="native") as sb:
        assert sb.exec("sha256sum /data/a").stdout.decode().split()[0] == \
            hashlib.sha256(data).hexdigest()
        ping = native.filler_request(root, {"op": "ping"})
        holder = Path(f"/proc/{ping['holder']}")
        os.kill(ping["holder"], signal.SIGTERM)   # ignored: a native layer is mounted
        time.sleep(0.3)
        again = native.filler_request(root, {"op": "ping"})
        assert holder.exists() and (again["pid"], again["holder"]) == (ping["pid"], ping["holder"])
        os.kill(ping["holder"], signal.SIGKILL)
        got = sb.exec("sha256sum /data/b")
        assert got.stdout.decode().split()[0] == hashlib.sha256(data[::-1]).hexdigest()
        assert native.filler_request(root, {"op": "ping"})["pid"] == ping["pid"]


def test_pack_diff_of_a_native_sandbox(tmp_path, node_dir):
    """Copy-ups out of native layers (a lazily filled file appended to, a metadata-only
    change, a deletion) make the same snapshot a full sandbox's would; the snapshot runs
    natively and in full."""
    body = os.urandom(100_000)
    store, _ = _env(tmp_path, "pd", {"data/keep.bin": body, "data/grow.txt": b"one\n",
                                     "data/gone.txt": b"bye\n", "data/mode.sh": b"#!/bin/sh\n"})
    change = "echo two >> /data/grow.txt && rm /data/gone.txt && chmod 755 /data/mode.sh"
    check = ("cat /data/grow.txt; ls /data; stat -c '%a' /data/mode.sh; "
             "sha256sum /data/keep.bin")
    with Sandbox.create("pd", store=store, node_dir=node_dir, lazy="native") as sb:
        assert sb.exec(change).exit_code == 0
        want = sb.exec(check).stdout.decode()
        sb.pack_diff("snap/pd")
    assert want.startswith("one\ntwo\n") and "gone.txt" not in want and "\n755\n" in want
    assert hashlib.sha256(body).hexdigest() in want
    with Sandbox.create("snap/pd", store=store, node_dir=node_dir) as full, \
            Sandbox.create("snap/pd", store=store, node_dir=node_dir, lazy="native") as lazy:
        assert full.exec(check).stdout.decode() == want
        assert lazy.exec(check).stdout.decode() == want


def test_a_checkpointable_native_sandbox_is_refused_in_one_line(tmp_path, node_dir):
    """CRIU cannot dump a process that maps a file of a native layer (``Can't lookup mount=N
    for fd=-3 path=/bin/busybox``): asked for, it is refused before anything is made."""
    from envbuild.errors import RuntimeShimError

    store, _ = _env(tmp_path, "ck", {"data/seed": b"7\n"})
    with pytest.raises(RuntimeShimError, match="cannot be checkpointed") as err:
        Sandbox.create("ck", store=store, node_dir=node_dir, lazy="native",
                       checkpointable=True)
    assert "lazy=False" in (err.value.hint or "")
    assert not (node_dir / "node" / "native").exists()


def test_an_open_fills_the_files_after_it_in_the_blob(tmp_path, node_dir):
    """One open fills its file and the unfilled files that follow it within the miss window
    (one ranged read, each verified); a file past the window stays a placeholder."""
    files = {f"pkg/m{i:02}.py": os.urandom(2000) for i in range(20)}
    files["zz/far.bin"] = os.urandom(3 << 20)   # over WINDOW_MAX_FILE: ends the window
    files["zzz/after.py"] = os.urandom(2000)
    store, _ = _env(tmp_path, "win", files)
    root = str(node_dir / "node")
    objects = ObjectStore(root)

    def complete(rel: str) -> bool:
        return objects.complete(hashlib.sha256(files[rel]).hexdigest())
    with Sandbox.create("win", store=store, node_dir=node_dir, lazy="native") as sb:
        assert sb.exec("cat /pkg/m00.py >/dev/null").exit_code == 0
        deadline = time.monotonic() + 10
        while not complete("pkg/m19.py") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(complete(f"pkg/m{i:02}.py") for i in range(20))
        assert not complete("zz/far.bin") and not complete("zzz/after.py")
        ping = native.filler_request(root, {"op": "ping"})
        assert ping["ahead"] >= 19
        # its writes go through its own mount, which an ignore mark covers: no event each
        assert ping["own_events"] == 0, ping
        got = sb.exec("cat /pkg/m07.py | sha256sum").stdout.decode().split()[0]
        assert got == hashlib.sha256(files["pkg/m07.py"]).hexdigest()


def test_a_native_sandbox_from_s3(s3_env, tmp_path, node_dir):  # noqa: F811  (fixture)
    """The filler reads an S3 store's blobs over the presigned URLs a create hands it (plain
    HTTP: boto3 is never loaded in it) and fills from ranged GETs."""
    from envbuild.store import open_store

    require_root()
    require_tool("runc")
    store = open_store(f"s3://{s3_env.make_bucket()}/native")
    base_tree, upper_tree = member_trees(tmp_path)
    base = pack_layer(store, base_tree, tmp_path, "base")
    upper = pack_layer(store, upper_tree, tmp_path, "upper", overlay_upper=True)
    make_env(store, "two", [base, upper])
    with Sandbox.create("two", store=store, node_dir=node_dir, lazy="native") as sb:
        r = sb.exec("cat /etc/os-release; ls /opq; test -e /etc/gone || echo gone; "
                    "sha256sum /data/big.bin")
        assert r.exit_code == 0, r.stderr
        want = hashlib.sha256((base_tree / "data" / "big.bin").read_bytes()).hexdigest()
        assert r.stdout.decode() == f"NAME=lazy\nnew\ngone\n{want}  /data/big.bin\n"
        ping = native.filler_request(str(node_dir / "node"), {"op": "ping"})
        assert ping["fills"] > 0 and ping["boto3"] is False   # presigned URLs, plain HTTP


def test_a_node_dir_on_tmpfs_is_refused_in_one_line_with_nothing_left(tmp_path):
    """tmpfs takes no pre-content marks (EOPNOTSUPP): a native create whose node dir is on
    tmpfs is refused before any filler starts or anything is mounted (the benchmark's first
    try left a running filler and the tree tmpfs behind, and a hint about mark limits)."""
    import shutil
    import tempfile

    from envbuild.errors import RuntimeShimError

    store, _ = _env(tmp_path, "shm", {"data/a": b"x" * 1000})
    fs = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    assert ["/dev/shm", "tmpfs"] in [f[1:3] for f in fs], "this test needs /dev/shm on tmpfs"
    node_dir = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="envbuild-native-test-"))
    try:
        with pytest.raises(RuntimeShimError, match="pre-content marks") as got:
            Sandbox.create("shm", store=store, node_dir=node_dir, lazy="native")
        assert "ext4" in (got.value.hint or "")
        assert native.filler_request(str(node_dir / "node"), {"op": "ping"}, 1.0) is None
        assert mounted_targets_under(str(node_dir)) == []
        assert not (node_dir / "node" / "objects" / "tmp").exists() \
            or os.listdir(node_dir / "node" / "objects" / "tmp") == []   # no probe left
    finally:
        gc_sandboxes(node_dir)
        NodeCache(node_dir / "node").evict(layers_in_use(node_dir), 0)
        for mnt in mounted_targets_under(str(node_dir)):   # a failing run's tree tmpfs
            unmount(mnt)
        shutil.rmtree(node_dir, ignore_errors=True)


def test_lazy_true_where_no_pre_content_mark_can_be_made_is_a_full_pull_said_once(
        tmp_path, caplog):
    """``lazy=True`` on a node dir on tmpfs (no pre-content marks: what a kernel without
    pre-content events answers too, found before anything is fetched or mounted) pulls the
    layers in full with one logged line; ``info().lazy`` says why; no filler, no mount."""
    import logging
    import shutil
    import tempfile

    store, _ = _env(tmp_path, "shm2", {"data/a": b"x" * 1000})
    node_dir = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="envbuild-native-test-"))
    try:
        with caplog.at_level(logging.WARNING, logger="envbuild.sandbox"), \
                Sandbox.create("shm2", store=store, node_dir=node_dir, lazy=True) as sb:
            assert sb.info().lazy.startswith("full pull: the node's object store"), \
                sb.info().lazy
            assert "pre-content marks" in sb.info().lazy
            assert sb.exec("wc -c /data/a").stdout.split()[0] == b"1000"
        said = [r.getMessage() for r in caplog.records if r.name == "envbuild.sandbox"]
        assert len(said) == 1 and "pulling the layers in full" in said[0], said
        assert native.filler_request(str(node_dir / "node"), {"op": "ping"}, 1.0) is None
        assert not (node_dir / "node" / "native").exists()
        assert NodeCache(node_dir / "node").usage()   # pulled into the node cache
    finally:
        gc_sandboxes(node_dir)
        NodeCache(node_dir / "node").evict(layers_in_use(node_dir), 0)
        for mnt in mounted_targets_under(str(node_dir)):
            unmount(mnt)
        shutil.rmtree(node_dir, ignore_errors=True)


def test_a_layer_with_a_device_node_is_refused_in_one_line_as_a_full_pull_is(tmp_path,
                                                                              node_dir):
    """A device node (other than the 0/0 whiteout) is refused by a native create in one
    line naming it, its layer not mounted, as a full pull refuses it (``UnsafeLayerError``;
    ``lazy="auto"`` falls back to that full pull)."""
    import stat

    from envbuild.errors import RuntimeShimError, UnsafeLayerError
    from tests.integration.test_container_runtime import make_busybox_root

    require_root()
    require_tool("runc")
    store = LocalStore(tmp_path / "store")
    base = make_busybox_root(tmp_path / "dev-base")
    top = tmp_path / "dev-top"
    (top / "data").mkdir(parents=True)
    os.mknod(top / "data" / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    layers = [pack_layer(store, base, tmp_path, "dev-base"), pack_layer(store, top, tmp_path, "dev-top")]
    make_env(store, "dev", layers)
    with pytest.raises(RuntimeShimError, match="hold no device nodes: /data/null") as err:
        Sandbox.create("dev", store=store, node_dir=node_dir, lazy=True)
    assert "\n" not in err.value.message and "lazy=False" in (err.value.hint or "")
    # the device's layer is not mounted (the busybox one may be: the node's, shared)
    assert not any(m.endswith(layers[1].digest[7:])
                   for m in mounted_targets_under(str(node_dir / "node" / "native")))
    for lazy in ("auto", False):   # auto: a full pull, which refuses devices as well
        with pytest.raises(UnsafeLayerError, match="data/null is a char node, refused"):
            Sandbox.create("dev", store=store, node_dir=node_dir, lazy=lazy)


def test_a_store_the_filler_cannot_open_is_an_error_for_true_a_full_pull_for_auto(
        tmp_path, node_dir):
    """The filler is another process and opens the store by URL: a memory store is refused
    in one line with ``lazy=True``; ``lazy="auto"`` pulls it in full and says why."""
    from envbuild.errors import RuntimeShimError
    from envbuild.store import MemoryStore
    from envbuild.store.sync import sync

    store, _ = _env(tmp_path, "mem", {"data/m": b"m\n"})
    memory = MemoryStore()
    sync(store, memory, refs=["env/mem"])
    with pytest.raises(RuntimeShimError, match="cannot serve layers"):
        Sandbox.create("mem", store=memory, node_dir=node_dir, lazy=True)
    with Sandbox.create("mem", store=memory, node_dir=node_dir, lazy="auto") as sb:
        assert sb.info().lazy.startswith("full pull: lazy mode cannot serve layers"), \
            sb.info().lazy
        assert sb.exec("cat /data/m").stdout == b"m\n"
    assert not (node_dir / "node" / "native").exists()


def test_a_checkpointable_lazy_sandbox_is_a_full_pull_and_checkpoints(tmp_path, node_dir,
                                                                      caplog):
    """``lazy=True`` with ``checkpointable=True``: CRIU cannot dump files mapped from the
    native layers, so the layers are pulled in full (one logged line, ``info().lazy`` says
    why) and the checkpoint is taken."""
    import logging

    store, _ = _env(tmp_path, "ck2", {"data/seed": b"7\n"})
    with caplog.at_level(logging.WARNING, logger="envbuild.sandbox"):
        sb = Sandbox.create("ck2", store=store, node_dir=node_dir, lazy=True,
                            checkpointable=True)
    try:
        assert sb.info().lazy.startswith("full pull: a checkpointable sandbox"), sb.info().lazy
        assert sb.exec("cat /data/seed").stdout == b"7\n"
        made = sb.checkpoint()
        assert made.lock
    finally:
        sb.close()
    said = [r.getMessage() for r in caplog.records if r.name == "envbuild.sandbox"]
    assert len(said) == 1 and "checkpointable" in said[0], said
    assert not (node_dir / "node" / "native").exists()


class _SlowRanges:
    """An HTTP server on 127.0.0.1 answering ranged GETs of a store's blobs (``/<digest>``,
    ``206`` with the bytes), each request whose range reaches into ``slow[digest]`` (a
    ``(start, end)`` byte range) delayed by ``delay`` s: a store whose slow reads a test can
    choose. ``store(local)``:
    that local store with presigned URLs pointing here (what the filler reads through)."""

    def __init__(self, delay: float) -> None:
        import http.server
        import threading

        self.delay, self.blobs = delay, {}
        self.slow: dict[str, tuple[int, int]] = {}
        self.requests: list[tuple[str, int, int]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:   # noqa: N802 - the http.server name
                digest = self.path.lstrip("/")
                data = outer.blobs.get(digest)
                rng = self.headers.get("Range", "")
                if data is None or not rng.startswith("bytes="):
                    self.send_error(404)
                    return
                a, _, b = rng[6:].partition("-")
                start, end = int(a), min(int(b), len(data) - 1)
                outer.requests.append((digest, start, end))
                lo, hi = outer.slow.get(digest, (0, 0))
                if start < hi and end >= lo:
                    time.sleep(outer.delay)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.send_header("Content-Length", str(end - start + 1))
                self.end_headers()
                self.wfile.write(data[start:end + 1])

            def log_message(self, *args: object) -> None:
                pass
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def store(self, local: LocalStore):
        port, blobs = self.server.server_address[1], self.blobs

        class Presigned(LocalStore):
            def presigned_get_url(self, digest: str, expires: int = 43200) -> str:
                blobs[digest] = self.blob_path(digest).read_bytes()
                return f"http://127.0.0.1:{port}/{digest}"

            def presigned_get_record_url(self, namespace: str, name: str,
                                         expires: int = 3600) -> str:
                return f"http://127.0.0.1:{port}/record/{namespace}/{name}"

            def presigned_put_record_url(self, namespace: str, name: str,
                                         expires: int = 3600) -> str:
                return f"http://127.0.0.1:{port}/record/{namespace}/{name}"
        return Presigned(local.root)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_opened_file_is_answered_before_the_rest_of_its_window(tmp_path, node_dir):
    """The opened file's own frames are one ranged read and its reader goes on once it is
    filled; the files after it in the blob (its fill window) come in a second read beside
    it. Here every read of the frames after the opened file's takes 3 s: the reader waits
    for none of them, and the window's files are filled once that read lands."""
    from envbuild.layers import LayerReader

    # files of their own frames (>= 16 KiB), all in m00's window; a large file after them
    # keeps the TOC's read (the blob's last MiB) away from theirs
    files = {f"pkg/m{i:02}.py": os.urandom(30_000) for i in range(20)}
    local, layers = _env(tmp_path, "first", {**files, "zz/pad.bin": os.urandom(3 << 20)})
    with LayerReader.open_file(local.blob_path(layers[1].digest)) as r:
        first, last = r.stat("pkg/m00.py").chunks[-1], r.stat("pkg/m19.py").chunks[-1]
    slow = _SlowRanges(delay=3.0)
    slow.slow[layers[1].digest] = (first.offset + first.csize, last.offset + last.csize)
    objects = ObjectStore(node_dir / "node")
    try:
        store = slow.store(local)
        with Sandbox.create("first", store=store, node_dir=node_dir, lazy="native") as sb:
            assert sb.exec("true").exit_code == 0   # busybox and its loader filled
            t0 = time.monotonic()
            got = sb.exec("sha256sum /pkg/m00.py")
            waited = time.monotonic() - t0
            assert got.stdout.decode().split()[0] == hashlib.sha256(files["pkg/m00.py"]) \
                .hexdigest(), got.stderr
            assert waited < 2.0, f"the opened file waited {waited:.2f} s for its window"
            m19 = hashlib.sha256(files["pkg/m19.py"]).hexdigest()
            assert not objects.complete(m19)   # its read is still on the way
            deadline = time.monotonic() + 15
            while not objects.complete(m19) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(objects.complete(hashlib.sha256(d).hexdigest()) for d in files.values())
            lo, hi = slow.slow[layers[1].digest]
            assert any(d == layers[1].digest and a < hi and e >= lo
                       for d, a, e in slow.requests)   # the window came over the slow link
    finally:
        slow.close()


def _pyc(source: str) -> bytes:
    """``source`` compiled as CPython 3.11's checked-hash pyc (what a build writes)."""
    import importlib.util
    import marshal
    import sys

    assert sys.version_info[:2] == (3, 11), "pydeps reads 3.11 pycs; run the tests on 3.11"
    data = source.encode()
    code = compile(data, "<test>", "exec")
    return (importlib.util.MAGIC_NUMBER + (3).to_bytes(4, "little")
            + importlib.util.source_hash(data) + marshal.dumps(code))


def test_predicted_files_are_filled_before_they_are_opened(tmp_path, node_dir):
    """The first open of a pyc fills its module's whole import closure ahead (the layer's
    import index, resolved over the sandbox's stack), and the first open of an interpreter
    its start-up files; each a file its blob-order window would not reach (a large file
    after each opened one ends that window)."""
    from runtime_shim.lazyfs.pyindex import index_layer_file

    lib = "usr/lib/python3.11"
    mods = {"mymod_a": "import mymod_b\n", "mymod_b": "from mymod_c import X\n",
            "mymod_c": "X = 1\n", "unrelated": "Y = 2\n"}
    files = {f"{lib}/{m}.py": src.encode() for m, src in mods.items()}
    files.update({f"{lib}/__pycache__/{m}.cpython-311.pyc": _pyc(src)
                  for m, src in mods.items()})
    files[f"{lib}/__pycache__/mymod_aa.bin"] = os.urandom(2 << 20)   # ends a's window
    files[f"{lib}/encodings/__init__.py"] = b"# codecs\n"
    files[f"{lib}/encodings/__pycache__/__init__.cpython-311.pyc"] = _pyc("# codecs\n")
    files["usr/bin/python3.11"] = b"#!/bin/sh\n"
    files["usr/bin/python3.11x"] = os.urandom(2 << 20)   # ends the interpreter's window
    store, layers = _env(tmp_path, "py", files)
    assert index_layer_file(store, str(store.blob_path(layers[1].digest)),
                            layers[1].digest) == 5
    objects = ObjectStore(node_dir / "node")

    def complete(rel: str) -> bool:
        return objects.complete(hashlib.sha256(files[rel]).hexdigest())

    def settled(rels: list[str]) -> bool:
        deadline = time.monotonic() + 15
        while not all(complete(r) for r in rels) and time.monotonic() < deadline:
            time.sleep(0.05)
        return all(complete(r) for r in rels)
    with Sandbox.create("py", store=store, node_dir=node_dir, lazy="native") as sb:
        closure = [f"{lib}/{m}.py" for m in ("mymod_a", "mymod_b", "mymod_c")] + \
            [f"{lib}/__pycache__/{m}.cpython-311.pyc" for m in ("mymod_b", "mymod_c")]
        assert not any(complete(r) for r in closure)
        assert sb.exec(f"cat /{lib}/__pycache__/mymod_a.cpython-311.pyc >/dev/null") \
            .exit_code == 0
        assert settled(closure), [r for r in closure if not complete(r)]
        startup = [f"{lib}/encodings/__init__.py",
                   f"{lib}/encodings/__pycache__/__init__.cpython-311.pyc"]
        assert not any(complete(r) for r in startup)
        assert sb.exec("cat /usr/bin/python3.11 >/dev/null").exit_code == 0
        assert settled(startup), [r for r in startup if not complete(r)]
        assert not complete(f"{lib}/unrelated.py")   # nothing imports it
        assert not complete(f"{lib}/__pycache__/unrelated.cpython-311.pyc")
        assert native.filler_request(str(node_dir / "node"), {"op": "ping"})["predicted"] >= 7
        got = sb.exec(f"sha256sum /{lib}/mymod_b.py").stdout.decode().split()[0]
        assert got == hashlib.sha256(files[f"{lib}/mymod_b.py"]).hexdigest()
