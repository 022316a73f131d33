"""The lazy daemon's memory against hostile layers (issue 34, item 7): a layer's tree costs the
daemon ~1.6 KB per TOC member, so a layer of 190,000 members cost 300 MB — and the daemon kept
it after the unmount (each mount's background threads held its tree for the daemon's life).
Now the trees of the mounted layers are charged against a budget (a mount past it is one clear
error, never a daemon that grows without bound) and an unmounted tree's memory goes back to the
system. Against the real daemon, real FUSE mounts and a real store directory."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from envbuild.errors import RuntimeShimError
from envbuild.layers import pack_tree
from envbuild.store import open_store, put_file
from runtime_shim.isolation.mount import unmount
from runtime_shim.lazyfs.control import daemon_request
from runtime_shim.node.nodecache import NodeCache
from tests.conftest import require_root, require_tool


def _layer(store, tmp_path: Path, name: str, members: int) -> tuple[str, str]:
    tree = tmp_path / name
    for d in range(max(1, members // 1000)):
        sub = tree / f"d{d:03d}"
        sub.mkdir(parents=True)
        for i in range(min(1000, members)):
            (sub / f"module-with-a-name-{i:04d}.py").write_text(name)
    blob = tmp_path / f"{name}.blob"
    with open(blob, "wb") as out:
        info = pack_tree(tree, out)
    put_file(store, blob)
    return info.digest, info.toc_digest


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(key)


@pytest.fixture
def lazy_node(tmp_path):
    require_root()
    require_tool("fusermount3")
    cache = NodeCache(tmp_path / "node")
    yield cache
    cache.unmount_lazy(keep=())


def test_a_mount_past_the_daemons_tree_budget_is_refused(lazy_node, tmp_path, monkeypatch):
    store_dir = tmp_path / "store"
    store = open_store(str(store_dir))
    first = _layer(store, tmp_path, "first", 3000)
    second = _layer(store, tmp_path, "second", 3000)
    # room for one 3,000-member tree (4.8 MB), not two
    monkeypatch.setenv("ENVBUILD_LAZY_TREE_BUDGET", "6M")
    lazy_node.ensure_lazy(str(store_dir), *first)
    with pytest.raises(RuntimeShimError, match="cannot serve it") as e:
        lazy_node.ensure_lazy(str(store_dir), *second)
    why = e.value.context or ""   # the daemon's own lines
    assert "over its memory budget" in why and "ENVBUILD_LAZY_TREE_BUDGET" in why, why
    ping = daemon_request(lazy_node.root, {"op": "ping"}, 10)
    assert ping is not None and ping["tree_bytes"] <= ping["tree_budget"] == 6 << 20
    # the first one's charge goes with its mount: then the second fits
    unmount(str(lazy_node.lazy_dir(first[0])))
    mp = lazy_node.ensure_lazy(str(store_dir), *second)
    assert (mp / "d000" / "module-with-a-name-0000.py").exists()


def test_an_unmounted_trees_memory_and_threads_are_given_back(lazy_node, tmp_path):
    """A hostile layer mounted and unmounted again and again: the daemon's memory and threads
    stay where the first round left them (before: +one tree and +4 threads a round)."""
    store_dir = tmp_path / "store"
    store = open_store(str(store_dir))
    keeper = _layer(store, tmp_path, "keeper", 1)   # keeps the daemon up across the unmounts
    big = _layer(store, tmp_path, "big", 60_000)
    lazy_node.ensure_lazy(str(store_dir), *keeper)
    ping = daemon_request(lazy_node.root, {"op": "ping"}, 10)
    assert ping is not None
    pid = ping["pid"]
    after = []
    for _ in range(3):
        before = _status(pid, "VmRSS")
        mp = lazy_node.ensure_lazy(str(store_dir), *big)
        assert (mp / "d059" / "module-with-a-name-0999.py").read_text() == "big"
        grown = _status(pid, "VmRSS") - before
        unmount(str(mp))
        settled = threading.Event()
        for _ in range(100):   # the mount's thread ends, then the daemon frees the heap
            if _status(pid, "VmRSS") - before < grown // 2:
                settled.set()
                break
            settled.wait(0.1)
        after.append((_status(pid, "VmRSS"), _status(pid, "Threads")))
        assert settled.is_set(), f"after an unmount the daemon holds {after[-1][0] - before} " \
                                 f"kB more than before the mount (the tree took {grown} kB)"
    assert grown > 40_000, f"the tree took only {grown} kB: not the layer this test means"
    (rss1, threads1), (rss3, threads3) = after[0], after[-1]
    assert rss3 - rss1 < grown // 4, after
    assert threads3 <= threads1, after
