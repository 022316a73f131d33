"""Eviction of the native object store (``runtime_shim.lazyfs.objgc``) with the real filler,
kernel and runc: unused objects unlinked, idle ones emptied and filled again with the right
bytes, a file a reader holds open never emptied under it."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from runtime_shim.lazyfs import collect_objects, describe_objects, native, objgc
from runtime_shim.lazyfs.objects import ObjectStore
from runtime_shim.node.nodecache import NodeCache
from runtime_shim.sdk.sandbox import Sandbox, layers_in_use
from tests.integration.test_lazy_native import _env, node_dir  # noqa: F401  (fixture)


def _digest(sb: Sandbox, path: str) -> str:
    got = sb.exec(f"sha256sum {path}")
    assert got.exit_code == 0, got.stderr
    return got.stdout.decode().split()[0]


def test_an_emptied_object_reads_right_again_and_is_a_marked_placeholder(tmp_path, node_dir):
    data = os.urandom(1 << 20)
    want = hashlib.sha256(data).hexdigest()
    store, _ = _env(tmp_path, "e", {"data/f.bin": data})
    root = str(node_dir / "node")
    objects = ObjectStore(root)
    with Sandbox.create("e", store=store, node_dir=node_dir, lazy="native") as sb:
        assert _digest(sb, "/data/f.bin") == want
        assert objects.complete(want) and os.stat(objects.path(want)).st_blocks > 0
        done = collect_objects(root, 0)
        assert done["emptied"] >= 1 and done["unlinked"] == 0, done
        st = os.stat(objects.path(want))
        assert (st.st_size, st.st_blocks) == (0, 0) and not objects.complete(want)
        assert describe_objects(root)["placeholders"] >= 1
        fills = native.filler_request(root, {"op": "ping"})["fills"]
        assert _digest(sb, "/data/f.bin") == want   # filled again, never zeros
        assert native.filler_request(root, {"op": "ping"})["fills"] > fills
        assert objects.complete(want) and os.stat(objects.path(want)).st_size == len(data)


def test_gc_unlinks_what_no_mounted_layer_uses_and_keeps_what_one_does(tmp_path, node_dir):
    mine, theirs = os.urandom(300_000), os.urandom(300_000)
    store, _ = _env(tmp_path, "one", {"data/mine": mine})
    _, other = _env(tmp_path, "two", {"data/theirs": theirs}, store=store)
    root = str(node_dir / "node")
    objects = ObjectStore(root)
    h_mine, h_theirs = (hashlib.sha256(x).hexdigest() for x in (mine, theirs))
    with Sandbox.create("one", store=store, node_dir=node_dir, lazy="native") as sb:
        assert _digest(sb, "/data/mine") == h_mine
        with Sandbox.create("two", store=store, node_dir=node_dir, lazy="native") as sb2:
            assert _digest(sb2, "/data/theirs") == h_theirs
        NodeCache(node_dir / "node").evict(layers_in_use(node_dir), 1 << 40)  # unmounts "two"
        assert other[1].digest[7:] not in objgc.mounted_layers(root)
        before = describe_objects(root)
        done = collect_objects(root)
        assert done["unlinked"] >= 1 and done["forgot"] == 1, done
        assert not os.path.exists(objects.path(h_theirs))
        assert not os.path.exists(objects.tail_path(other[1].digest[7:]))   # its record too
        assert objects.complete(h_mine)                   # a mounted layer's: kept, filled
        after = describe_objects(root)
        assert after["objects"] == before["objects"] - done["unlinked"]
        assert after["in_use"] == after["objects"]        # nothing unused is left
        assert _digest(sb, "/data/mine") == h_mine
        with Sandbox.create("two", store=store, node_dir=node_dir, lazy="native") as sb2:
            assert _digest(sb2, "/data/theirs") == h_theirs   # placed again, filled again


def test_with_no_filler_gc_unlinks_every_object_of_unmounted_layers(tmp_path, node_dir):
    store, _ = _env(tmp_path, "z", {"data/z": os.urandom(100_000)})
    root = str(node_dir / "node")
    with Sandbox.create("z", store=store, node_dir=node_dir, lazy="native") as sb:
        sb.exec("cat /data/z >/dev/null")
    NodeCache(node_dir / "node").evict(layers_in_use(node_dir), 1 << 40)  # stops the filler
    assert native.filler_request(root, {"op": "ping"}, 1.0) is None
    done = collect_objects(root)
    assert done["unlinked"] > 0 and describe_objects(root)["objects"] == 0, done
    assert ObjectStore(root).layer_records() == []


def test_a_file_held_open_is_never_emptied_under_its_reader(tmp_path, node_dir):
    """An open reader (through the layer's overlay, as a sandbox reads) keeps its object
    complete across ``gc --objects-max 0``; closed, the object is emptied; and sandboxes'
    ``sha256sum``s of a large file racing with repeated gcs get the right digest (or EIO),
    never another."""
    data = os.urandom(64 << 20)
    want = hashlib.sha256(data).hexdigest()
    store, layers = _env(tmp_path, "big", {"data/huge": data})
    del data
    root = str(node_dir / "node")
    objects = ObjectStore(root)
    with Sandbox.create("big", store=store, node_dir=node_dir, lazy="native") as sb:
        assert _digest(sb, "/data/huge") == want
        mnt = Path(native.nativetree.mount_dir(root, layers[1].digest[7:]))
        h = hashlib.sha256()
        with open(mnt / "data" / "huge", "rb") as f:
            h.update(f.read(1 << 20))
            done = collect_objects(root, 0)
            assert done["busy"] >= 1, done
            assert objects.complete(want)
            while chunk := f.read(1 << 20):
                h.update(chunk)
        assert h.hexdigest() == want
        assert collect_objects(root, 0)["emptied"] >= 1 and not objects.complete(want)
        results: list[str] = []

        def read() -> None:
            for _ in range(4):
                got = sb.exec("sha256sum /data/huge; echo rc=$?")
                results.append(got.stdout.decode() + got.stderr.decode())
        t = threading.Thread(target=read)
        t.start()
        rounds = 0
        while t.is_alive():
            collect_objects(root, 0)
            rounds += 1
        t.join()
        assert rounds > 1 and len(results) == 4
        for out in results:
            assert (want in out and "rc=0" in out) or \
                ("Input/output error" in out and "rc=1" in out), out
        assert _digest(sb, "/data/huge") == want


def test_node_ls_and_gc_of_the_cli_show_and_evict_objects(envbuild_cli):
    """``node ls`` counts the objects and those in use; ``node gc --objects-max`` refuses a
    bad size in one line with nothing removed, and removes the objects of unused layers."""
    import json

    assert envbuild_cli("build").code == 0
    run = envbuild_cli("run", "--lazy", "busybox-shell", "sh", "-c", "ls /bin >/dev/null")
    assert run.code == 0, run.err
    ls = envbuild_cli("node", "ls", "--json")
    assert ls.code == 0, ls.err
    objs = json.loads(ls.out)["objects"]
    assert objs["objects"] > 0 and objs["complete"] > 0 and objs["in_use"] == objs["objects"]
    assert "empty placeholders" in envbuild_cli("node", "ls").out
    bad = envbuild_cli("node", "gc", "--objects-max", "lots")
    assert bad.code == 1 and len(bad.err.strip().splitlines()) <= 2, bad.err
    root = str(envbuild_cli.node / "node")
    assert describe_objects(root)["objects"] == objs["objects"]   # nothing removed
    gc = envbuild_cli("node", "gc", "--objects-max", "0", "--json")
    assert gc.code == 0, gc.err
    assert json.loads(gc.out)["objects"]["unlinked"] == objs["objects"]
    assert describe_objects(root)["objects"] == 0
