"""The pure parts of the capped scratch disks (``runtime_shim.isolation.scratchfs``) and their settings."""

from __future__ import annotations

import pytest

from envbuild.errors import SettingsError
from envbuild.settings import Settings
from runtime_shim.isolation import scratchfs
from runtime_shim.isolation.spec import RuntimeSpecRequest, runtime_spec


def test_loop_config_matches_the_kernel_struct():
    # struct loop_config is 304 bytes on every architecture (linux/loop.h)
    assert scratchfs._LOOP_CONFIG.size == 304


def test_template_name_carries_version_size_and_inodes():
    p = scratchfs.template_path("/n/scratchfs", 64 << 20, 2048)
    assert p.name == f"ext4-v{scratchfs.TEMPLATE_VERSION}-{64 << 20}-2048.img"
    assert scratchfs.template_path("/n", 1 << 30, None).name.endswith("-auto.img")


def test_inode_limit_is_clamped_to_what_the_disk_can_hold():
    assert scratchfs.effective_inodes(10 << 30, 1_000_000) == 1_000_000
    assert scratchfs.effective_inodes(64 << 20, 5_000_000) == (64 << 20) // 8192
    assert scratchfs.effective_inodes(64 << 20, 1) == 64
    assert scratchfs.effective_inodes(64 << 20, None) is None


def test_tmpfs_mounts_are_sized():
    spec = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",)))
    tmp = next(m for m in spec["mounts"] if m["destination"] == "/tmp")
    assert "size=268435456" in tmp["options"] and "nr_inodes=65536" in tmp["options"]
    spec = runtime_spec(RuntimeSpecRequest(rootfs="/r", args=("true",), tmpfs=()))
    assert not any(m["destination"] == "/tmp" for m in spec["mounts"])


def test_build_disk_settings():
    assert Settings.from_env({}).build_disk_bytes == 50 << 30
    s = Settings.from_env({"ENVBUILD_BUILD_DISK": "64M", "ENVBUILD_BUILD_INODES": "4096"})
    assert (s.build_disk_bytes, s.build_inodes) == (64 << 20, 4096)
    assert Settings.from_env({"ENVBUILD_BUILD_DISK": "0"}).build_disk_bytes is None
    with pytest.raises(SettingsError, match="ENVBUILD_BUILD_DISK"):
        Settings.from_env({"ENVBUILD_BUILD_DISK": "lots"})


def test_data_extents_and_copy_sparse_skip_holes(tmp_path):
    src = tmp_path / "sparse"
    with open(src, "wb") as f:
        f.truncate(64 << 20)
        f.seek(1 << 20)
        f.write(b"a" * 4096)
        f.seek(40 << 20)
        f.write(b"b" * 8192)
    with open(src, "rb") as f:
        extents = list(scratchfs.data_extents(f.fileno(), 64 << 20))
    assert [s for s, _ in extents] == [1 << 20, 40 << 20]
    assert all(e > s for s, e in extents)
    dest = tmp_path / "copy"
    scratchfs.copy_sparse(src, dest)
    assert dest.read_bytes() == src.read_bytes()
    assert dest.stat().st_blocks * 512 < 1 << 20  # the holes stayed holes
    with open(tmp_path / "empty", "wb") as f:
        f.truncate(1 << 20)
    with open(tmp_path / "empty", "rb") as f:
        assert list(scratchfs.data_extents(f.fileno(), 1 << 20)) == []
