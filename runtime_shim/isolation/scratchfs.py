"""Size- and inode-capped scratch filesystems (side effects; needs root).

One mechanism for every place untrusted code writes to host disk: a sandbox's writable layer
(overlay upper + work), its ``/tmp`` and agent run dir, and a build step's upper dir. Each gets
its own ext4 filesystem in a sparse image file on a loop device, so a runaway writer gets
``ENOSPC`` at ``size_bytes`` (or when ``inodes`` are used up) instead of filling the host.
The host's filesystem (ext4 without project quotas here) cannot cap a directory itself.

Contract::

    create(dir, size_bytes, inodes, template_root=...) -> Path   # the mounted filesystem
    destroy(dir)                                                  # unmount, detach, delete

``dir`` is an existing directory owned by the caller (a sandbox or build scratch dir).
``create`` makes ``dir/disk.img``, mounts it at ``dir/disk`` (returned; an empty ext4 root
holding only ``lost+found``) and unlinks the image (``losetup -a`` shows it ``(deleted)``: its
space is freed when the loop device detaches); ``destroy`` unmounts ``dir/disk`` and deletes
an image left by a create that failed. ``destroy`` is idempotent and is what a crashed
creator's cleanup (``gc_sandboxes``) calls too.

How (measured in ``docs/scratchfs.md``; each choice for start-up time and for leaving nothing
behind):

- The image is a copy of a template formatted once per node and (size, inodes) under
  ``template_root`` (``ext4-v1-<size>-<inodes>.img``): copying a ~1 MB-of-data sparse file
  (``SEEK_DATA``/``SEEK_HOLE`` + ``copy_file_range``) costs ~1-2 ms where ``mkfs.ext4`` costs
  ~20-60 ms. mkfs options: no journal (a scratch disk never outlives a crash), ``-m 0``,
  ``lazy_itable_init`` and ``nodiscard``; mounted with ``noinit_itable`` so the kernel never
  zeroes the inode tables in the background (that would write 256 bytes per inode to the host:
  holes read as zero already).
- The loop device is bound with ``LOOP_CONFIGURE`` and ``LO_FLAGS_AUTOCLEAR`` in one ioctl:
  the kernel detaches it when the last of its fd (held by the creating process, closed by
  ``destroy`` on a thread or at process exit) and its mount is gone, so no ``losetup -d``
  can be forgotten, also by a creator that crashes.
- Mount options ``noinit_itable,nobarrier``: no background inode-table zeroing, no cache
  flushes (each an fsync of the image on the host).
- Mounted ``nodev,nosuid,noatime`` (a build's: ``noatime`` only, see ``create``). Every copy
  of a template shares its UUID; nothing here looks filesystems up by UUID.

The sandbox cannot reach the loop device or the image (no device nodes, neither path is inside
its root): it only writes through the filesystem, so the host kernel's ext4 driver never reads
a crafted image (the microVM backend, whose guest writes raw blocks, reads its disk on the
host with fuse2fs instead).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from envbuild.errors import RuntimeShimError
from runtime_shim.isolation.lifecycle import exiting
from runtime_shim.isolation.mount import raw_mount, unmount

#: Bumped when the template's mkfs options change (a template of an older version is ignored).
TEMPLATE_VERSION = 1
IMAGE_NAME = "disk.img"
MOUNT_NAME = "disk"
MIN_SIZE = 16 << 20  # ext4 needs a few MB of metadata; smaller disks are refused
#: mkfs refuses inode tables that do not fit; 256-byte inodes at this ratio take 1/32 of the disk.
MIN_BYTES_PER_INODE = 8192

MKFS_OPTIONS = ("-q", "-F", "-t", "ext4", "-b", "4096", "-m", "0",
                "-O", "^has_journal,^resize_inode",
                "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard")
MS_NOATIME = 0x400
MOUNT_FLAGS = 0x2 | 0x4 | MS_NOATIME  # MS_NOSUID | MS_NODEV
# nobarrier: no cache flushes to the loop device (each one an fsync of the image on the host's
# filesystem); a scratch disk never has to survive a crash.
MOUNT_DATA = b"noinit_itable,nobarrier"

# Loop device fds of the disks this process mounted (mount path -> fd), and the threads
# closing those destroy() let go of (see destroy).
_held: dict[str, int] = {}
_releasing: set[threading.Thread] = set()
_held_lock = threading.Lock()

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4
# The loop device reads and writes its image with O_DIRECT: without it every block the sandbox
# writes is cached twice, by its ext4 (charged to its memory cgroup, which reclaim can take
# back) and as the image file's pages on the host (charged to no sandbox; measured: 300 MB
# written, 634 MB of host page cache). Issue 19.
_LO_FLAGS_DIRECT_IO = 16
# struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
# loop_info64: 5 u64, 4 u32 (lo_flags last), 64 + 64 + 32 bytes of names/key, 2 u64.
_LOOP_CONFIG = struct.Struct("=II QQQQQ IIII 64s64s32s QQ 64x")


def create(dir: str | os.PathLike[str], size_bytes: int, inodes: int | None, *,
           template_root: str | os.PathLike[str], nodev_nosuid: bool = True) -> Path:
    """Mount a fresh ext4 of ``size_bytes`` with ``inodes`` inodes (None: mkfs's default
    ratio, one per 16 KiB; at most one per ``MIN_BYTES_PER_INODE``, which is what an inode
    limit beyond that gets) at ``dir/disk`` and return that path. On failure nothing is left
    mounted, attached or written (the image is removed).

    ``nodev_nosuid=False`` is for build scratch only: an importer on the host (debootstrap)
    makes device nodes and setuid files in the upper dir and runs them (chroot + dpkg)."""
    if size_bytes < MIN_SIZE:
        raise RuntimeShimError(f"disk limit {size_bytes} bytes is below the minimum "
                               f"{MIN_SIZE >> 20} MiB", hint="raise Limits.disk_bytes")
    root = Path(dir)
    image, target = root / IMAGE_NAME, root / MOUNT_NAME
    inodes = effective_inodes(size_bytes, inodes)
    template = ensure_template(template_root, size_bytes, inodes)
    target.mkdir(exist_ok=True)
    try:
        copy_sparse(template, image)
        loop_fd = _mount_image(image, target, MOUNT_FLAGS if nodev_nosuid else MS_NOATIME)
        with _held_lock:
            _held[str(target)] = loop_fd
        # The loop device holds the image open: without a name, the kernel frees it when the
        # loop device detaches; a crash can no longer leave an image behind, only the mount,
        # which every cleanup unmounts.
        os.unlink(image)
    except BaseException:
        destroy(root)
        raise
    return target


def destroy(dir: str | os.PathLike[str]) -> None:
    """Unmount ``dir/disk`` (lazily if busy: the loop device then detaches when the last user
    goes) and delete the image. Idempotent; a missing disk is fine.

    In the process that created the disk, the unmount leaves the loop device to this
    process's fd, whose close (where the kernel detaches the device and frees the image) runs
    on a daemon thread: it waits for an RCU grace period, ~3 ms on a quiet host and 50 ms on a
    loaded one. ``settle()`` waits for those closes; process exit does them too. While the
    interpreter exits (``runtime_shim.isolation.lifecycle.exiting``), the close runs in the caller."""
    root = Path(dir)
    target = str(root / MOUNT_NAME)
    try:
        unmount(target)
    finally:
        with _held_lock:
            loop_fd = _held.pop(target, None)
        if loop_fd is not None:
            _release(loop_fd)
    with contextlib.suppress(OSError):  # not empty: not ours to judge, the caller removes it
        os.rmdir(root / MOUNT_NAME)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / IMAGE_NAME)


def settle(timeout: float | None = None) -> None:
    """Wait until the loop devices ``destroy`` let go of in this process are detached."""
    with _held_lock:
        pending = list(_releasing)
    for t in pending:
        t.join(timeout)


def _release(loop_fd: int) -> None:
    if exiting():  # a thread started now may never run, and its start would wait forever
        os.close(loop_fd)
        return

    def close() -> None:
        try:
            os.close(loop_fd)
        finally:
            with _held_lock:
                _releasing.discard(threading.current_thread())

    t = threading.Thread(target=close, name="scratchfs-detach", daemon=True)
    with _held_lock:
        _releasing.add(t)
    t.start()


def effective_inodes(size_bytes: int, inodes: int | None) -> int | None:
    """The inode count a disk of ``size_bytes`` gets for a limit of ``inodes`` (pure): at most
    one per ``MIN_BYTES_PER_INODE`` bytes, at least 64."""
    if inodes is None:
        return None
    return max(64, min(inodes, size_bytes // MIN_BYTES_PER_INODE))


def is_mounted(dir: str | os.PathLike[str]) -> bool:
    return os.path.ismount(Path(dir) / MOUNT_NAME)


def template_path(template_root: str | os.PathLike[str], size_bytes: int,
                  inodes: int | None) -> Path:
    return Path(template_root) / (f"ext4-v{TEMPLATE_VERSION}-{size_bytes}-"
                                  f"{'auto' if inodes is None else inodes}.img")


def ensure_template(template_root: str | os.PathLike[str], size_bytes: int,
                    inodes: int | None) -> Path:
    """The formatted, empty, sparse template for (size, inodes), made once (atomically: made
    beside and renamed, so concurrent creators at worst both format one)."""
    path = template_path(template_root, size_bytes, inodes)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        mkfs(tmp, size_bytes, inodes)
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)  # a template that a host crash truncated would fail every mount
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def mkfs(path: Path, size_bytes: int, inodes: int | None) -> None:
    """Format a sparse ext4 image of ``size_bytes`` at ``path``."""
    exe = sbin_tool("mkfs.ext4", hint="apt-get install e2fsprogs (or run scripts/setup.sh)")
    run_mkfs([exe, *MKFS_OPTIONS, *(("-N", str(inodes)) if inodes is not None else ())], path,
             size_bytes, what=f"format a {size_bytes >> 20} MiB scratch disk",
             hint="check Limits.disk_bytes / inodes")


def sbin_tool(name: str, *, hint: str, why: str = "") -> str:
    """The path of the program ``name`` on PATH, else in ``/usr/sbin`` or ``/sbin`` (where mkfs
    tools live, off a non-root PATH); ``RuntimeShimError`` "NAME is not installed" + ``why``,
    with ``hint``, if there is none."""
    exe = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if exe is None:
        raise RuntimeShimError(f"{name} is not installed{why}", hint=hint)
    return exe


def run_mkfs(argv: Sequence[str], image: Path, size_bytes: int, *, what: str, hint: str
             ) -> None:
    """Make ``image`` a sparse file of ``size_bytes`` and format it with ``argv`` (a mkfs
    program and its options; the image's path is appended). A failure is a
    ``RuntimeShimError`` "WHAT: PROGRAM exited N" with the argv and the tail of its stderr."""
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    argv = [*argv, str(image)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeShimError(f"{what}: {os.path.basename(argv[0])} exited {proc.returncode}",
                               context=f"$ {' '.join(argv)}\n{proc.stderr[-2000:]}",
                               hint=hint)


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each data region of the open file ``fd`` below ``size``, in
    order (``SEEK_DATA``/``SEEK_HOLE``): what a sparse copy or digest reads, holes skipped."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole after pos
                return
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            return
        yield start, end
        pos = end


def copy_sparse(src: Path, dest: Path) -> None:
    """Copy ``src`` to a new file ``dest`` keeping its holes: only the data extents are copied
    (``SEEK_DATA``/``SEEK_HOLE``, in-kernel ``copy_file_range``)."""
    with open(src, "rb") as fin, open(dest, "xb") as fout:
        size = os.fstat(fin.fileno()).st_size
        fout.truncate(size)
        for start, end in data_extents(fin.fileno(), size):
            off = start
            while off < end:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), end - off, off, off)
                if n == 0:
                    raise RuntimeShimError(f"copy {src.name}: unexpected end of file")
                off += n


def copy_capped(read_fd: int, out: BinaryIO, cap: int) -> None:
    """Copy ``read_fd`` to ``out`` until EOF, at most ``cap`` bytes of it (then a note, and the
    rest is read and dropped so the writer never blocks), flushing as it goes; close both.
    For the logs an untrusted writer fills on the host outside its disk: a build step's
    output, a microVM's console."""
    written = 0
    try:
        while chunk := os.read(read_fd, 1 << 16):
            if written < cap:
                out.write(chunk[:cap - written])
                written += len(chunk)
                if written >= cap:
                    out.write(f"\n[envbuild: output past {cap >> 10} KiB dropped]\n".encode())
                out.flush()
    finally:
        os.close(read_fd)
        out.close()


def _mount_image(image: Path, target: Path, flags: int = MOUNT_FLAGS) -> int:
    """Mount ``image`` at ``target`` on a new autoclear loop device; return the device's fd
    (the device detaches when the fd and the mount are both gone)."""
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        loop_fd, loop_dev = attach_loop(backing)
    finally:
        os.close(backing)
    if raw_mount(loop_dev.encode(), str(target).encode(), b"ext4", flags, MOUNT_DATA) != 0:
        err = ctypes.get_errno()
        os.close(loop_fd)
        raise RuntimeShimError(f"mount the scratch disk at {target}: {os.strerror(err)}",
                               hint="check dmesg for 'EXT4-fs' lines")
    return loop_fd


def attach_loop(backing_fd: int) -> tuple[int, str]:
    """A free loop device bound to ``backing_fd`` with autoclear; returns (its fd, its path).
    Another process may take the device LOOP_CTL_GET_FREE returned before we bind it: retry."""
    config = _LOOP_CONFIG.pack(backing_fd, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                               _LO_FLAGS_AUTOCLEAR | _LO_FLAGS_DIRECT_IO, b"", b"", b"", 0, 0)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise RuntimeShimError(f"open /dev/loop-control: {e.strerror}",
                               hint="scratch disks need root and the loop module "
                                    "(modprobe loop)") from None
    try:
        for _ in range(64):
            number = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
            dev = f"/dev/loop{number}"
            try:
                fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:  # devtmpfs has not made the node yet
                continue
            try:
                fcntl.ioctl(fd, _LOOP_CONFIGURE, config)
                return fd, dev
            except OSError as e:
                os.close(fd)
                if e.errno != errno.EBUSY:
                    raise RuntimeShimError(f"attach {dev}: {e.strerror}",
                                           hint="the kernel needs LOOP_CONFIGURE (>= 5.8)"
                                           ) from None
        raise RuntimeShimError("no free loop device after 64 tries",
                               hint="losetup -a lists them; raise max_loop")
    finally:
        os.close(ctl)

