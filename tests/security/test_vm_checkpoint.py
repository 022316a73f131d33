"""Attacks on microVM checkpoints (issue 18, item 2): a memory image is untrusted input (QEMU's
migration code parses it, unfiltered, on the host), so a restore loads only files whose
digests are those envbuild recorded when it made the checkpoint. A flipped byte in the memory
image, a changed disk image, a file swapped for a symlink to another checkpoint's, or a record
of another checkpoint: each is refused with one line before QEMU starts, leaving no process,
sandbox dir or mount. Real QEMU (TCG); one VM boot for the module.
"""

from __future__ import annotations

import shutil

import pytest

from envbuild.errors import CheckpointRefused
from runtime_shim.backends.base import CheckpointImage
from runtime_shim.backends.vm.checkpoint import DISK_FILE, MEMORY_FILE, VmCheckpoint
from runtime_shim.isolation.mount import mounted_targets_under
from runtime_shim.sdk.sandbox import Limits, Sandbox
from tests.integration.test_microvm import _qemu_pids, _require_vm_tools

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def saved(busybox_store, tmp_path_factory):
    """Two checkpoints of one VM (before and after a write): ``(store, node, a, b)``."""
    _require_vm_tools()
    store, node = busybox_store
    root = tmp_path_factory.mktemp("vm-ckpt-attacks")
    with Sandbox.create("busybox-shell", store=store, node_dir=node, backend="microvm",
                        limits=Limits(memory_bytes=256 << 20)) as sb:
        a = sb.handle.checkpoint(root / "a", leave_running=True)
        sb.exec("echo changed > /workspace/x")
        b = sb.handle.checkpoint(root / "b", leave_running=True)
    return store, node, a, b


def _copy(image: CheckpointImage, dest) -> CheckpointImage:
    shutil.copytree(image.dir, dest)
    return CheckpointImage(kind=image.kind, dir=dest, record=image.record, bytes=image.bytes,
                           seconds=image.seconds)


def _refused(saved, image: CheckpointImage, match: str) -> None:
    store, node, _, _ = saved
    qemu_before = _qemu_pids()
    sandboxes = set((node / "sandboxes").iterdir())
    with pytest.raises(CheckpointRefused, match=match) as e:
        Sandbox.create(VmCheckpoint.from_record(image.record).lock, store=store, node_dir=node,
                       backend="microvm", restore=image)
    assert "\n" not in e.value.message
    assert _qemu_pids() <= qemu_before  # QEMU never started
    assert set((node / "sandboxes").iterdir()) == sandboxes
    assert mounted_targets_under(str(node)) == []


def test_a_flipped_byte_in_the_memory_image_is_refused(saved, tmp_path):
    image = _copy(saved[2], tmp_path / "ck")
    mem = image.dir / MEMORY_FILE
    data = bytearray(mem.read_bytes())
    data[len(data) // 2] ^= 0x01
    mem.write_bytes(data)
    _refused(saved, image, "memory.img does not match")


def test_a_changed_disk_image_is_refused(saved, tmp_path):
    image = _copy(saved[2], tmp_path / "ck")
    disk = image.dir / DISK_FILE
    with open(disk, "r+b") as f:
        f.seek(disk.stat().st_size - 100)  # inside the last block's bytes
        f.write(b"guest-chosen superblock")
    _refused(saved, image, "rw.ext4.sparse does not match")
    with open(disk, "r+b") as f:  # a block header claiming 1 GiB
        f.seek(28 + 8)
        f.write((1 << 30).to_bytes(4, "big"))
    _refused(saved, image, "rw.ext4.sparse is malformed")


def test_a_file_swapped_for_a_symlink_is_not_followed(saved, tmp_path):
    image = _copy(saved[2], tmp_path / "ck")
    (image.dir / MEMORY_FILE).unlink()
    (image.dir / MEMORY_FILE).symlink_to(saved[2].dir / MEMORY_FILE)
    _refused(saved, image, "read memory.img")


def test_another_checkpoints_files_under_this_record_are_refused(saved, tmp_path):
    _, _, a, b = saved
    image = _copy(b, tmp_path / "ck")
    forged = CheckpointImage(kind="qemu", dir=image.dir, record=a.record)
    _refused(saved, forged, "does not match")
