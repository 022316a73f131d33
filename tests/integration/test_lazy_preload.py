"""When a passthrough mount writes the files a fetch brought to the node's file cache
(``runtime_shim.lazyfs.passthrough.PRELOAD``): by default at their first open, from the frames
in memory; with ``$ENVBUILD_LAZY_PRELOAD=on`` at once, by a background writer. Either way a
file the miss window brought is read without another store request. Real passthrough mounts
served by the node daemon from a store directory."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from runtime_shim.lazyfs import lazy_stats
from tests.integration.test_lazy_dirs import _mounted

pytestmark = pytest.mark.integration

FILES = {f"pkg/m{i:02d}.py": (f"# module {i}\n" * (40 + i)).encode() for i in range(24)}


def _tree(root: Path) -> None:
    for rel, data in FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _cached(node: Path) -> set[str]:
    """The digests (hex) of the node's file cache."""
    return {p.name for p in (node / "files").iterdir() if not p.name.startswith(".")}


def _hex(rel: str) -> str:
    return hashlib.sha256(FILES[rel]).hexdigest()


def _wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.parametrize("preload", ["off", "on"])
def test_files_a_miss_brought_are_written_when_opened_or_at_once(tmp_path, monkeypatch,
                                                                 preload):
    with _mounted(tmp_path, monkeypatch, tree=_tree, ENVBUILD_LAZY_PRELOAD=preload) as mp:
        node = tmp_path / "node"
        first = "pkg/m00.py"
        assert (mp / first).read_bytes() == FILES[first]     # a miss: its window comes too
        others = {_hex(rel) for rel in FILES if rel != first}
        if preload == "on":
            assert _wait_for(lambda: len(_cached(node) & others) >= 3), _cached(node)
        else:
            time.sleep(1.0)   # what a background writer would have written by now
            assert _cached(node) == {_hex(first)}
        requests = lazy_stats(mp)["requests"]
        for rel in sorted(FILES)[1:6]:
            assert (mp / rel).read_bytes() == FILES[rel]
            assert _hex(rel) in _cached(node)
        assert lazy_stats(mp)["requests"] == requests   # from the frames the miss brought
