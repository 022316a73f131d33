"""A lazy layer without one extended attribute answers no getxattr (``fusewire
.MetaTree.xattrs_enosys``): its first GETXATTR gets ENOSYS, after which the kernel asks that mount no
more (overlayfs asks every lower dentry it looks up for its opaque, redirect and metacopy
attributes: ~3,000 daemon round trips in the cold_start workload). A layer with attributes
answers them as before, and both mounts' stats are still readable (``lazy_stats``: the root's
attribute, else the node daemon's "stats" reply). Real passthrough mounts served by the node
daemon from a store directory."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from envbuild.layers import LayerReader, pack_tree
from envbuild.store import LocalStore, put_file
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.lazyfs import lazy_stats
from runtime_shim.node.nodecache import NodeCache
from tests.conftest import require_root, require_tool

pytestmark = pytest.mark.integration

GETXATTR = "22"


def _layer(src: Path, store: LocalStore, tmp_path: Path) -> tuple[str, str]:
    blob = tmp_path / f"{src.name}.blob"
    with open(blob, "wb") as f:
        pack_tree(src, f)
    with LayerReader.open_file(blob) as r:
        return put_file(store, blob).digest, r.toc_digest


def test_a_layer_without_xattrs_answers_no_getxattr_and_one_with_them_keeps_them(
        tmp_path, monkeypatch):
    require_root()
    require_tool("fusermount3")
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    plain, tagged = tmp_path / "plain", tmp_path / "tagged"
    for d in (plain, tagged):
        (d / "dir").mkdir(parents=True)
        (d / "dir" / "file").write_text(d.name)
    os.setxattr(tagged / "dir" / "file", "user.envbuild.test", b"kept")
    store = LocalStore(tmp_path / "store")
    layers = [_layer(plain, store, tmp_path), _layer(tagged, store, tmp_path)]
    node = NodeCache(tmp_path / "node")
    try:
        mp_plain, mp_tagged = (node.ensure_lazy(str(store.root), d, t) for d, t in layers)
        for _ in range(3):   # asked once of the daemon, then never again
            with pytest.raises(OSError) as e:
                os.getxattr(mp_plain / "dir" / "file", "user.envbuild.test")
            assert e.value.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)
        with pytest.raises(OSError) as e:
            os.getxattr(mp_plain / "dir", "trusted.overlay.opaque")
        assert e.value.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)
        assert os.listxattr(mp_plain / "dir" / "file") == []
        assert (mp_plain / "dir" / "file").read_text() == "plain"
        stats_plain = lazy_stats(mp_plain)   # through the daemon
        assert stats_plain["requests_by_opcode"].get(GETXATTR) == 1, stats_plain
        # the layer with an attribute: answered, and "no such attribute" is ENODATA
        assert os.getxattr(mp_tagged / "dir" / "file", "user.envbuild.test") == b"kept"
        with pytest.raises(OSError) as e:
            os.getxattr(mp_tagged / "dir" / "file", "user.envbuild.other")
        assert e.value.errno == errno.ENODATA
        stats_tagged = lazy_stats(mp_tagged)   # its root's attribute
        assert stats_tagged["requests_by_opcode"].get(GETXATTR, 0) >= 3, stats_tagged
        assert stats_plain["pid"] == stats_tagged["pid"]
    finally:
        node.unmount_lazy(keep=())
    assert mounted_targets_under(str(tmp_path / "node")) == []
