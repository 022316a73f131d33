"""A meta layer's generations on the node: layout, mounts, locks and removal.

The layout ``<node>/meta/<hex>/g-<key>/{data,mnt}`` with its tree on the node's tree tmpfs
(``<node>/meta/trees``), ``current.json`` naming the current one, mounting a generation's
read-only overlay, the locks that order the daemon's builds against the node's eviction, and
removing the generations nothing uses (``collect``, ``remove_unused``): no mount of this
namespace refers to them and no live sandbox pinned them (``pin``: a sandbox's overlay is
mounted in its own mount namespace, where this one's mount table does not show it). The meta
layer itself: ``runtime_shim.lazyfs.metalayer``."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import threading
import time
from collections.abc import Collection, Iterator

from envbuild import libc
from envbuild.oci import is_hex64

#: The on-disk format of a generation (layout above, ``current.json``).
META_VERSION = 1
#: ``<generation>/users/<sandbox id>``: a sandbox using the generation (``pin``); its content
#: is the sandbox's dir, which exists for as long as the sandbox does.
USERS = "users"
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
    """Mount ``target``: a read-only overlay of the meta tree ``tree`` with ``data`` as its
    data-only lower layer, following metacopy redirects (nothing is ever written there)."""
    for p in (tree, data):
        if any(c in p for c in ":,\\"):
            raise OSError(f"meta layer path has a ':' ',' or '\\': {p}")
    opts = f"lowerdir={tree}::{data},metacopy=on,redirect_dir=follow,xino=off"
    if _mount(b"overlay", target.encode(), b"overlay", _MS_RDONLY, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount meta layer {target}: {os.strerror(err)}")


def _tree_of(gen_dir: str) -> str:
    """``<node>/meta/<hex>/<gen>`` → its tree, ``<node>/meta/trees/<hex>/<gen>`` (tmpfs)."""
    layer_dir, name = os.path.split(gen_dir)
    meta, hexd = os.path.split(layer_dir)
    return os.path.join(meta, TREES, hexd, name)


def _valid(gen_dir: str) -> bool:
    return os.path.isdir(gen_dir) and os.path.isdir(_tree_of(gen_dir))


def _mount_gen(gen_dir: str) -> None:
    mount_generation(_tree_of(gen_dir), os.path.join(gen_dir, "data"),
                     os.path.join(gen_dir, "mnt"))


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


def pin(lower_dirs: Collection[str], holder: str | os.PathLike[str]) -> None:
    """Record that the sandbox whose dir is ``holder`` uses the meta generations among its
    ``lower_dirs`` (``<node>/meta/<hex>/g-<key>/mnt``): ``collect`` keeps a generation while
    the dir of a sandbox that pinned it exists (its close or the sweep removes the dir)."""
    holder = os.fspath(holder)
    for d in lower_dirs:
        gen = os.path.dirname(d)
        if os.path.basename(d) != "mnt" or not os.path.basename(gen).startswith("g-") \
                or os.path.basename(os.path.dirname(os.path.dirname(gen))) != "meta":
            continue
        users = os.path.join(gen, USERS)
        os.makedirs(users, mode=0o700, exist_ok=True)
        with open(os.path.join(users, os.path.basename(holder)), "w", encoding="utf-8") as f:
            f.write(holder)


def _pinned(gen: str) -> bool:
    """Whether a sandbox that pinned ``gen`` still has its dir."""
    users = os.path.join(gen, USERS)
    try:
        names = os.listdir(users)
    except FileNotFoundError:
        return False
    for name in names:
        try:
            with open(os.path.join(users, name), encoding="utf-8") as f:
                if os.path.isdir(f.read()):
                    return True
        except OSError:
            pass
    return False


def _unmount(target: str) -> None:
    from runtime_shim.isolation.mount import unmount

    unmount(target)


def _remove_generation(gen_dir: str) -> None:
    _unmount(os.path.join(gen_dir, "mnt"))
    shutil.rmtree(gen_dir, ignore_errors=True)
    shutil.rmtree(_tree_of(gen_dir), ignore_errors=True)


def collect(layer_dir: str, keep: str | None, *, everything: bool = False,
            grace: float = 0.0) -> list[str]:
    """Unmount and delete the generations under ``layer_dir`` (``<node>/meta/<hex>``) other
    than ``keep`` that no other mount refers to (an overlay that names them in its lowerdir)
    and no live sandbox pinned (``pin``) and, with ``grace``, were superseded at least
    ``grace`` s ago (a create may have been handed one and not pinned it yet);
    ``everything``: all of them, referred to or not (no sandbox uses the layer). Returns the
    removed generation names."""
    try:
        names = [n for n in os.listdir(layer_dir) if n.startswith(("g-", ".tmp-"))]
    except FileNotFoundError:
        return []
    mounts = _mountinfo() if not everything else []
    removed = []
    for name in names:
        if name == keep and not everything:
            continue
        gen = os.path.join(layer_dir, name)
        mnt = os.path.join(gen, "mnt")
        used = any(mnt in opts for point, opts in mounts if point != mnt) \
            or (not everything and _pinned(gen))
        if used and not name.startswith(".tmp-"):
            continue
        if grace and not name.startswith(".tmp-"):
            marker = os.path.join(gen, "superseded")
            try:
                if time.time() - os.stat(marker).st_mtime < grace:
                    continue
            except FileNotFoundError:
                open(marker, "w").close()
                continue
        _remove_generation(gen)
        removed.append(name)
    if everything:
        try:
            os.unlink(os.path.join(layer_dir, "current.json"))
        except FileNotFoundError:
            pass
        for d in (layer_dir, os.path.join(os.path.dirname(layer_dir), TREES,
                                          os.path.basename(layer_dir))):
            try:
                os.rmdir(d)
            except OSError:
                pass
    return removed


def remove_unused(node_root: str | os.PathLike[str], keep_hex: Collection[str]) -> list[str]:
    """The node's eviction (``NodeCache.unmount_lazy``): every generation of a layer not in
    ``keep_hex`` is removed; of the others, the old generations no mount refers to."""
    with _layer_flock(os.fspath(node_root), "gc"):
        return _remove_unused(node_root, keep_hex)


def _remove_unused(node_root: str | os.PathLike[str], keep_hex: Collection[str]) -> list[str]:
    meta = os.path.join(os.fspath(node_root), "meta")
    try:
        layers = [n for n in os.listdir(meta) if is_hex64(n)]
    except FileNotFoundError:
        return []
    done = []
    for hexd in layers:
        layer_dir = os.path.join(meta, hexd)
        with _layer_flock(os.fspath(node_root), hexd):
            if hexd in keep_hex:
                current = _read_current(layer_dir)
                done += collect(layer_dir, current[0] if current else None)
            else:
                done += collect(layer_dir, None, everything=True)
    try:   # native layers' trees (runtime_shim.lazyfs.nativetree) share the tmpfs
        native = os.listdir(os.path.join(meta, TREES, "native"))
    except FileNotFoundError:
        native = []
    if not native and not any(is_hex64(n) for n in os.listdir(meta)):  # none left: the tmpfs
        trees = os.path.join(meta, TREES)
        with _trees_lock, _layer_flock(os.fspath(node_root), "trees"):
            _unmount(trees)
            shutil.rmtree(trees, ignore_errors=True)
        try:
            os.rmdir(meta)
        except OSError:
            pass
    return done


def _read_current(layer_dir: str) -> tuple[str, frozenset[str]] | None:
    try:
        with open(os.path.join(layer_dir, "current.json"), encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("version") != META_VERSION or not str(doc["gen"]).startswith("g-"):
            return None
        return str(doc["gen"]), frozenset(str(d) for d in doc["digests"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@contextlib.contextmanager
def _layer_flock(node_root: str, hexd: str, *, shared: bool = False) -> Iterator[None]:
    """``<node>/locks/<hex>.meta.lock``: the daemon's builds and the node's eviction of one
    layer's generations, one at a time across processes (``gc.meta.lock``: builds shared,
    the node's eviction exclusive — a build that started before an eviction listed the
    layers is waited for, one after it finds the layer's FUSE mount gone)."""
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
