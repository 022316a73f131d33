"""Per-sandbox disk caps as btrfs quota groups on one shared filesystem (side effects; root).

The node keeps **one** filesystem for the writable dirs of all its sandboxes (a "disk pool")
instead of one loop-mounted ext4 per sandbox (``scratchfs``): each sandbox gets a btrfs
subvolume of it, whose quota group (btrfs "simple quotas") caps the bytes it may hold, data
and metadata alike; past the cap writes fail with ``EDQUOT``. This is Docker's overlay2 on
XFS with ``pquota`` with a different kernel mechanism: this host's kernel is built without
``CONFIG_QFMT_V2`` (ext4 project quotas: "The kernel was not built with CONFIG_QUOTA and
CONFIG_QFMT_V2") and without ``CONFIG_XFS_QUOTA``, while btrfs quota groups are always built
with btrfs (``docs/disk-pool.md`` has the measurements).

Contract::

    format_image(image, size_bytes)        # once per node: mkfs.btrfs a sparse image
    mount_image(image, target) -> loop     # one loop device, quotas on
    still_attached(loop, image) -> bool    # is an unmounted instance not yet released?
    check_pool(dir)                        # a btrfs with quotas on, or RuntimeShimError
    create(pool, name, size_bytes) -> Path # a subvolume capped at size_bytes
    destroy(path) -> bool                  # delete a subvolume create made (idempotent)
    is_empty(pool) -> bool                 # no subvolume left
    quota_groups(pool) -> [(level, id)]    # the filesystem's quota groups (sysfs)
    sweep_groups(pool) -> int              # remove the groups of deleted subvolumes
    settle(pool, patience)                 # commit, wait for the cleaner (bounded), commit
    trim(pool) -> int | None               # FITRIM: punch the free space out of the image

The create path runs no program: five ioctls (subvolume, its id, a level-1 quota group, the
assignment, the limit), ~0.2 ms. ``destroy`` is one ioctl whatever the subvolume holds: the
kernel's cleaner thread frees its blocks afterwards, for the pool's next sandboxes. The sparse
image keeps the blocks written (measured: ``discard=async`` gave none back within 30 s), so
the host lends the pool at most its size, which the node reserved for it; ``settle`` then
``trim`` (``FITRIM``, the loop device punching each range out of the image) give them back,
which the node does when its pool empties. Quota groups: the kernel removes a deleted
subvolume's ``0/<id>`` once its cleaner has dropped it, ``destroy`` the ``1/<id>`` it can, and
``sweep_groups`` what is left; a subvolume id is reused once the pool is mounted again, so
``create`` replaces a left-over group of its id rather than inherit its limit or usage.

What the sandbox cannot do: change its cap or leave its quota group. The group is the
subvolume, not a per-file attribute (unlike a project id, which root in a container could
change with ``chattr -p`` on a file it owns): a file cannot be moved out of its subvolume
(``EXDEV``), the qgroup ioctls need ``CAP_SYS_ADMIN`` and overlayfs passes none of them
through, and the pool's mount is not in the sandbox's root.

Not capped per sandbox: the inode count (btrfs has no inode limit; every file's metadata is
charged to the quota group instead, ~350 bytes each measured, so a 1 GiB cap holds at most
~3M empty files, and the pool's inodes are not the host's). ``statfs`` in a sandbox reports
the pool's size and free space, not its own cap.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import struct
import time
from pathlib import Path

from envbuild.errors import RuntimeShimError
from envbuild.libc import function
from runtime_shim.isolation.mount import raw_mount
from runtime_shim.isolation.scratchfs import MOUNT_FLAGS, attach_loop, run_mkfs, sbin_tool

BTRFS_MAGIC = 0x9123683E
#: The inode number of every subvolume's root directory.
SUBVOL_ROOT_INO = 256
MIN_POOL = 1 << 30  # mkfs.btrfs's own minimum is ~110 MiB; a pool smaller than this is useless
#: Data and metadata in one profile each (one device: no DUP copies), no holes as extents.
MKFS_OPTIONS = ("-q", "-f", "-m", "single", "-d", "single", "-O", "no-holes")
#: discard=async: freed blocks may be punched out of the sparse image, in the kernel's time;
#: commit=: how long btrfs may batch metadata (a pool never has to survive a host crash).
MOUNT_DATA = b"discard=async,commit=60,nobarrier"

# ioctl numbers (linux/btrfs.h, magic 0x94): _IOW/_IOWR/_IOR(0x94, nr, struct)
_SUBVOL_CREATE = 0x5000940E  # _IOW(14, btrfs_ioctl_vol_args: s64 fd; char name[4088])
_SNAP_DESTROY = 0x5000940F  # _IOW(15, btrfs_ioctl_vol_args)
_QUOTA_CTL = 0xC0109428  # _IOWR(40, btrfs_ioctl_quota_ctl_args: u64 cmd, status)
_QGROUP_LIMIT = 0x8030942B  # _IOR(43, u64 qgroupid; btrfs_qgroup_limit: 5 x u64)
_QGROUP_ASSIGN = 0x40189429  # _IOW(41, u64 assign, src, dst)
_QGROUP_CREATE = 0x4010942A  # _IOW(42, u64 create, qgroupid)
_INO_LOOKUP = 0xD0009412  # _IOWR(18, u64 treeid, objectid; char name[4080])
_QUOTA_CTL_ENABLE_SIMPLE = 4
_LEVEL1 = 1 << 48  # a qgroup id is level << 48 | id
_CLEAR = (1 << 64) - 1  # a limit of this value removes the limit
_LIMIT_MAX_RFER, _LIMIT_MAX_EXCL = 1, 2
_VOL_ARGS = 4096
_NAME_MAX = 4087
_statfs = function("statfs", argtypes=[ctypes.c_char_p, ctypes.c_char_p])


def format_image(image: Path, size_bytes: int) -> None:
    """Make ``image`` a sparse file of ``size_bytes`` holding an empty btrfs (the only program
    this module runs, once per node)."""
    exe = sbin_tool("mkfs.btrfs", why=" (the sandbox disk pool is btrfs)",
                    hint="apt-get install btrfs-progs (scripts/setup.sh does), or "
                         "ENVBUILD_SANDBOX_DISK=loop for a loop disk per sandbox")
    run_mkfs([exe, *MKFS_OPTIONS], image, size_bytes, what="format the sandbox disk pool",
             hint="check ENVBUILD_DISK_POOL_SIZE (at least 1G)")


def mount_image(image: Path, target: Path) -> str:
    """Mount the btrfs in ``image`` at ``target`` (``nodev,nosuid,noatime``) on an autoclear
    loop device, which detaches when its filesystem is released, and turn its quotas on.
    Returns the device's name (``loop7``) for ``still_attached``."""
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        loop_fd, loop_dev = attach_loop(backing)
    finally:
        os.close(backing)
    try:
        if raw_mount(loop_dev.encode(), os.fsencode(target), b"btrfs", MOUNT_FLAGS,
                     MOUNT_DATA) != 0:
            err = ctypes.get_errno()
            raise RuntimeShimError(f"mount the sandbox disk pool at {target}: "
                                   f"{os.strerror(err)}", hint="check dmesg for 'BTRFS' lines")
    finally:
        os.close(loop_fd)  # the mount holds the device now; autoclear detaches it on unmount
    enable_quotas(target)
    return os.path.basename(loop_dev)


def still_attached(loop_name: str, image: Path) -> bool:
    """Whether the loop device ``loop_name`` still serves ``image``: the filesystem that was
    mounted from it is not released yet, although unmounted here (a dying container's mount
    namespace may hold it a moment longer). Mounting the image again then would give two live
    instances of one btrfs writing one file (the older one's last commit undoing the newer's
    work, measured: a deleted subvolume came back)."""
    try:
        with open(f"/sys/block/{loop_name}/loop/backing_file") as f:
            return f.read().strip() == os.fspath(image)
    except OSError:
        return False


def enable_quotas(pool: Path) -> None:
    """Turn btrfs simple quotas on for the filesystem of ``pool`` (a no-op when they are)."""
    fd = os.open(pool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _QUOTA_CTL, bytearray(struct.pack("=QQ", _QUOTA_CTL_ENABLE_SIMPLE, 0)))
    except OSError as e:
        raise RuntimeShimError(f"enable quotas on the sandbox disk pool {pool}: {e.strerror}",
                               hint="the kernel needs btrfs simple quotas (>= 6.7)") from None
    finally:
        os.close(fd)


def check_pool(pool: Path) -> None:
    """``RuntimeShimError`` with a hint unless ``pool`` is a directory on btrfs (an operator's
    ``ENVBUILD_DISK_POOL_DIR``; whether its quotas are on shows at the first ``create``)."""
    try:
        magic = _fs_type(pool)
    except OSError as e:
        raise RuntimeShimError(f"sandbox disk pool {pool}: {e.strerror}",
                               hint="ENVBUILD_DISK_POOL_DIR must name an existing directory"
                               ) from None
    if magic != BTRFS_MAGIC:
        raise RuntimeShimError(
            f"sandbox disk pool {pool} is not on btrfs (filesystem type {magic:#x}): per-"
            "sandbox disk caps need btrfs quota groups",
            hint="mkfs.btrfs a device, mount it, `btrfs quota enable --simple` it and name a "
                 "dir of it in ENVBUILD_DISK_POOL_DIR; or unset it (the node makes its own pool)")


def create(pool: Path, name: str, size_bytes: int) -> Path:
    """A new subvolume ``pool/name`` capped at ``size_bytes`` (data and metadata) by a quota
    group of level 1 holding it, ``1/<its id>``: a subvolume made inside it (which needs no
    capability) joins that group too (simple quotas' auto-inherit), where it would have a
    group of its own, uncapped, if the cap were on the subvolume's own ``0/<id>``. On failure
    nothing is left."""
    if not name or "/" in name or len(name.encode()) > _NAME_MAX:
        raise RuntimeShimError(f"not a subvolume name: {name!r}")
    fd = os.open(pool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.ioctl(fd, _SUBVOL_CREATE, _vol_args(name))
        except OSError as e:
            raise RuntimeShimError(f"create subvolume {name} in the sandbox disk pool {pool}: "
                                   f"{e.strerror}", hint=_hint(e)) from None
    finally:
        os.close(fd)
    path = pool / name
    try:
        set_limit(path, size_bytes)
    except BaseException:
        destroy(path)
        raise
    return path


def set_limit(subvolume: Path, size_bytes: int) -> None:
    """Put ``subvolume`` in a quota group ``1/<its id>`` capped at ``size_bytes``."""
    fd = os.open(subvolume, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sid = _subvolume_id(fd)
        group = _LEVEL1 | sid
        try:
            fcntl.ioctl(fd, _QGROUP_CREATE, bytearray(struct.pack("=QQ", 1, group)))
        except FileExistsError:
            # a deleted subvolume's group, its id reused (ids restart after the highest root
            # left when the pool is mounted again): never inherit its limit or its usage
            fcntl.ioctl(fd, _QGROUP_CREATE, bytearray(struct.pack("=QQ", 0, group)))
            fcntl.ioctl(fd, _QGROUP_CREATE, bytearray(struct.pack("=QQ", 1, group)))
        fcntl.ioctl(fd, _QGROUP_ASSIGN, bytearray(struct.pack("=QQQ", 1, sid, group)))
        _limit(fd, group, size_bytes)
    except OSError as e:
        raise RuntimeShimError(f"cap {subvolume} at {size_bytes} bytes: {e.strerror}",
                               hint=_hint(e)) from None
    finally:
        os.close(fd)


def destroy(path: Path) -> bool:
    """Delete the subvolume at ``path`` with everything in it (one ioctl; the kernel frees the
    blocks in the background). False if ``path`` is gone; ``RuntimeShimError`` if it is
    something else than a btrfs subvolume root (never deleted as a tree here)."""
    try:
        st = os.lstat(path)
        magic = _fs_type(path)
    except FileNotFoundError:
        return False
    if magic != BTRFS_MAGIC or st.st_ino != SUBVOL_ROOT_INO or not os.path.isdir(path):
        raise RuntimeShimError(f"{path} is not a subvolume of a sandbox disk pool",
                               hint="remove it by hand once you know what it is")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sid = _subvolume_id(fd)
        # a deletion reserves metadata in the group: a full one would refuse it (EDQUOT)
        with contextlib.suppress(OSError):
            _limit(fd, _LEVEL1 | sid, _CLEAR)
    finally:
        os.close(fd)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.ioctl(fd, _SNAP_DESTROY, _vol_args(path.name))
        except OSError as e:
            if e.errno != errno.ENOTEMPTY:
                raise
            _destroy_nested(path)  # only a sandbox whose seccomp profile allowed making them
            fcntl.ioctl(fd, _SNAP_DESTROY, _vol_args(path.name))
        _drop_group(fd, sid)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise RuntimeShimError(f"delete subvolume {path}: {e.strerror}",
                               hint="`findmnt -R` for mounts still under it") from None
    finally:
        os.close(fd)
    return True


def _limit(fd: int, group: int, size_bytes: int) -> None:
    fcntl.ioctl(fd, _QGROUP_LIMIT, bytearray(struct.pack(
        "=QQQQQQ", group, _LIMIT_MAX_RFER | _LIMIT_MAX_EXCL, size_bytes, size_bytes, 0, 0)))


def _destroy_nested(path: Path) -> None:
    """Delete the subvolumes below the subvolume ``path``, deepest first (a walk of its tree:
    the default seccomp profiles refuse making them, so this runs only for custom ones)."""
    found: list[Path] = []
    stack = [path]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    child = Path(entry.path)
                    if entry.stat(follow_symlinks=False).st_ino == SUBVOL_ROOT_INO:
                        found.append(child)
                    stack.append(child)
    for nested in reversed(found):
        fd = os.open(nested.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _SNAP_DESTROY, _vol_args(nested.name))
        finally:
            os.close(fd)


def _drop_group(fd: int, sid: int) -> None:
    """Remove the level-1 group of the deleted subvolume ``sid`` if the kernel lets it go now
    (its members leave when the cleaner has dropped them; a group left behind holds a few
    bytes of the quota tree and no limit on anyone)."""
    group = _LEVEL1 | sid
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, _QGROUP_ASSIGN, bytearray(struct.pack("=QQQ", 0, sid, group)))
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, _QGROUP_CREATE, bytearray(struct.pack("=QQ", 0, group)))


def _subvolume_id(fd: int) -> int:
    """The id of the subvolume holding the open directory ``fd``."""
    args = bytearray(_VOL_ARGS)
    struct.pack_into("=QQ", args, 0, 0, SUBVOL_ROOT_INO)
    fcntl.ioctl(fd, _INO_LOOKUP, args)
    return struct.unpack_from("=Q", args)[0]


def _vol_args(name: str) -> bytearray:
    """``struct btrfs_ioctl_vol_args`` naming ``name`` (fd 0)."""
    args = bytearray(_VOL_ARGS)
    args[8:8 + len(name.encode())] = name.encode()
    return args


def is_empty(pool: Path) -> bool:
    """No entry left in ``pool`` (reads at most one)."""
    with contextlib.suppress(FileNotFoundError), os.scandir(pool) as it:
        return next(it, None) is None
    return True


def _fs_type(path: Path) -> int:
    """The filesystem magic of ``path`` (``statfs(2)``'s ``f_type``; Python's ``statvfs``
    has none)."""
    buf = ctypes.create_string_buffer(120)  # struct statfs on 64-bit: f_type first
    if _statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return struct.unpack_from("=q", buf.raw)[0] & 0xFFFFFFFF


def _hint(e: OSError) -> str:
    if e.errno == errno.ENOTCONN:
        return "quotas are off on that btrfs: `btrfs quota enable --simple DIR`"
    if e.errno == errno.ENOTTY:
        return "the pool is not on btrfs (ENVBUILD_DISK_POOL_DIR)"
    return "check dmesg for 'BTRFS' lines"


#: Where the kernel shows a btrfs filesystem's quota groups (``<fsid>/qgroups/<level>_<id>``).
SYSFS_BTRFS = Path("/sys/fs/btrfs")
_FS_INFO = 0x8400941F  # _IOR(31, btrfs_ioctl_fs_info_args: u64 max_id, num_devices; u8 fsid[16]…)
_SYNC = 0x9408  # _IO(8): commit the running transaction (and wake the cleaner)
_SUBVOL_SYNC_WAIT = 0x40109441  # _IOW(65, u64 subvolid; u32 mode, count), kernel >= 6.8
_SYNC_COUNT = 2  # BTRFS_SUBVOL_SYNC_COUNT: how many deleted subvolumes the cleaner has left
_FITRIM = 0xC0185879  # _IOWR('X', 121, struct fstrim_range: u64 start, len, minlen)
#: The top-level subvolume's group; every other one of a node's pool is a sandbox's.
_TOP_GROUP = (0, 5)


def group_usage(subvolume: Path) -> tuple[int, int | None]:
    """(bytes charged, cap) of the quota group ``create`` capped ``subvolume`` with
    (``1/<its id>``: data and metadata, nested subvolumes too), as the kernel's sysfs shows it;
    the cap is None when the group has none."""
    fd = os.open(subvolume, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sid = _subvolume_id(fd)
        group = _qgroups_dir(fd) / f"1_{sid}"
    except OSError as e:
        raise RuntimeShimError(f"read the quota group of {subvolume}: {e.strerror}") from None
    finally:
        os.close(fd)
    used = int((group / "referenced").read_text())
    limit = int((group / "max_referenced").read_text())
    return used, (limit if 0 < limit < _CLEAR else None)


def _qgroups_dir(fd: int) -> Path:
    """The sysfs dir of the quota groups of the btrfs holding the open ``fd``."""
    info = bytearray(1024)
    fcntl.ioctl(fd, _FS_INFO, info)
    fsid = bytes(info[16:32]).hex()
    uuid = f"{fsid[:8]}-{fsid[8:12]}-{fsid[12:16]}-{fsid[16:20]}-{fsid[20:]}"
    return SYSFS_BTRFS / uuid / "qgroups"


def quota_groups(pool: Path) -> list[tuple[int, int]]:
    """The quota groups of the btrfs holding ``pool``, as (level, id), sorted (one sysfs
    listing: the kernel's own view, which drops a deleted subvolume's ``0/<id>`` itself once
    its cleaner has freed the subvolume)."""
    fd = os.open(pool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = os.listdir(_qgroups_dir(fd))
    finally:
        os.close(fd)
    found = []
    for name in names:
        level, _, gid = name.partition("_")
        if level.isdigit() and gid.isdigit():
            found.append((int(level), int(gid)))
    return sorted(found)


def sweep_groups(pool: Path) -> int:
    """Remove the quota groups of subvolumes no longer in ``pool`` (the node's own pool, whose
    every subvolume is a sandbox's: never an operator's); returns how many are left for a later
    sweep. ``destroy`` removes a subvolume's ``1/<id>`` itself, unless a nested subvolume (or a
    crash) kept it; a ``0/<id>`` goes only once the kernel's cleaner has dropped its subvolume
    (``EBUSY`` before; the kernel then removes it itself), so level-0 groups are swept only when
    the pool holds no subvolume, and never those of a live sandbox's nested ones. Reads the
    pool's entries: call it where the pool opens or empties, never on the create path."""
    live = set()
    with os.scandir(pool) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False) and entry.inode() == SUBVOL_ROOT_INO:
                fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    live.add(_subvolume_id(fd))
                finally:
                    os.close(fd)
    stale = [(level, gid) for level, gid in quota_groups(pool)
             if (level, gid) != _TOP_GROUP and gid not in live and (level == 1 or not live)]
    left = 0
    fd = os.open(pool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for level, gid in sorted(stale, reverse=True):  # level 1 first: it may hold a 0/<id>
            group = (level << 48) | gid
            if level == 1:
                with contextlib.suppress(OSError):
                    fcntl.ioctl(fd, _QGROUP_ASSIGN, bytearray(struct.pack("=QQQ", 0, gid, group)))
            try:
                fcntl.ioctl(fd, _QGROUP_CREATE, bytearray(struct.pack("=QQ", 0, group)))
            except OSError as e:
                left += e.errno != errno.ENOENT  # EBUSY: not dropped yet, or a member left
    finally:
        os.close(fd)
    return left


def settle(pool: Path, patience: float) -> None:
    """Commit the pool's transaction, wait up to ``patience`` seconds for the kernel's cleaner
    to drop its deleted subvolumes, and commit again, so the blocks they held are free (for
    ``trim``) and their ``0/<id>`` groups gone. A kernel without ``SUBVOL_SYNC_WAIT`` (< 6.8)
    waits for nothing."""
    fd = os.open(pool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _SYNC)
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            args = bytearray(struct.pack("=QII", 0, _SYNC_COUNT, 0))
            try:
                fcntl.ioctl(fd, _SUBVOL_SYNC_WAIT, args)
            except OSError:
                break
            if struct.unpack_from("=QII", args)[2] == 0:
                break
            time.sleep(0.005)
        fcntl.ioctl(fd, _SYNC)
    finally:
        os.close(fd)


def trim(pool: Path) -> int | None:
    """Discard the free space of the pool's filesystem (``FITRIM``, what ``fstrim`` does): its
    loop device punches each discarded range out of the sparse image, so the host gets back
    what deleted subvolumes held. Returns the bytes trimmed (the kernel's count, free space
    already trimmed included), None if the device takes no discards."""
    fd = os.open(pool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        span = bytearray(struct.pack("=QQQ", 0, _CLEAR, 0))
        try:
            fcntl.ioctl(fd, _FITRIM, span)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOTTY):
                return None
            raise RuntimeShimError(f"trim the sandbox disk pool {pool}: {e.strerror}",
                                   hint="check dmesg for 'BTRFS' lines") from None
        return struct.unpack_from("=QQQ", span)[1]
    finally:
        os.close(fd)
