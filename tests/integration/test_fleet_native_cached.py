"""The fleet's placement prefers nodes that hold a lock's layers (``NodeStatus.cached``); a
layer a node serves through the native lazy filler (``lazy=True``'s mode) is held there too:
its overlay is mounted at ``<node>/native/<hex>``. Before, only unpacked layers and FUSE
mounts counted, so placement ignored where native layers were and the daemon counted them
as pulled again. A real mount on a stub daemon (no Ray, no runc)."""

from __future__ import annotations

import subprocess

import pytest

from runtime_shim.lazyfs.nativetree import mount_dir
from tests.conftest import require_root
from tests.fleet_stub import stub_cell

pytestmark = pytest.mark.integration

LAYER = "sha256:" + "ab" * 32


def test_a_natively_mounted_layer_is_cached_on_its_node(tmp_path):
    require_root()
    cell = stub_cell(tmp_path, nodes=1)
    (daemon,) = cell.daemons.values()
    target = mount_dir(str(daemon.layout.node), LAYER[7:])
    try:
        assert daemon.status([LAYER]).cached == ()
        subprocess.run(["mkdir", "-p", target], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "native-probe", target],
                       check=True)
        assert daemon.status([LAYER]).cached == (LAYER,)
    finally:
        subprocess.run(["umount", target], check=False, capture_output=True)
        cell.close()
