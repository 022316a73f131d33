"""Attacks on checkpoints with memory: a memory image is hostile input (it comes from a store).

Restore checks the image against envbuild's own record of the dump (every file's sha256 and
size, the process tree and mounts read from ``/proc``), never against what the image says.
"""

from __future__ import annotations

import shutil

import pytest

from envbuild.errors import CheckpointRefused
from runtime_shim import Sandbox
from runtime_shim.backends import criu
from runtime_shim.node.locks import resolve
from runtime_shim.sdk.checkpoint import ANNOTATION_IMAGE
from tests.integration.test_checkpoint import require_criu


@pytest.fixture(scope="module")
def built(busybox_store):
    return busybox_store


def test_restore_refuses_an_image_that_is_not_the_recorded_one(built, tmp_path):
    """A checkpoint lock whose image annotation points at another blob is refused with one
    line, before anything is made: the node dir keeps no sandbox."""
    require_criu()
    import copy

    from envbuild.oci import MEDIA_TYPE_MANIFEST
    from envbuild.store import put_json

    store, node = built
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node,
                        checkpointable=True) as sb:
        first = sb.checkpoint(None, leave_running=True)
        sb.exec("echo more > /workspace/more")
        second = sb.checkpoint(None, leave_running=True)
    lock = resolve(store, first.lock)
    manifest = copy.deepcopy(dict(lock.manifest))
    manifest["annotations"][ANNOTATION_IMAGE] = second.image  # swapped memory image
    forged = put_json(store, manifest, media_type=MEDIA_TYPE_MANIFEST).digest
    other = tmp_path / "node2"
    with pytest.raises(CheckpointRefused) as err:
        Sandbox.restore(forged, store=store, node_dir=other)
    assert "\n" not in err.value.message
    assert not (other / "sandboxes").exists() or not any((other / "sandboxes").iterdir())


def test_check_image_refuses_a_changed_file(built, tmp_path):
    """The image's files are checked against envbuild's record before CRIU sees them."""
    require_criu()
    from runtime_shim.backends.base import CheckpointImage
    from runtime_shim.sdk.checkpoint import read_record, unpack_image

    store, node = built
    with Sandbox.create("env/busybox-shell", store=store, node_dir=node,
                        checkpointable=True) as sb:
        made = sb.checkpoint(None, leave_running=True)
    lock = resolve(store, made.lock)
    record = read_record(store, lock)
    image = unpack_image(store, lock, record, tmp_path / "img")
    criu.check_image(image, None)  # as dumped: accepted
    pstree = tmp_path / "img" / "pstree.img"
    data = bytearray(pstree.read_bytes())
    data[-1] ^= 1
    pstree.write_bytes(bytes(data))
    with pytest.raises(CheckpointRefused, match="pstree.img does not match"):
        criu.check_image(image, None)
    (tmp_path / "img" / "extra.img").write_bytes(b"x")
    with pytest.raises(CheckpointRefused, match="files differ"):
        criu.check_image(CheckpointImage("criu", image.dir, image.record), None)
    shutil.rmtree(tmp_path / "img")
