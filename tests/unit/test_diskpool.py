"""The pure parts of the node's disk pool (``runtime_shim.node.diskpool``) and its settings."""

from __future__ import annotations

import pytest

from envbuild.errors import SettingsError
from runtime_shim.isolation import quotafs, seccomp
from runtime_shim.node import diskpool
from runtime_shim.node.model import Limits

GiB = 1 << 30


def test_the_pool_is_the_default_and_loop_the_alternative():
    assert diskpool.mode({}) == "pool"
    assert diskpool.mode({"ENVBUILD_SANDBOX_DISK": "loop"}) == "loop"
    with pytest.raises(SettingsError, match="not a disk mode: 'zfs'"):
        diskpool.mode({"ENVBUILD_SANDBOX_DISK": "zfs"})


def test_only_a_sandbox_with_a_disk_limit_is_pooled():
    assert diskpool.pooled(Limits(), {})
    assert not diskpool.pooled(Limits(disk_bytes=None), {})
    assert not diskpool.pooled(Limits(), {"ENVBUILD_SANDBOX_DISK": "loop"})


def test_pool_size_is_a_quarter_of_the_budget_in_whole_gib_or_the_setting():
    assert diskpool.pool_size({}, 47 * GiB + 5) == 11 * GiB
    assert diskpool.pool_size({}, 100 << 20) == quotafs.MIN_POOL  # never below 1 GiB
    assert diskpool.pool_size({"ENVBUILD_DISK_POOL_SIZE": "200G"}, GiB) == 200 * GiB
    with pytest.raises(SettingsError, match="at least 1 GiB"):
        diskpool.pool_size({"ENVBUILD_DISK_POOL_SIZE": "100M"}, 50 * GiB)


def test_the_ioctl_numbers_are_the_kernels():
    # _IOC(dir, 0x94, nr, size): dir 1 write, 2 read (linux/btrfs.h)
    def ioc(direction: int, nr: int, size: int) -> int:
        return (direction << 30) | (size << 16) | (0x94 << 8) | nr

    assert quotafs._SUBVOL_CREATE == ioc(1, 14, 4096)
    assert quotafs._SNAP_DESTROY == ioc(1, 15, 4096)
    assert quotafs._QUOTA_CTL == ioc(3, 40, 16)
    assert quotafs._QGROUP_ASSIGN == ioc(1, 41, 24)
    assert quotafs._QGROUP_CREATE == ioc(1, 42, 16)
    assert quotafs._QGROUP_LIMIT == ioc(2, 43, 48)
    assert quotafs._INO_LOOKUP == ioc(3, 18, 4096)
    assert quotafs._SYNC == ioc(0, 8, 0)
    assert quotafs._SUBVOL_SYNC_WAIT == ioc(1, 65, 16)
    assert quotafs._FITRIM == (3 << 30) | (24 << 16) | (ord("X") << 8) | 121  # linux/fs.h


def test_seccomp_refuses_making_subvolumes_but_not_reflinks():
    def denied(cmd: int) -> bool:
        return any(cmd & mask == value for _n, value, mask in seccomp.IOCTL_DENY)

    assert denied(quotafs._SUBVOL_CREATE)
    assert denied(0x50009418)  # BTRFS_IOC_SUBVOL_CREATE_V2
    assert denied(0x50009401) and denied(0x50009417)  # SNAP_CREATE, SNAP_CREATE_V2
    assert not denied(0x40049409)  # FICLONE (cp --reflink) keeps working
    assert not denied(0x4020940D)  # FICLONERANGE


def test_a_process_that_serves_a_node_holds_its_empty_pools(monkeypatch):
    """``envbuild serve`` and a fleet node daemon keep empty pools mounted a minute; the
    variable still rules."""
    monkeypatch.setattr(diskpool, "_default_grace", diskpool.DEFAULT_GRACE)
    diskpool.hold_pools()
    assert diskpool.grace({}) == diskpool.SERVICE_GRACE == 60
    assert diskpool.grace({"ENVBUILD_DISK_POOL_GRACE": "0"}) == 0


def test_the_pool_s_grace_is_a_number_of_seconds(monkeypatch):
    monkeypatch.setattr(diskpool, "_default_grace", diskpool.DEFAULT_GRACE)  # no serve ran
    assert diskpool.grace({}) == diskpool.DEFAULT_GRACE == 0  # a library user: none
    assert diskpool.grace({"ENVBUILD_DISK_POOL_GRACE": "0"}) == 0
    assert diskpool.grace({"ENVBUILD_DISK_POOL_GRACE": " 2.5 "}) == 2.5
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(SettingsError, match="ENVBUILD_DISK_POOL_GRACE=.*seconds") as info:
            diskpool.grace({"ENVBUILD_DISK_POOL_GRACE": bad})
        assert "ENVBUILD_DISK_POOL_GRACE=60" in (info.value.hint or "")
