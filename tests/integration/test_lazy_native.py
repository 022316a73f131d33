"""Native lazy layers over the real kernel: metadata trees in overlays over the node's object
store, filled by the fanotify filler (``runtime_shim.lazyfs.native``), in real runc sandboxes,
compared with sandboxes over unpacked layers."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from envbuild.store import LocalStore
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.lazyfs import native
from runtime_shim.lazyfs.objects import ObjectStore
from runtime_shim.node.nodecache import NodeCache
from runtime_shim.sdk.sandbox import Sandbox, gc_sandboxes, layers_in_use
from tests.conftest import require_root, require_tool
from tests.integration.test_lazy_sandbox import BIG, LISTING, _lock, _pack, _trees


@pytest.fixture
def lock2(tmp_path):
    """A local store with the two-layer lock ``two`` (every kind of member, whiteouts, an
    opaque dir, hardlinks, xattrs) and a node dir; afterwards no mount and no filler left."""
    require_root()
    require_tool("runc")
    store = LocalStore(tmp_path / "store")
    base_tree, upper_tree = _trees(tmp_path)
    base = _pack(store, base_tree, tmp_path, "base", source_date_epoch=1_700_000_000)
    upper = _pack(store, upper_tree, tmp_path, "upper", overlay_upper=True,
                  source_date_epoch=1_700_000_000)
    _lock(store, "two", [base, upper])
    node_dir = tmp_path / "n"
    yield store, node_dir, [base, upper]
    gc_sandboxes(node_dir)
    native.shutdown(str(node_dir / "node"))
    NodeCache(node_dir / "node").evict(layers_in_use(node_dir), 0)
    for target in mounted_targets_under(str(node_dir)):
        os.system(f"umount -l {target}")
    assert mounted_targets_under(str(node_dir)) == []
    assert native.filler_request(str(node_dir / "node"), {"op": "ping"}, 1.0) is None


def test_native_and_full_sandboxes_see_the_same_tree(lock2):
    store, node_dir, layers = lock2
    with Sandbox.create("two", store=store, node_dir=node_dir) as full, \
            Sandbox.create("two", store=store, node_dir=node_dir, lazy="native") as lazy:
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
