"""Fixtures for tests against real tools: runc, overlayfs, skopeo, umoci.

``envbuild_cli`` runs the real CLI in-process (``envbuild.cli.main.main``) with its own store and
node cache, so tests see exactly what a user sees (exit code, stdout, stderr) without paying
for a Python start-up per call.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, require_root, require_tool


def pytest_collection_modifyitems(config, items):
    """Every test here is an integration test (real tools); ``-m "not integration"`` leaves
    them out. tests/unit/test_markers.py checks it."""
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@dataclasses.dataclass
class CliResult:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


@dataclasses.dataclass
class Env:
    store: Path
    node: Path
    defs: Path
    monkeypatch: pytest.MonkeyPatch
    capsys: pytest.CaptureFixture

    def __call__(self, *args: str, defs: Path | None = None) -> CliResult:
        from envbuild.cli.main import main

        self.monkeypatch.setenv("ENVBUILD_NODE_CACHE", str(self.node))
        self.monkeypatch.setenv("ENVBUILD_STORE", str(self.store))
        self.monkeypatch.setenv("ENVBUILD_DEFS", str(defs or self.defs))
        self.capsys.readouterr()
        code = main(list(args))
        captured = self.capsys.readouterr()
        return CliResult(code, captured.out, captured.err)


@pytest.fixture
def envbuild_cli(tmp_path, monkeypatch, capsys) -> Env:
    """The CLI with a fresh store and node cache, on a copy of the busybox part of envdefs/."""
    require_root()
    require_tool("runc")
    require_tool("busybox")
    defs = tmp_path / "envdefs"
    copy_busybox_defs(defs)
    return Env(store=tmp_path / "store", node=tmp_path / "node", defs=defs,
               monkeypatch=monkeypatch, capsys=capsys)


def copy_busybox_defs(dest: Path) -> None:
    """The busybox env of envdefs/ (base, kvsh workspace, shtest toolkit) with the sources it
    reads, laid out with the same relative paths so ``../../sources/kvsh`` still resolves."""
    root = dest.parent
    for rel in ("envdefs/base/busybox-tiny.yaml", "envdefs/base/files/busybox",
                "envdefs/workspaces/kvsh.yaml", "envdefs/toolkits/shtest.yaml",
                "envdefs/toolkits/files/shtest", "envdefs/envs/busybox-shell.yaml",
                "sources/kvsh"):
        src = REPO / rel
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target)
        else:
            shutil.copy2(src, target)


def build_busybox_env(root: Path):
    """Build and lock the busybox env of envdefs/ under ``root`` with the real CLI (a fresh
    process, as a user would); returns ``(LocalStore, node_dir)``. For module-scoped fixtures
    whose tests share one built store."""
    import os
    import subprocess
    import sys

    from envbuild.store import LocalStore

    require_root()
    require_tool("runc")
    require_tool("busybox")
    copy_busybox_defs(root / "envdefs")
    env = {**os.environ, "ENVBUILD_NODE_CACHE": str(root / "node"),
           "ENVBUILD_STORE": str(root / "store"), "ENVBUILD_DEFS": str(root / "envdefs")}
    proc = subprocess.run([sys.executable, "-m", "envbuild.cli", "build"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return LocalStore(root / "store"), root / "node"
