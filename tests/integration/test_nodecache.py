"""The node cache (one unpack per layer per host, LRU eviction) and a 120-layer sandbox."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from envbuild.layers import pack_tree
from envbuild.oci import MEDIA_TYPE_CONFIG
from envbuild.plan.lockspec import LockLayer, RuntimeConfig, make_lock, merge_config
from envbuild.store import LocalStore, put_file, put_json
from runtime_shim.node.nodecache import NodeCache, parse_size
from runtime_shim.sdk.sandbox import Sandbox, layers_in_use
from tests.conftest import require_root, require_tool
from tests.integration.test_container_runtime import make_busybox_root


def _pack(store: LocalStore, tree, tmp_path, name: str) -> LockLayer:
    blob = tmp_path / f"{name}.blob"
    with open(blob, "wb") as out:
        info = pack_tree(tree, out)
    put_file(store, blob)
    return LockLayer(name=name, role="toolkit", key="sha256:" + "0" * 64, digest=info.digest,
                     diff_id=info.diff_id, size=info.size, toc_digest=info.toc_digest)


def _lock(store: LocalStore, name: str, layers: list[LockLayer]) -> str:
    lock = make_lock(name, layers, merge_config([RuntimeConfig()]))
    put_json(store, lock.config, media_type=MEDIA_TYPE_CONFIG)
    digest = put_json(store, lock.manifest).digest
    store.put_ref(f"env/{name}", digest)
    return digest


def test_concurrent_requests_unpack_a_layer_once(tmp_path):
    store = LocalStore(tmp_path / "store")
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    for i in range(50):
        (tree / "d" / f"f{i}").write_text(str(i) * 100)
    layer = _pack(store, tree, tmp_path, "one")
    cache = NodeCache(tmp_path / "node")
    with ThreadPoolExecutor(8) as pool:
        dirs = set(pool.map(lambda _: cache.ensure(store, layer.digest, layer.toc_digest),
                            range(16)))
    assert len(dirs) == 1
    (d,) = dirs
    assert (d / "d" / "f7").read_text() == "7" * 100
    assert list((tmp_path / "node" / "tmp").iterdir()) == []
    assert cache.list_layers() == [layer.digest]


def test_eviction_keeps_layers_of_live_sandboxes(tmp_path):
    require_root()
    require_tool("runc")
    store = LocalStore(tmp_path / "store")
    base = _pack(store, make_busybox_root(tmp_path / "base"), tmp_path, "base")
    extra_tree = tmp_path / "extra"
    extra_tree.mkdir()
    (extra_tree / "big").write_bytes(os.urandom(1 << 20))
    extra = _pack(store, extra_tree, tmp_path, "extra")
    _lock(store, "small", [base])
    node_dir = tmp_path / "n"
    cache = NodeCache(node_dir / "node")
    cache.ensure(store, extra.digest)
    with Sandbox.create("small", store=store, node_dir=node_dir) as sb:
        assert layers_in_use(node_dir) == {base.digest}
        evicted = cache.evict(layers_in_use(node_dir), 0)
        assert evicted == [extra.digest]
        assert cache.list_layers() == [base.digest]
        assert sb.exec("echo alive").stdout == b"alive\n"
    assert cache.evict(layers_in_use(node_dir), 0) == [base.digest]
    assert cache.list_layers() == []


def test_a_sandbox_of_120_layers(tmp_path):
    require_root()
    require_tool("runc")
    store = LocalStore(tmp_path / "store")
    layers = [_pack(store, make_busybox_root(tmp_path / "base"), tmp_path, "base")]
    for i in range(1, 120):
        tree = tmp_path / f"t{i}"
        (tree / "layers").mkdir(parents=True)
        (tree / "layers" / f"{i:03d}").write_text(f"layer {i}\n")
        (tree / "layers" / "top").write_text(f"{i}\n")  # each layer shadows the one below
        layers.append(_pack(store, tree, tmp_path, f"l{i}"))
    _lock(store, "tall", layers)
    with Sandbox.create("tall", store=store, node_dir=tmp_path / "node") as sb:
        r = sb.exec("ls /layers | wc -l; cat /layers/top /layers/001 /layers/119")
        assert r.exit_code == 0, r.stderr
        assert r.stdout == b"120\n119\nlayer 1\nlayer 119\n"


def test_parse_size():
    assert parse_size("0") == 0
    assert parse_size("500M") == 500 << 20
    assert parse_size("2G") == 2 << 30
    assert parse_size("1.5GiB") == int(1.5 * (1 << 30))


def _fake_layers(node_dir, sizes):
    """Unpacked-looking layers of the given sizes in the node cache, oldest use first."""
    cache = NodeCache(node_dir / "node")
    digests = []
    for i, size in enumerate(sizes):
        hexd = f"{i:x}" * 64
        layer = cache.root / "layers" / hexd[:64]
        layer.mkdir(parents=True)
        (layer / "data").write_bytes(b"x" * size)
        used = cache.root / "layers" / f"{hexd[:64]}.used"
        used.touch()
        os.utime(used, (1000 + i, 1000 + i))
        digests.append("sha256:" + hexd[:64])
    return cache, digests


def test_node_gc_without_max_size_keeps_the_cache_within_its_budget(tmp_path, monkeypatch, capsys):
    """Issue 12, item 9: ``envbuild node gc`` evicts down to the configured budget
    ($ENVBUILD_NODE_CACHE_MAX, default 20 % of the filesystem), not every layer."""
    from envbuild.cli.main import main

    monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(tmp_path))
    monkeypatch.delenv("ENVBUILD_NODE_CACHE_MAX", raising=False)
    cache, digests = _fake_layers(tmp_path, [1 << 20, 1 << 20, 1 << 20])
    assert main(["node", "gc"]) == 0  # 3 MiB is far within 20 % of any filesystem here
    assert cache.list_layers() == sorted(digests)
    monkeypatch.setenv("ENVBUILD_NODE_CACHE_MAX", "2.5M")
    assert main(["node", "gc"]) == 0
    assert cache.list_layers() == sorted(digests[1:])  # the least recently used went
    assert main(["node", "gc", "--max-size", "0"]) == 0
    assert cache.list_layers() == []
    monkeypatch.setenv("ENVBUILD_NODE_CACHE_MAX", "lots")
    capsys.readouterr()
    assert main(["node", "gc"]) == 1
    assert "not a size: 'lots'" in capsys.readouterr().err
