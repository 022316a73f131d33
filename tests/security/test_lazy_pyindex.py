"""A hostile import index (``runtime_shim.lazyfs.pyindex``) in the store, read by a real lazy
daemon over real passthrough FUSE mounts: anyone who can write the store's records can
replace a layer's index. Names that climb out of the tree (``..``, ``/etc``, absolute and
dotted paths), string-table indexes out of range, a fromlist of ten thousand names, a
record naming another layer, and entries of every wrong type must neither crash the daemon
nor fetch anything outside the stack's own modules: the import still works, the log has no
traceback, the other layer's record is not used, and the bytes fetched stay those of the
import."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
import time
from pathlib import Path

import pytest

from envbuild.layers import LayerReader, pack_tree
from envbuild.store import PYIMPORT_RECORDS, LocalStore, put_file
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.lazyfs import lazy_stats
from runtime_shim.lazyfs.control import daemon_request
from runtime_shim.node.nodecache import NodeCache
from tests.conftest import require_root, require_tool

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                                 reason="the index holds CPython 3.11 pycs; the suite runs 3.11")]

SP = "opt/venv/lib/python3.11/site-packages"


def _layer(tmp_path: Path, store: LocalStore) -> tuple[str, str, str]:
    """A venv layer with package ``pkg`` (``pkg.a``, ``pkg.b``) and a file outside any
    module (``secret/keys.py``, never imported): digest, TOC digest, pkg's pyc path."""
    root = tmp_path / "venv"
    for rel, text in {"pkg/__init__.py": "from . import a\n", "pkg/a.py": "import pkg.b\n",
                      "pkg/b.py": "X = 1\n", "../../secret/keys.py": "K = 2\n"}.items():
        src = (root / SP / rel).resolve()
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(text + "# " + "z" * 300_000 + "\n")
        pyc = src.parent / "__pycache__" / f"{src.stem}.{sys.implementation.cache_tag}.pyc"
        py_compile.compile(str(src), str(pyc), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    blob = tmp_path / "venv.layer"
    with open(blob, "wb") as f:
        pack_tree(root, f)
    digest = put_file(store, blob).digest
    with LayerReader.open_file(blob) as r:
        toc = r.toc_digest
    return digest, toc, f"{SP}/pkg/__pycache__/__init__.{sys.implementation.cache_tag}.pyc"


def _run(tmp_path: Path, store: LocalStore, digest: str, toc: str, tag: str
         ) -> tuple[dict, dict, str]:
    node = NodeCache(tmp_path / f"node-{tag}")
    try:
        record = {"key": "sha256:" + os.urandom(32).hex(), "layers": [digest],
                  "store": str(store.root), "s3_endpoint": None}
        mp = node.ensure_lazy(str(store.root), digest, toc, record_profile=record)
        time.sleep(0.5)   # the index is read in the background after the mount
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(mp / SP)}
        subprocess.run([sys.executable, "-S", "-c", "import pkg; assert pkg.a.pkg.b.X == 1"],
                       check=True, env=env, timeout=120)
        ping = daemon_request(node.root, {"op": "ping"}, 10) or {}
        stats = lazy_stats(mp)
        log = (node.root / "lazy" / "daemon.log").read_text()
    finally:
        node.unmount_lazy(keep=())
    assert mounted_targets_under(str(tmp_path / f"node-{tag}")) == []
    return ping, stats, log


def test_a_hostile_index_neither_crashes_the_daemon_nor_fetches_outside_the_modules(
        tmp_path, monkeypatch):
    require_root()
    require_tool("fusermount3")
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    monkeypatch.delenv("ENVBUILD_LAZY_PYDEPS", raising=False)
    monkeypatch.delenv("ENVBUILD_LAZY_PYINDEX", raising=False)
    store = LocalStore(tmp_path / "store")
    digest, toc, first = _layer(tmp_path, store)
    baseline, base_stats, _ = _run(tmp_path, store, digest, toc, "none")
    names = ["..", "../../secret/keys", "/etc/passwd", "secret.keys", "secret", "pkg",
             "a" * 10_000, "", "pkg.b"]
    store.put_record(PYIMPORT_RECORDS, digest[7:], {
        "version": 1, "layer": digest, "names": names + [7, None, ["x"]],
        "pycs": {
            first: [0, 0, 0, 1, 0, 0, 2, 0, 0, 3, 0, 0, 4, 5, 0,        # climbing names
                    6, 0, 0, 99, 0, 0, -3, 0, 0, 9, 0, 0, 10, 0, 0,     # too long, bad refs
                    7, 3, 1, 1, 7, 99, 0,                               # levels past the top
                    5, 0, 10_000, *([3] * 10_000),                      # a huge fromlist
                    8, 0, 0],                                           # and one good import
            f"{SP}/pkg/__pycache__/a.{sys.implementation.cache_tag}.pyc": "not a list",
            "../../etc/passwd": [5, 0, 0],
            "/abs/__pycache__/x.cpython-311.pyc": [0, 0, 0]}})
    ping, stats, log = _run(tmp_path, store, digest, toc, "hostile")
    assert "Traceback" not in log, log[-3000:]
    assert ping.get("ok") and ping["import_indexes"] == {digest: 4}, ping.get("import_indexes")
    pred = ping["import_prediction"]
    assert pred["predicted_opened"] == pred["files_predicted"], pred   # nothing beside pkg's
    assert stats["bytes_fetched"] <= base_stats["bytes_fetched"] + (64 << 10), stats
    # a record that names another layer is not this layer's index
    store.put_record(PYIMPORT_RECORDS, digest[7:], {
        "version": 1, "layer": "sha256:" + "e" * 64, "names": ["pkg"],
        "pycs": {first: [0, 0, 0]}})
    ping, _, log = _run(tmp_path, store, digest, toc, "other")
    assert "Traceback" not in log and ping["import_indexes"] == {}, ping.get("import_indexes")
    assert baseline["import_indexes"] == {}
