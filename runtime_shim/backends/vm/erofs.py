"""Layers as block devices: one read-only EROFS image per layer digest, and a writable disk.

``ensure_erofs(node_root, digest, layer_dir)`` turns the node cache's unpacked layer (already
overlay-ready: OCI whiteouts are 0/0 character devices, opaque dirs carry
``trusted.overlay.opaque=y``) into ``<node_root>/erofs/<hex>.erofs`` once per host, under an
flock, written beside and renamed into place, and shared read-only by every VM. Its length is
padded (sparsely, with zeros EROFS never reads) to a multiple of ``IMAGE_ALIGN`` so the same
file can back a virtio-pmem device (``runtime_shim.backends.vm.qemu.Pmem``); the padding is no part of
any digest (images are named by their layer's digest, and a layer's digest is of its blob). mkfs.erofs keeps
device nodes and, with its default xattr tolerance, every xattr including ``trusted.*``, so the
guest's overlayfs honours both kinds of whiteout (``tests/integration/test_microvm.py`` checks
this on a real image). Images are uncompressed: under TCG the guest CPU is the scarce resource.

``make_writable_disk(path, size)`` makes a sparse ext4 image (no journal: a sandbox disk is
disposable) with the overlay's ``upper/`` and ``work/`` and its bottom layer ``stub/`` (the
mount points every root needs) at its root, made by ``mkfs.ext4 -d`` rather than by the guest
(each ``mkdir`` there is a process, ~3 ms under TCG); the host later mounts the image
read-only and packs ``upper/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from envbuild.errors import RuntimeShimError
from envbuild.safefs import remove_tree
from envbuild.store import check_digest

EROFS_DIR = "erofs"
#: Image lengths are multiples of this (the virtio-pmem mapping granularity, qemu.PMEM_ALIGN).
IMAGE_ALIGN = 2 << 20
#: ``-x2`` is mkfs.erofs's default tolerance (xattrs kept, shared when used often); spelled
#: out because dropping xattrs (``-x-1``) would silently break opaque dirs.
MKFS_EROFS_ARGS = ("-x2",)


def erofs_path(node_root: str | os.PathLike[str], digest: str) -> Path:
    return Path(node_root) / EROFS_DIR / f"{check_digest(digest).removeprefix('sha256:')}.erofs"


def ensure_erofs(node_root: str | os.PathLike[str], digest: str, layer_dir: Path) -> Path:
    """The EROFS image of layer ``digest``, made from its unpacked ``layer_dir`` if missing."""
    target = erofs_path(node_root, digest)
    with contextlib.suppress(OSError):
        if target.stat().st_size % IMAGE_ALIGN == 0:
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(target.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if not target.is_file():
            _mkfs_erofs(layer_dir, target)
        else:  # made before images were padded: extend it in place (content unchanged)
            size = target.stat().st_size
            os.truncate(target, size + (-size % IMAGE_ALIGN))
    finally:
        os.close(lock_fd)
    return target


def _mkfs_erofs(src: Path, target: Path) -> None:
    mkfs = _tool("mkfs.erofs", "erofs-utils")
    tmp = target.with_name(f".{target.stem[:12]}-{uuid.uuid4().hex[:8]}.erofs")
    argv = [mkfs, "--quiet", *MKFS_EROFS_ARGS, str(tmp), str(src)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not tmp.is_file():
            raise RuntimeShimError(f"make the EROFS image of {target.stem[:12]}: mkfs.erofs "
                                   f"exited {proc.returncode}",
                                   context=f"$ {' '.join(argv)}\n{proc.stderr[-2000:]}")
        size = tmp.stat().st_size
        os.truncate(tmp, size + (-size % IMAGE_ALIGN))  # sparse zeros: see the docstring
        os.chmod(tmp, 0o444)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


#: The writable disk's directories (``make_writable_disk``) and their modes.
WRITABLE_DISK_DIRS = (("upper", 0o755), ("work", 0o755), ("stub", 0o755), ("stub/proc", 0o755),
                      ("stub/sys", 0o755), ("stub/dev", 0o755), ("stub/tmp", 0o1777),
                      ("stub/run", 0o755), ("stub/.envbuild", 0o755))


def make_writable_disk(path: Path, size_bytes: int, inodes: int | None = None) -> None:
    """A sparse ext4 image of ``size_bytes`` with ``inodes`` inodes (None: mkfs's default
    ratio) at ``path`` holding ``WRITABLE_DISK_DIRS`` (mkfs.ext4 -q -F -d)."""
    mkfs = _tool("mkfs.ext4", "e2fsprogs")
    with open(path, "wb") as f:
        f.truncate(size_bytes)
    template = path.with_name(f".{path.name}-{uuid.uuid4().hex[:8]}.d")
    try:
        template.mkdir()
        for name, mode in WRITABLE_DISK_DIRS:
            (template / name).mkdir()
            os.chmod(template / name, mode)  # mkdir's mode is masked by the umask
        # No journal and lazy init: mkfs then writes ~1 MB whatever the size.
        argv = [mkfs, "-q", "-F", "-O", "^has_journal", "-E",
                "lazy_itable_init=1,lazy_journal_init=1,nodiscard", "-m", "0",
                *(("-N", str(inodes)) if inodes is not None else ()),
                "-d", str(template), str(path)]
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    finally:
        with contextlib.suppress(OSError):
            remove_tree(template)
    if proc.returncode != 0:
        raise RuntimeShimError(f"make the writable disk {path.name}: mkfs.ext4 exited "
                               f"{proc.returncode}",
                               context=f"$ {' '.join(argv)}\n{proc.stderr[-2000:]}")


def _tool(name: str, package: str) -> str:
    path = shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}")
                                  else None) or (f"/sbin/{name}" if os.path.exists(f"/sbin/{name}") else None)
    if path is None:
        raise RuntimeShimError(f"{name} is not installed",
                               hint=f"apt-get install {package} (or run scripts/setup.sh)")
    return path
