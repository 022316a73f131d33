"""``runtime_shim.lazyfs`` and ``runtime_shim.node.nodecache`` depend one way: the node cache
uses ``lazyfs.native``; nothing in the lazyfs package imports the node cache, not even inside a
function (the cycle issue 12 removed)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "runtime_shim" / "lazyfs"


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_lazyfs_never_imports_nodecache():
    files = sorted(PKG.glob("*.py"))
    assert len(files) >= 9
    for f in files:
        assert "runtime_shim.node.nodecache" not in imported(f), f.name
