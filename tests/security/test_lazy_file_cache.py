"""Attacks on the lazy daemon's node-wide file cache (``<node>/files/<digest>``), through a
real FUSE mount (passthrough and the fallback): a store-controlled layer whose TOC (consistent
with its footer and the lock's annotation) gives a file a path-like "digest", or claims another
file's digest for different content. Neither reaches outside the cache, neither serves bytes
the TOC does not vouch for: the open fails with EIO."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os

import pytest
import zstandard

from envbuild.layers import LayerReader, pack_tree
from envbuild.store import LocalStore, put_file
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.node.nodecache import NodeCache
from tests.conftest import require_root, require_tool
from tests.security.test_bombs import assemble, split_frames

MiB = 1 << 20


@pytest.fixture
def mode(lazy_mode):  # both read paths (tests/conftest.py)
    return lazy_mode


def _crafted(tmp_path) -> tuple[bytes, bytes]:
    """A layer with ``big`` (1 MiB), ``traversal`` (its TOC digest a path) and ``liar`` (its
    TOC digest is ``big``'s, its size its own 6 bytes); returns (blob, big's bytes)."""
    src = tmp_path / "src"
    src.mkdir()
    big = os.urandom(MiB)
    (src / "big").write_bytes(big)
    (src / "traversal").write_text("trav\n")
    (src / "liar").write_text("liar!\n")
    out = tmp_path / "real.blob"
    with open(out, "wb") as f:
        pack_tree(src, f)
    data = out.read_bytes()
    reader = LayerReader(lambda off, n: data[off:off + n], len(data), name="real")
    big_digest = reader.stat("big").digest
    entries = []
    for e in reader.entries():
        if e.path.strip("/") == "traversal":
            e = dataclasses.replace(e, digest="sha256:../../../../../tmp/h13-lazy-escape")
        elif e.path.strip("/") == "liar":
            e = dataclasses.replace(e, digest=big_digest)
        entries.append(e)
    toc = reader.toc
    toc.entries = entries
    toc_json = toc.to_bytes()
    return assemble(split_frames(data, reader), zstandard.ZstdCompressor().compress(toc_json),
                    len(toc_json)), big


def test_a_lying_toc_cannot_escape_or_poison_the_file_cache(tmp_path, mode):
    require_root()
    require_tool("fusermount3")
    blob, big = _crafted(tmp_path)
    path = tmp_path / "crafted.blob"
    path.write_bytes(blob)
    store = LocalStore(tmp_path / "store")
    digest = put_file(store, path).digest
    toc_digest = LayerReader(lambda off, n: blob[off:off + n], len(blob), name="x").toc_digest
    node_dir = tmp_path / "n"
    node = NodeCache(node_dir)
    try:
        mp = node.ensure_lazy(str(store.root), digest, toc_digest)
        assert (mp / "big").read_bytes() == big
        with pytest.raises(OSError) as err:
            (mp / "traversal").read_bytes()
        assert err.value.errno == errno.EIO
        assert not os.path.exists("/tmp/h13-lazy-escape")
        # big is cached under its digest now; liar claims that digest: refused, not served
        with pytest.raises(OSError) as err:
            (mp / "liar").read_bytes()
        assert err.value.errno == errno.EIO
        names = [n for n in os.listdir(node_dir / "files") if not n.startswith(".")]
        # only what was verified, under its own digest (the fallback keeps pieces instead)
        assert names == ([hashlib.sha256(big).hexdigest()] if mode == "passthrough" else [])
        log = (node_dir / "lazy" / "daemon.log").read_text()
        assert "bad content digest" in log or "does not match its TOC digest" in log
    finally:
        node.unmount_lazy(keep=())
    assert mounted_targets_under(str(node_dir)) == []
