"""The node's tree tmpfs (``<node>/meta/trees``), which holds the native layers' metadata
trees (``nativetree``): mounting it, the lock ordering its users, mounting a tree's read-only
overlay over the object store, and unmounting the tmpfs once no tree is left."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import threading
from collections.abc import Iterator

from envbuild import libc

_MS_RDONLY = 1
_MS_NODEV = 4
#: ``<node>/meta/trees``: the tmpfs holding every meta tree of the node (inodes only).
TREES = "trees"
#: Its bounds: no file has data (sparse), so ``size`` only caps directories and xattrs;
#: ``nr_inodes`` caps the node's meta entries (~1 KiB of kernel memory each).
TREES_OPTIONS = "mode=0700,size=64m,nr_inodes=1000000"
_mount = libc.function("mount", argtypes=[ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                         ctypes.c_ulong, ctypes.c_char_p])


def mount_generation(tree: str, data: str, target: str) -> None:
    """Mount ``target``: a read-only overlay of the metadata tree ``tree`` with ``data`` (the
    object store) as its data-only lower layer, following metacopy redirects."""
    for p in (tree, data):
        if any(c in p for c in ":,\\"):
            raise OSError(f"meta layer path has a ':' ',' or '\\': {p}")
    opts = f"lowerdir={tree}::{data},metacopy=on,redirect_dir=follow,xino=off"
    if _mount(b"overlay", target.encode(), b"overlay", _MS_RDONLY, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount meta layer {target}: {os.strerror(err)}")


_trees_lock = threading.Lock()


def _ensure_trees(meta: str) -> None:
    """Mount the node's tree tmpfs at ``<node>/meta/trees`` unless it is. Why tmpfs: a tree
    is only inodes (sparse files, xattrs, no data) and creating inodes on the node's disk
    took ~1-2 ms each on this host's busy ext4 (2.6 s of 3.5 s for 1,111 files in ``open``
    and ``mkdir``); on tmpfs a few µs. Bounded: ``TREES_OPTIONS``."""
    trees = os.path.join(meta, TREES)
    with _trees_lock, _layer_flock(os.path.dirname(meta), "trees"):
        if _is_mount(trees):
            return
        os.makedirs(trees, mode=0o700, exist_ok=True)
        if _mount(b"envbuild-meta", trees.encode(), b"tmpfs", _MS_NODEV,
                       TREES_OPTIONS.encode()) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount tmpfs at {trees}: {os.strerror(err)}")


def _mountinfo() -> list[tuple[str, str]]:
    """(mount point, super options) of every mount of this namespace."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if " - " not in line:
                continue
            tail = line.split(" - ", 1)[1].split()
            out.append((fields[4].replace("\\040", " "), tail[2] if len(tail) > 2 else ""))
    return out


@contextlib.contextmanager
def _layer_flock(node_root: str, hexd: str, *, shared: bool = False) -> Iterator[None]:
    """``<node>/locks/<hex>.meta.lock``: the builds of one layer's tree, and the tmpfs's
    mount and unmount (``trees``), one at a time across processes."""
    import fcntl

    locks = os.path.join(node_root, "locks")
    os.makedirs(locks, exist_ok=True)
    fd = os.open(os.path.join(locks, f"{hexd}.meta.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _is_mount(path: str) -> bool:
    return any(point == path for point, _ in _mountinfo())


def release_trees(node_root: str | os.PathLike[str]) -> None:
    """Once no native layer's tree is left (``node gc``): unmount the tree tmpfs and remove
    ``<node>/meta``."""
    meta = os.path.join(os.fspath(node_root), "meta")
    trees = os.path.join(meta, TREES)
    with _trees_lock, _layer_flock(os.fspath(node_root), "trees"):
        try:
            if os.listdir(os.path.join(trees, "native")):
                return
        except FileNotFoundError:
            pass
        if _is_mount(trees):
            from runtime_shim.isolation.mount import unmount

            unmount(trees)
        shutil.rmtree(trees, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(meta)
