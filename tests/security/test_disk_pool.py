"""Issue 39 item 2: every sandbox's disk is a subvolume of one btrfs pool per node, capped by a
quota group (``runtime_shim.node.diskpool``, ``runtime_shim.isolation.quotafs``), not a loop
device each. Real runc sandboxes of the busybox env, the real kernel's btrfs quotas.

``test_disk_limits.py`` runs the common guarantees (fallocate, every writable place, cleanup
after close and after a crash) in both modes; this file holds what only the pool has: one loop
device for many sandboxes, sandboxes that do not count against each other, files capped by
their metadata's bytes, what root in a sandbox can try against its cap, and the accounting.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from envbuild.errors import AdmissionRefused, RuntimeShimError
from runtime_shim.isolation import quotafs
from runtime_shim.node import diskpool
from runtime_shim.node.layout import NodeLayout
from runtime_shim.node.ledger import Ledger
from runtime_shim.sdk.sandbox import Limits, Sandbox, gc_sandboxes
from tests.conftest import REPO, require_tool

ENV = "env/busybox-shell"
MiB = 1 << 20
PROBE_SOURCE = Path(__file__).with_name("disk_pool_probe.c")


@pytest.fixture
def pool_env(busybox_store, monkeypatch, tmp_path):
    """The busybox store and a node dir of the test's own (a pool is per node dir)."""
    for name in (diskpool.POOL_DIR_ENV, diskpool.POOL_SIZE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(diskpool.MODE_ENV, "pool")
    return busybox_store[0], tmp_path / "node"


def _assert_pool_gone(node: Path) -> None:
    """Once the pool's grace is cut short (``unmount_idle``: what its process's exit and
    ``sandbox gc`` do), no mount under ``node``, and its loop device detached (autoclear: the
    kernel detaches it once the unmounted filesystem let go of it, a moment later on a loaded
    host)."""
    _release(node)
    assert not _mounts(node), _mounts(node)
    deadline = time.monotonic() + 10
    while _loops(node) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _loops(node), _loops(node)


def _release(node: Path) -> None:
    assert diskpool.unmount_idle(NodeLayout(node)) is None


def _loops(prefix: Path) -> list[str]:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if str(prefix) in line]


def _mounts(prefix: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if f" {prefix}/" in line]


def test_many_sandboxes_share_one_loop_device_and_do_not_count_against_each_other(pool_env):
    store, node = pool_env
    sbs = [Sandbox.create(ENV, store=store, node_dir=node, limits=Limits(disk_bytes=48 * MiB))
           for _ in range(4)]
    try:
        assert len(_loops(node)) == 1, _loops(node)  # the pool's, for all four
        for sb in sbs:  # no mount of their own on the host (the overlay is in the container's
            assert _mounts(sb.paths.root) == [], _mounts(sb.paths.root)  # namespace: mountns)
        full = sbs[0].exec("dd if=/dev/zero of=/fill bs=1M count=100 2>&1; echo rc=$?")
        assert b"Disk quota exceeded" in full.stdout and b"rc=0" not in full.stdout
        for sb in sbs[1:]:  # each still has its whole cap
            r = sb.exec("dd if=/dev/zero of=/fill bs=1M count=40 2>&1; echo rc=$?")
            assert b"rc=0" in r.stdout, r.stdout
    finally:
        for sb in sbs:
            sb.close()
    _assert_pool_gone(node)


def test_file_bomb_stops_at_the_cap(pool_env):
    """btrfs has no inode limit: each file's metadata is charged to the sandbox's group, so a
    16 MiB cap stops a file bomb at tens of thousands of files (~350 bytes each)."""
    store, node = pool_env
    with Sandbox.create(ENV, store=store, node_dir=node,
                        limits=Limits(disk_bytes=16 * MiB)) as sb:
        r = sb.exec("mkdir /bomb && cd /bomb && seq 1 200000 | xargs touch; echo rc=$?; "
                    "ls /bomb | wc -l", timeout=300)
    out = r.stdout.decode() + r.stderr.decode()
    assert "Disk quota exceeded" in out, out[-2000:]
    made = int(r.stdout.decode().split()[-1])
    assert 1000 < made < 200_000, made


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> bytes:
    gcc = require_tool("gcc")
    out = tmp_path_factory.mktemp("diskprobe") / "probe"
    subprocess.run([gcc, "-static", "-O1", "-o", str(out), str(PROBE_SOURCE)], check=True,
                   capture_output=True)
    return out.read_bytes()


def _run_probe(sb: Sandbox, probe: bytes, where: str) -> dict[str, int]:
    sb.write_file("/probe", probe, mode=0o755)
    r = sb.exec(["/probe", where], timeout=120)
    assert r.exit_code == 0, r
    return {k: int(v) for k, v in (line.split() for line in r.stdout.decode().splitlines())}


@pytest.mark.parametrize("where", ["/tmp", "/"])  # /tmp: the subvolume's own dir, bind-mounted
def test_root_in_the_sandbox_cannot_leave_or_lift_its_cap(pool_env, probe, where):
    store, node = pool_env
    with Sandbox.create(ENV, store=store, node_dir=node,
                        limits=Limits(disk_bytes=32 * MiB)) as sb:
        calls = _run_probe(sb, probe, where)
    assert calls["subvol"] != 0, calls  # seccomp (on /tmp) or overlayfs (on /) refuse it
    assert calls["limit"] in (errno.EPERM, errno.ENOTTY), calls  # no CAP_SYS_ADMIN
    assert calls["quota_off"] in (errno.EPERM, errno.ENOTTY), calls
    assert calls["projid"] != 0, calls  # no project ids on the pool, nor a way to set one


def test_a_nested_subvolume_stays_under_the_cap_without_the_filter(pool_env, probe):
    """The control, and the second line: with no seccomp filter a subvolume can be made in
    /tmp, and it joins the sandbox's level-1 group, so its writes still stop at the cap (with
    the cap on the subvolume's own group it would have taken all 512 MiB); close deletes it."""
    store, node = pool_env
    with Sandbox.create(ENV, store=store, node_dir=node, seccomp="unconfined",
                        limits=Limits(disk_bytes=32 * MiB)) as sb:
        calls = _run_probe(sb, probe, "/tmp")
        subvolume = sb.paths.disk.resolve()
    assert calls["subvol"] == 0, calls
    assert 8 < calls["nested_mib"] < 32, calls
    assert not subvolume.exists()
    _assert_pool_gone(node)


def test_pooled_sandboxes_reserve_no_disk_and_the_pool_is_reserved_once(pool_env,
                                                                         monkeypatch):
    """Overcommit: ten sandboxes of 10 GiB each on a 2 GiB pool; the ledger holds the pool's
    2 GiB once and no disk for the sandboxes; a pool with too little free refuses a sandbox
    in one line."""
    store, node = pool_env
    monkeypatch.setenv(diskpool.POOL_SIZE_ENV, "2G")
    ten_gib = Limits(pids=16, nofile=256)  # the default disk; the default 256 x 1024 files
    assert ten_gib.disk_bytes == 10 << 30  # would fill the file table's budget first
    sbs = [Sandbox.create(ENV, store=store, node_dir=node, limits=ten_gib) for _ in range(10)]
    try:
        held = Ledger(node / "node").reserved()
        assert held[diskpool.POOL_KEY].disk_bytes == 2 << 30
        assert all(held[f"sandbox:{sb.id}"].disk_bytes == 0 for sb in sbs), held
        sbs[0].exec("dd if=/dev/zero of=/fill bs=1M count=1800; sync")
        with pytest.raises(AdmissionRefused, match="disk pool .* MiB free"):
            Sandbox.create(ENV, store=store, node_dir=node, limits=ten_gib)
    finally:
        for sb in sbs:
            sb.close()
    _assert_pool_gone(node)
    assert list(Ledger(node / "node").reserved()) == [diskpool.POOL_KEY]  # the image stays


def test_an_operator_pool_dir_not_on_btrfs_is_refused_in_one_line(pool_env, monkeypatch,
                                                                  tmp_path):
    store, node = pool_env
    monkeypatch.setenv(diskpool.POOL_DIR_ENV, str(tmp_path))
    with pytest.raises(RuntimeShimError, match="not on btrfs") as info:
        Sandbox.create(ENV, store=store, node_dir=node)
    assert "ENVBUILD_DISK_POOL_DIR" in (info.value.hint or "")
    assert not any((node / "sandboxes").iterdir()) and not _mounts(node)


def test_a_pool_held_by_another_namespace_is_never_mounted_twice(pool_env):
    """A mount namespace made while the pool is mounted (runc's, another tool's) keeps its
    filesystem alive after our unmount. The next sandbox must not mount the same image a second
    time (two instances of one btrfs writing one file: the older one's last commit undid the
    newer one's deletions): the node makes a new image, and the old one goes with its holder."""
    store, node = pool_env
    limits = Limits(disk_bytes=32 * MiB)
    image = node / "node" / "diskpool" / diskpool.IMAGE_NAME
    with Sandbox.create(ENV, store=store, node_dir=node, limits=limits):
        first = image.stat().st_ino
        holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "60"])
        time.sleep(0.5)  # its namespace now holds a copy of the pool's mount
    try:
        _release(node)
        assert not _mounts(node) and len(_loops(node)) == 1  # unmounted here, alive there
        with Sandbox.create(ENV, store=store, node_dir=node, limits=limits) as sb:
            assert image.stat().st_ino != first  # a new image, not a second instance
            assert len(_loops(node)) == 2, _loops(node)
            assert sb.exec("echo x > /f && cat /f").stdout == b"x\n"
    finally:
        holder.kill()
        holder.wait()
    _assert_pool_gone(node)


def _subvolume_id(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return quotafs._subvolume_id(fd)
    finally:
        os.close(fd)


def test_deleted_sandboxes_leave_no_quota_group_and_a_reused_one_carries_nothing(pool_env,
                                                                                 probe):
    """Sandboxes come and go (one with a nested subvolume, which keeps its level-1 group past
    the delete; some alone, some together, the pool emptying between): afterwards the pool
    holds the groups of the live sandbox only, and that sandbox, whose subvolume id (so group
    id) a deleted one had, starts with no usage and its own cap, which holds."""
    store, node = pool_env
    mnt = node / "node" / "diskpool" / "mnt"
    limits = Limits(disk_bytes=32 * MiB)
    seen: set[int] = set()
    with Sandbox.create(ENV, store=store, node_dir=node, seccomp="unconfined",
                        limits=limits) as sb:
        assert _run_probe(sb, probe, "/tmp")["subvol"] == 0  # a nested subvolume, written to
        seen.add(_subvolume_id(sb.paths.disk))
    _release(node)  # the pool emptied and past its grace: unmounted, so ids are reused
    for together in (1, 3, 2):
        sbs = [Sandbox.create(ENV, store=store, node_dir=node, limits=limits)
               for _ in range(together)]
        for sb in sbs:
            sb.exec("dd if=/dev/zero of=/fill bs=1M count=8")
            seen.add(_subvolume_id(sb.paths.disk))
        for sb in sbs:
            sb.close()
        _release(node)
    with Sandbox.create(ENV, store=store, node_dir=node, limits=limits) as sb:
        sid = _subvolume_id(sb.paths.disk)
        quotafs.settle(mnt, 10)  # let the kernel's cleaner finish what the closes left
        assert quotafs.quota_groups(mnt) == [(0, 5), (0, sid), (1, sid)]
        assert sid in seen, (sid, seen)  # the id, so the group id, of a deleted sandbox
        used, cap = quotafs.group_usage(sb.paths.disk.resolve())
        assert cap == 32 * MiB and used < MiB, (used, cap)
        r = sb.exec("dd if=/dev/zero of=/fill bs=1M count=100 2>&1; echo rc=$?")
        assert b"Disk quota exceeded" in r.stdout and b"rc=0" not in r.stdout, r.stdout
    _assert_pool_gone(node)


def test_the_pool_gives_its_blocks_back_to_the_host_when_it_empties(pool_env):
    """The sparse image grows with what sandboxes write; the pool's release once it is empty
    trims it (``FITRIM``; the loop device punches the discarded ranges out of the image), so
    an idle node's pool takes about what an empty btrfs does."""
    store, node = pool_env
    image = node / "node" / "diskpool" / diskpool.IMAGE_NAME
    with Sandbox.create(ENV, store=store, node_dir=node,
                        limits=Limits(disk_bytes=512 * MiB)) as sb:
        r = sb.exec("dd if=/dev/zero of=/fill bs=1M count=200 && sync; echo rc=$?")
        assert b"rc=0" in r.stdout, r
        written = image.stat().st_blocks * 512
    _release(node)  # the pool's grace over
    after = image.stat().st_blocks * 512
    print(f"image allocated: {written >> 20} MiB written, {after >> 20} MiB after close")
    assert written >= 200 * MiB, written
    assert after <= 16 * MiB, after
    _assert_pool_gone(node)


def test_a_left_over_group_of_a_reused_id_gives_the_new_sandbox_nothing(pool_env):
    """A level-1 group left behind with a limit of its own (a crash between a delete and the
    group's removal), whose id the next subvolume gets: that sandbox is created all the same,
    with its own cap, not the old one."""
    store, node = pool_env
    mnt = node / "node" / "diskpool" / "mnt"
    limits = Limits(disk_bytes=32 * MiB)
    with Sandbox.create(ENV, store=store, node_dir=node, limits=limits) as first:
        group = (1 << 48) | (_subvolume_id(first.paths.disk) + 1)
        fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, quotafs._QGROUP_CREATE, struct.pack("=QQ", 1, group))
            quotafs._limit(fd, group, MiB)
        finally:
            os.close(fd)
        with Sandbox.create(ENV, store=store, node_dir=node, limits=limits) as sb:
            assert _subvolume_id(sb.paths.disk) == group & 0xFFFFFFFFFFFF
            used, cap = quotafs.group_usage(sb.paths.disk.resolve())
            assert cap == 32 * MiB and used < MiB, (used, cap)
            r = sb.exec("dd if=/dev/zero of=/fill bs=1M count=8 2>&1; echo rc=$?")
            assert b"rc=0" in r.stdout, r.stdout
    _assert_pool_gone(node)


def _counting_mounts(monkeypatch) -> list[Path]:
    """Every mount of a pool image from now on (``quotafs.mount_image``), in this process."""
    mounted: list[Path] = []
    real = quotafs.mount_image

    def counted(image: Path, target: Path) -> str:
        mounted.append(image)
        return real(image, target)

    monkeypatch.setattr(quotafs, "mount_image", counted)
    return mounted


def test_a_lifecycle_in_the_pool_s_grace_mounts_nothing(pool_env, monkeypatch):
    """The close that empties the pool leaves it mounted for its grace (60 s in a process that
    serves a node), so
    the node's next sandbox pays no mount and its close no release: three lifecycles, one
    after the other, mount the pool once (before: three times, a mount and a release each).
    The caps hold in a pool in its grace; ``unmount_idle`` ends it."""
    store, node = pool_env
    monkeypatch.delenv(diskpool.GRACE_ENV, raising=False)
    monkeypatch.setattr(diskpool, "_default_grace", diskpool.DEFAULT_GRACE)
    diskpool.hold_pools()  # as `envbuild serve` and a fleet node daemon do
    mounted = _counting_mounts(monkeypatch)
    for _ in range(3):
        with Sandbox.create(ENV, store=store, node_dir=node,
                            limits=Limits(disk_bytes=32 * MiB)) as sb:
            r = sb.exec("dd if=/dev/zero of=/fill bs=1M count=100 2>&1; echo rc=$?")
            assert b"Disk quota exceeded" in r.stdout and b"rc=0" not in r.stdout, r.stdout
        assert len(_mounts(node)) == 1 and len(_loops(node)) == 1  # the pool, empty
    assert len(mounted) == 1, mounted
    layout = NodeLayout(node)
    assert 0 < diskpool.unmount_idle(layout, 60) <= 60  # still in its grace: left mounted
    assert _mounts(node)
    _assert_pool_gone(node)


@pytest.mark.parametrize("grace", ["0", "0.5"])
def test_an_empty_pool_is_unmounted_when_its_grace_ends(pool_env, monkeypatch, grace):
    """With no sandbox back in the pool, the process that emptied it unmounts it at the end
    of its grace (a timer; 0: in the close itself, as before the grace), trimmed."""
    store, node = pool_env
    monkeypatch.setenv(diskpool.GRACE_ENV, grace)
    image = node / "node" / "diskpool" / diskpool.IMAGE_NAME
    with Sandbox.create(ENV, store=store, node_dir=node,
                        limits=Limits(disk_bytes=512 * MiB)) as sb:
        assert b"rc=0" in sb.exec("dd if=/dev/zero of=/f bs=1M count=100 && sync; echo rc=$?"
                                  ).stdout
    assert bool(_mounts(node)) == (grace != "0")
    deadline = time.monotonic() + 10
    while _mounts(node) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _mounts(node), _mounts(node)
    assert image.stat().st_blocks * 512 <= 16 * MiB  # given back to the host
    _assert_pool_gone(node)


def test_gc_unmounts_a_pool_whose_process_died_in_its_grace(pool_env, monkeypatch):
    """A process killed while its empty pool is in its grace runs no timer nor exit hook:
    ``sandbox gc`` unmounts the pool once the grace has passed, and not before."""
    store, node = pool_env
    code = textwrap.dedent(f"""
        import os
        from envbuild.store import LocalStore
        from runtime_shim.sdk.sandbox import Limits, Sandbox
        Sandbox.create({ENV!r}, store=LocalStore({str(store.root)!r}), node_dir={str(node)!r},
                       limits=Limits(disk_bytes=32 << 20)).close()
        os._exit(9)  # killed: no timer, no atexit
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), diskpool.GRACE_ENV: "60"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert len(_mounts(node)) == 1  # left in its grace
    monkeypatch.setenv(diskpool.GRACE_ENV, "60")
    gc_sandboxes(node)  # (it may remove other stale sandbox cgroups of the host)
    assert len(_mounts(node)) == 1  # gc leaves a pool in its grace alone
    monkeypatch.setenv(diskpool.GRACE_ENV, "0.2")
    time.sleep(0.3)
    gc_sandboxes(node)
    assert not _mounts(node), _mounts(node)
    _assert_pool_gone(node)
