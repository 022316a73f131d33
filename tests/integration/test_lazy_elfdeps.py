"""A fetched program's loader files are fetched ahead (``runtime_shim.lazyfs.elfdeps``), over a
real passthrough FUSE mount served by the node daemon from a store directory: reading the
host's dynamically linked ``true`` out of a lazy layer makes the daemon fetch its interpreter
and ``libc.so.6`` (2 MB: no tar-order window holds it) before anything opens them, and a
file that only looks like an ELF harms nothing."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from envbuild.layers import LayerReader, pack_tree
from envbuild.store import LocalStore, put_file
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.lazyfs import lazy_stats
from runtime_shim.lazyfs.elfdeps import parse
from runtime_shim.node.nodecache import NodeCache
from tests.conftest import require_root, require_tool

pytestmark = pytest.mark.integration

LIBC = "/lib/x86_64-linux-gnu/libc.so.6"


def test_a_programs_interpreter_and_libraries_are_fetched_before_it_opens_them(
        tmp_path, monkeypatch):
    require_root()
    require_tool("fusermount3")
    monkeypatch.setenv("ENVBUILD_LAZY_PASSTHROUGH", "on")
    true = shutil.which("true")
    assert true is not None
    with open(true, "rb") as f:
        interp, needed = parse(f.read())
    assert interp == "/lib64/ld-linux-x86-64.so.2" and "libc.so.6" in needed, \
        "the host's true is expected to be a dynamically linked x86_64 program"
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    (src / "lib64").mkdir()
    shutil.copy(true, src / "bin" / "true")
    shutil.copy(LIBC, src / "lib" / "x86_64-linux-gnu" / "libc.so.6")
    shutil.copy(os.path.realpath(interp), src / "lib64" / "ld-linux-x86-64.so.2")
    (src / "bin" / "fake").write_bytes(b"\x7fELF\x02\x01" + os.urandom(4096))  # not an ELF
    blob = tmp_path / "layer.blob"
    with open(blob, "wb") as f:
        pack_tree(src, f)
    store = LocalStore(tmp_path / "store")
    digest = put_file(store, blob).digest
    with LayerReader.open_file(blob) as r:
        toc_digest = r.toc_digest
    libc_size = os.path.getsize(LIBC)
    loader_size = os.path.getsize(src / "lib64" / "ld-linux-x86-64.so.2")
    node = NodeCache(tmp_path / "n")
    try:
        # a mount of a stack without a recorded profile: it records one, and fetches ahead
        record = {"key": "sha256:" + "1" * 64, "layers": [digest], "store": str(store.root),
                  "s3_endpoint": None}
        mp = node.ensure_lazy(str(store.root), digest, toc_digest, record_profile=record)
        assert (mp / "bin" / "fake").read_bytes()[:4] == b"\x7fELF"
        before = lazy_stats(mp)["bytes_decompressed"]
        assert (mp / "bin" / "true").read_bytes()[:4] == b"\x7fELF"
        deadline = time.monotonic() + 20
        # both fetched ahead, in two background loads: libc's landing says nothing of the loader's
        while lazy_stats(mp)["bytes_decompressed"] < before + libc_size + loader_size:
            assert time.monotonic() < deadline, "libc.so.6 and the loader were not fetched ahead"
            time.sleep(0.05)
        stats = lazy_stats(mp)
        assert stats["opens"] == 2   # fake and true: libc and the loader were not opened
        # the loader's open then finds its bytes without a store request
        requests = stats["requests"]
        assert (mp / "lib" / "x86_64-linux-gnu" / "libc.so.6").read_bytes() == \
            open(LIBC, "rb").read()
        assert (mp / "lib64" / "ld-linux-x86-64.so.2").read_bytes()[:4] == b"\x7fELF"
        assert lazy_stats(mp)["requests"] == requests
        log = (node.root / "lazy" / "daemon.log").read_text()
        assert "Traceback" not in log
    finally:
        node.unmount_lazy(keep=())
    assert mounted_targets_under(str(tmp_path / "n")) == []
