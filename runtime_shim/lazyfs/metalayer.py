"""Meta layers: files already on the node served by overlayfs alone, with no FUSE round trip.

A lazy layer is a FUSE mount (``runtime_shim.lazyfs.passthrough``): even once a file's bytes
are in the node's file cache (``<node>/files/<hex>``), every ``open`` of it asks the daemon
for the passthrough backing fd (~26 µs against ~8 µs for an unpacked dir). The composefs
model removes that round trip for the files already fetched: for each lazy layer the daemon
builds a *meta tree* — a directory tree with, for every regular file of the layer whose
verified contents are in the file cache, a sparse file of the same size and metadata (mode,
owner, mtime, xattrs, hardlinks as one inode) carrying ``trusted.overlay.metacopy`` and a
``trusted.overlay.redirect`` to ``/<hex>`` — and mounts it once per node as a read-only
overlay with the cache as a data-only lower layer::

    <node>/meta/trees/<layer hex>/g-<key>  the meta tree (directories + metacopy files), on
                                           the node's tree tmpfs (``TREES``)
    <node>/meta/<layer hex>/g-<key>/data   hardlinks to files/<hex>: the data-only layer
                                    mnt    overlay lowerdir=TREE::data, ro, metacopy=on
    <node>/meta/<layer hex>/current.json   {"version": 1, "gen": "g-<key>", "digests": [...]}

The sandbox's overlay then takes ``mnt`` as an extra lower dir *directly above* the layer's
FUSE mount (``lazy_layer_dirs``): a lookup of a fetched file stops at ``mnt`` (a regular file
ends an overlay lookup), its opens and reads are the kernel's (two overlays over ext4); every
other name — unfetched files, symlinks, devices, whiteouts, directories' other entries —
falls through to the FUSE mount as before. The pair sits where the layer sat, so whiteouts
and opaque directories of the layers above hide its files exactly as before, and the layer's
own opaque directories (on its FUSE mount, below ``mnt``) still end the merge below it.

Why a nested overlay and not metacopy files straight in the sandbox's overlay: following
``metacopy`` needs ``metacopy=on`` on that overlay, which the kernel only allows with
``redirect_dir=on`` when there is an upper dir — both make copy-ups write metadata-only files
and directory redirects into the sandbox's upper dir, which would then no longer be a plain
diff (``runtime_shim.isolation.mount.OVERLAY_PLAIN_OPTIONS``). The inner overlay has no upper dir, so
``metacopy=on,redirect_dir=follow`` only *reads* redirects, and the sandbox's overlay keeps its
plain options: a copy-up out of ``mnt`` copies the data. Stacking depth: the FUSE mount is 1
(passthrough), ``mnt`` is 1 (over ext4), the sandbox's overlay is 2, the kernel's limit. The
inner overlay has no other lower layer, so an absolute redirect cannot be answered by a name
in some other layer (with the meta tree in the sandbox's overlay, a lower layer's root file
named ``<hex>`` would have been taken as the data of an upper layer's file).

Generations: the tree is built once per (layer, set of fetched files) and shared read-only by
every later sandbox. The next generation (``key`` = hash of the digest set) is built by the
daemon in the background when a lazy sandbox closes (``refresh_soon``) or once fetches have
been quiet for ``REFRESH_QUIET`` s, or when a create finds new verified files and no fetch in
flight (during a burst's fetches nothing is built). A create never builds, nor waits for a
build that is running or promised (a sandbox just closed): it takes the generation there is,
or the FUSE mount alone for a layer that has none yet, and starts the build it found due in
the background — the next create gets the new generation. A closing sandbox waits (at most
``CLOSE_WAIT`` s) for the build its close started, so that the next create finds it done. The
data
dir holds hardlinks, so the file cache's eviction cannot pull a file from under a live
generation. A superseded generation no mount refers to is unmounted and deleted
after ``GRACE`` s (``collect``); the node's eviction (``NodeCache.unmount_lazy``) removes at
once those no mount refers to, and every generation of a layer no live sandbox uses.

Hostile layers: the tree holds only directories and regular files this module creates under
names checked one component at a time (no ``""``, ``.``, ``..``, NUL, or more than 255 bytes;
a path longer than ``MAX_PATH`` is skipped), so nothing can leave the tree; the TOC's
``trusted.overlay.*`` xattrs are never copied (the inner overlay would follow them); a file
whose metadata cannot be set is left to the FUSE mount. Building is linear in the fetched
files (``$ENVBUILD_LAZY_METALAYER=off`` disables it all).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

from runtime_shim.lazyfs.tree import Node

log = logging.getLogger("envbuild.lazyfs")

#: The on-disk format of a generation (layout above, ``current.json``).
META_VERSION = 1
#: ``off`` disables meta layers (sandboxes get the FUSE mounts only); ``on``/unset uses them.
ENV_SWITCH = "ENVBUILD_LAZY_METALAYER"
#: The daemon's background refresh: how often it looks, and how long fetches must have been
#: quiet (a create builds as soon as no fetch is in flight; in the background a build would
#: compete with a running workload for CPU).
REFRESH_EVERY = 1.0
REFRESH_QUIET = 2.0
#: How long a closing lazy sandbox waits for the meta build of what it fetched (then the
#: build goes on in the background; the next create takes the generation there is).
CLOSE_WAIT = 2.0
#: Layers built at once after a sandbox closed (``refresh_now``): one — three at once took as
#: long in all (the GIL) and competed more with the FUSE threads serving the next sandbox.
REFRESH_WORKERS = 1
#: A superseded generation no mount refers to is removed by later builds after this long.
GRACE = 60.0
#: Longest path (bytes, below ``tree``) a meta entry may have; longer ones stay on FUSE.
MAX_PATH = 3000
METACOPY_XATTR = "trusted.overlay.metacopy"
REDIRECT_XATTR = "trusted.overlay.redirect"
_OVERLAY_PREFIX = "trusted.overlay."
_NS = 10 ** 9
_MS_RDONLY = 1
_MS_NODEV = 4
#: ``<node>/meta/trees``: the tmpfs holding every meta tree of the node (inodes only).
TREES = "trees"
#: Its bounds: no file has data (sparse), so ``size`` only caps directories and xattrs;
#: ``nr_inodes`` caps the node's meta entries (~1 KiB of kernel memory each).
TREES_OPTIONS = "mode=0700,size=64m,nr_inodes=1000000"
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]


def enabled() -> bool:
    """Whether sandboxes get meta layers (``$ENVBUILD_LAZY_METALAYER`` is not ``off``)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() not in ("off", "0", "no", "false")


@dataclasses.dataclass(frozen=True)
class MetaEntry:
    """One inode of a meta tree: a directory (``digest`` empty) or a regular file with all its
    names (hardlinks)."""

    paths: tuple[str, ...]
    mode: int
    uid: int
    gid: int
    mtime: int
    xattrs: tuple[tuple[str, bytes], ...] = ()
    size: int = 0
    digest: str = ""


def safe_path(path: str) -> bool:
    """Whether ``path`` (relative, ``/``-separated) is made only of plain names: it cannot
    leave the directory it is created in."""
    if not path or len(os.fsencode(path)) > MAX_PATH:
        return False
    for part in path.split("/"):
        if part in ("", ".", "..") or "\0" in part or len(os.fsencode(part)) > 255:
            return False
    return True


def _xattrs(node: Node) -> tuple[tuple[str, bytes], ...]:
    return tuple(sorted((k, bytes(v)) for k, v in node.xattrs.items()
                        if not k.startswith(_OVERLAY_PREFIX)))


def plan(nodes: Mapping[str, Node], digest_of: Callable[[Node], str],
         present: Collection[str]) -> tuple[list[MetaEntry], list[MetaEntry]]:
    """The meta tree of a layer (pure): ``(dirs, files)`` for the regular files of ``nodes``
    whose digest is in ``present``, dirs parents first, each file once with all its safe
    names (tar order). Names that are not ``safe_path`` are left out."""
    by_inode: dict[int, tuple[Node, list[str]]] = {}
    for path, node in nodes.items():
        if not stat.S_ISREG(node.mode):
            continue
        got = by_inode.get(id(node))
        if got is None:
            # the set lookup first: most of a layer's files are not fetched, and checking
            # every name of a 15,000-file layer was most of a small generation's plan
            if digest_of(node) not in present or not safe_path(path):
                continue
            by_inode[id(node)] = (node, [path])
        elif safe_path(path):
            got[1].append(path)
    dirs: set[str] = set()
    files = []
    for node, paths in by_inode.values():
        for p in paths:
            parent = p.rpartition("/")[0]
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = parent.rpartition("/")[0]
        files.append(MetaEntry(tuple(paths), stat.S_IMODE(node.mode), node.uid, node.gid,
                               node.mtime, _xattrs(node), node.size, digest_of(node)))
    out_dirs = []
    for d in sorted(dirs, key=lambda p: (p.count("/"), p)):
        dnode = nodes.get(d)
        if dnode is None or not dnode.is_dir:  # cannot happen with build_tree: be safe
            continue
        out_dirs.append(MetaEntry((d,), stat.S_IMODE(dnode.mode), dnode.uid, dnode.gid,
                                  dnode.mtime, _xattrs(dnode)))
    root = nodes.get("")
    if root is not None:
        out_dirs.insert(0, MetaEntry(("",), stat.S_IMODE(root.mode), root.uid, root.gid,
                                     root.mtime, _xattrs(root)))
    return out_dirs, files


def _set_meta(fd: int, e: MetaEntry, created: int | None = None) -> None:
    """Give ``fd`` the entry's xattrs, owner, mode and mtime. ``created``: the mode it was
    created with (after the umask): no ``fchmod`` when that is the entry's and it has no
    set-id bits, no ``fchown`` when this process's owner is the entry's (a tree is mostly
    root's files: two syscalls of the ~9 per file)."""
    for k, v in e.xattrs:
        os.setxattr(fd, k, v)
    if (e.uid, e.gid) != (os.geteuid(), os.getegid()):
        os.fchown(fd, e.uid, e.gid)
    if created != e.mode or e.mode & 0o7000:
        os.fchmod(fd, e.mode)  # after chown, which clears set-id bits
    t = e.mtime * _NS
    os.utime(fd, ns=(t, t))


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it process-wide)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o7777   # unknown: every created mode counts as different (always fchmod)


def build(tree_dir: str, data_dir: str, dirs: Iterable[MetaEntry],
          files: Iterable[MetaEntry], sources: Callable[[str], list[str]]) -> int:
    """Create the meta tree in the empty ``tree_dir`` and the data-only layer in the empty
    ``data_dir`` (hardlinks, from the first of ``sources(hex)`` that is a regular file of the
    entry's size; the caller names only verified cache files). A file whose
    data or metadata cannot be placed is skipped (left to the FUSE mount). Returns the number
    of files placed."""
    dirs = list(dirs)
    placed_dirs = {""}
    for d in dirs:
        path = d.paths[0]
        if path:
            parent = path.rpartition("/")[0]
            if parent not in placed_dirs:
                continue
            try:
                os.mkdir(os.path.join(tree_dir, path), 0o700)
            except OSError as e:
                log.warning("meta tree: directory %s: %s (its files stay on FUSE)", path, e)
                continue
            placed_dirs.add(path)
    linked: set[str] = set()
    placed = 0
    umask = _umask()
    for f in files:
        hexd = f.digest.removeprefix("sha256:")
        if hexd not in linked:
            for src in sources(hexd):
                try:  # a regular file of the right size, never a symlink's target
                    st = os.lstat(src)
                    if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                        log.warning("meta tree: %s is not a %d-byte file: not used", src, f.size)
                        continue
                    os.link(src, os.path.join(data_dir, hexd), follow_symlinks=False)
                    break
                except FileNotFoundError:
                    continue
            else:
                continue  # evicted meanwhile: on FUSE
            linked.add(hexd)
        paths = [p for p in f.paths if p.rpartition("/")[0] in placed_dirs]
        if not paths:
            continue
        first = os.path.join(tree_dir, paths[0])
        mode = f.mode & 0o777   # the tree's dirs are 0700 while it is built
        try:
            fd = os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, mode)
        except OSError as e:
            log.warning("meta tree: %s: %s (stays on FUSE)", paths[0], e)
            continue
        try:
            if f.size:
                os.ftruncate(fd, f.size)
            os.setxattr(fd, METACOPY_XATTR, b"")
            os.setxattr(fd, REDIRECT_XATTR, b"/" + hexd.encode())
            _set_meta(fd, f, created=mode & ~umask)
        except OSError as e:
            log.warning("meta tree: %s: %s (stays on FUSE)", paths[0], e)
            os.close(fd)
            os.unlink(first)
            continue
        os.close(fd)
        for p in paths[1:]:
            try:
                os.link(first, os.path.join(tree_dir, p), follow_symlinks=False)
            except OSError as e:
                log.warning("meta tree: hardlink %s: %s", p, e)
        placed += 1
    for d in reversed(dirs):  # children first: creating entries moves a directory's mtime
        path = d.paths[0]
        if path not in placed_dirs:
            continue
        fd = os.open(os.path.join(tree_dir, path) if path else tree_dir,
                     os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _set_meta(fd, d)
        except OSError as e:
            log.warning("meta tree: directory %s metadata: %s", path or "/", e)
        finally:
            os.close(fd)
    return placed


def mount_generation(tree: str, data: str, target: str) -> None:
    """Mount ``target``: a read-only overlay of the meta tree ``tree`` with ``data`` as its
    data-only lower layer, following metacopy redirects (nothing is ever written there)."""
    for p in (tree, data):
        if any(c in p for c in ":,\\"):
            raise OSError(f"meta layer path has a ':' ',' or '\\': {p}")
    opts = f"lowerdir={tree}::{data},metacopy=on,redirect_dir=follow,xino=off"
    if _libc.mount(b"overlay", target.encode(), b"overlay", _MS_RDONLY, opts.encode()) != 0:
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
        if _libc.mount(b"envbuild-meta", trees.encode(), b"tmpfs", _MS_NODEV,
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
    than ``keep`` that no other mount refers to (a sandbox's overlay names them in its
    lowerdir) and, with ``grace``, were superseded at least ``grace`` s ago (a create may
    have been handed one and not mounted its overlay yet); ``everything``: all of them,
    referred to or not (no sandbox uses the layer). Returns the removed generation names."""
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
        used = any(mnt in opts for point, opts in mounts if point != mnt)
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
        layers = [n for n in os.listdir(meta) if _is_hex(n)]
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
    if not any(_is_hex(n) for n in os.listdir(meta)):  # no generation left: the tmpfs too
        trees = os.path.join(meta, TREES)
        with _trees_lock, _layer_flock(os.fspath(node_root), "trees"):
            _unmount(trees)
            shutil.rmtree(trees, ignore_errors=True)
        try:
            os.rmdir(meta)
        except OSError:
            pass
    return done


def describe(node_root: str | os.PathLike[str]) -> list[str]:
    """``envbuild node ls``: one line per layer with a meta layer (its current generation,
    how many files it serves, whether it is mounted), then the switch if it is off."""
    meta = os.path.join(os.fspath(node_root), "meta")
    lines = []
    try:
        names = sorted(n for n in os.listdir(meta) if _is_hex(n))
    except FileNotFoundError:
        names = []
    for hexd in names:
        current = _read_current(os.path.join(meta, hexd))
        if current is None:
            continue
        gen_dir = os.path.join(meta, hexd, current[0])
        state = "mounted" if _is_mount(os.path.join(gen_dir, "mnt")) else "not mounted"
        lines.append(f"meta sha256:{hexd}  {current[0]}, {len(current[1])} files, {state}")
    if not enabled():
        lines.append(f"meta layers: off (${ENV_SWITCH})")
    return lines


def _is_hex(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


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


# -- the daemon side ------------------------------------------------------------------------


class MetaLayers:
    """The daemon's meta layers (one per node daemon): ``request`` answers the ``meta``
    control request — for each lazy layer, the ``mnt`` of its current generation, built or
    refreshed first when new files of the layer were verified and fetches have settled."""

    def __init__(self, root: str, files: Any) -> None:
        self.root = root
        self.files = files  # FileCache: verified digests, the directory
        self._lock = threading.Lock()
        self._layer_locks: dict[str, threading.Lock] = {}
        # layers a background build was promised for (``refresh_now``): a create takes the
        # generation there is instead of building (or waiting for) the same one itself
        self._pending: set[str] = set()
        # per mount (dropped with it): digest of each regular inode, and their set
        self._digests: weakref.WeakKeyDictionary[Any, tuple[dict[int, str], frozenset[str]]] = \
            weakref.WeakKeyDictionary()

    def _layer_lock(self, hexd: str) -> threading.Lock:
        with self._lock:
            return self._layer_locks.setdefault(hexd, threading.Lock())

    def _layer_digests(self, ops: Any) -> tuple[dict[int, str], frozenset[str]]:
        """Digest of each regular inode of a mount (by ``id(node)``), computed once per mount."""
        with self._lock:
            got = self._digests.get(ops)
        if got is not None:
            return got
        by_node: dict[int, str] = {}
        for node in ops.lazy_nodes.values():
            if stat.S_ISREG(node.mode) and id(node) not in by_node:
                by_node[id(node)] = node.digest  # the TOC's, on the node: no Entry decode
        digests = frozenset(d for d in by_node.values() if d)
        with self._lock:
            self._digests[ops] = (by_node, digests)
        return by_node, digests

    def request(self, ops_of: Callable[[str], Any], req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        out = []
        stale: list[tuple[str, Any]] = []
        for item in req.get("layers", ()):
            try:
                mp = str(item["mountpoint"])
                ops = ops_of(mp)
                # a build is due only once fetches have been quiet (as for the background
                # refresh): the files this very create fetches ahead (startup.py) land while
                # it runs, and a build then would compete with its container and first command
                out.append(self.layer(ops, str(item["digest"]), mp, quiet=REFRESH_QUIET,
                                      build=False))
                if out[-1].pop("stale", False):
                    stale.append((mp, ops))
            except Exception as e:  # noqa: BLE001 - a meta layer is an optimisation only
                log.warning("meta layer of %s: %s", item.get("digest"), e)
                out.append({"digest": item.get("digest"), "dir": "", "files": 0,
                            "error": str(e)})
        if stale:   # new files on the node: built for the next create, not this one
            self.promise(ops.lazy_layer.digest for _, ops in stale)
            threading.Thread(target=self.refresh_now, args=(stale,), name="meta-refresh-new",
                             daemon=True).start()
        # a create waits for this answer: how long it took is part of the create's time
        log.info("meta request: %d layers (%d with a meta layer, %d to build) in %.3f s",
                 len(out), sum(1 for x in out if x.get("dir")), len(stale),
                 time.monotonic() - t0)
        return {"ok": True, "layers": out}

    def building(self) -> int:
        """How many layers have a build running or promised (the daemon's ping reply)."""
        with self._lock:
            return len(self._pending) + sum(lk.locked() for lk in self._layer_locks.values())

    def promise(self, digests: Iterable[str]) -> None:
        """A background build of these layers is coming (``refresh_now``): until it ran, a
        create takes the generation there is rather than building the same one itself."""
        with self._lock:
            self._pending.update(d.removeprefix("sha256:") for d in digests)

    def layer(self, ops: Any, digest: str, mountpoint: str, *, quiet: float = 0.0,
              promised: bool = False, build: bool = True) -> dict[str, Any]:
        """The current generation of layer ``digest`` served by ``ops`` (the ``Operations``
        of its mount at ``mountpoint``), built first if new files were fetched and none for
        ``quiet`` seconds and none is in flight. Never waits for another build: while one of
        the layer runs, or is promised (``promise``; ``promised``: this is that build), the
        answer is at once the generation there is (none: the FUSE mount alone) — a create
        right after a sandbox closed must not pay for the build its close started.
        ``build=False`` (a create): never build here; the reply says ``stale`` when a build
        is due (the caller starts it in the background, for the next create)."""
        hexd = digest.removeprefix("sha256:")
        if not _is_hex(hexd):
            raise ValueError(f"bad layer digest {digest!r}")
        reply: dict[str, Any] = {"digest": digest, "dir": "", "files": 0, "built": False}
        if ops is None or not hasattr(ops, "lazy_nodes"):
            return reply
        layer_dir = os.path.join(self.root, "meta", hexd)
        lock = self._layer_lock(hexd)
        with self._lock:
            elsewhere = hexd in self._pending and not promised
        if elsewhere or not lock.acquire(blocking=False):
            current = _read_current(layer_dir)  # being (re)built: the one there is
            if current is not None and _valid(os.path.join(layer_dir, current[0])) \
                    and _is_mount(os.path.join(layer_dir, current[0], "mnt")):
                reply.update(dir=os.path.join(layer_dir, current[0], "mnt"),
                             files=len(current[1]), generation=current[0])
            return reply
        try:
            if promised:
                with self._lock:
                    self._pending.discard(hexd)
            with _layer_flock(self.root, "gc", shared=True), _layer_flock(self.root, hexd):
                if not _is_mount(mountpoint):  # unmounted meanwhile (the node's eviction)
                    return reply
                return self._layer(ops, hexd, layer_dir, quiet, reply, build)
        finally:
            lock.release()

    def _layer(self, ops: Any, hexd: str, layer_dir: str, quiet: float,
               reply: dict[str, Any], build: bool = True) -> dict[str, Any]:
        by_node, layer_set = self._layer_digests(ops)
        current = _read_current(layer_dir)
        have: frozenset[str] = frozenset()
        if current is not None:
            gen_dir = os.path.join(layer_dir, current[0])
            if _valid(gen_dir):
                if not _is_mount(os.path.join(gen_dir, "mnt")):
                    _mount_gen(gen_dir)  # e.g. after the daemon's restart
                have = current[1]
            else:
                current = None
        verified = self.files.verified() & layer_set
        wanted = have | verified
        # settled: no file being fetched now (a create during a burst's fetches builds
        # nothing), and none landed for ``quiet`` s (a fetch renames a file into the cache
        # dir: its mtime is the last one)
        try:
            settled = not self.files.fetching() and (
                not quiet or time.time() - os.stat(self.files.dir).st_mtime >= quiet)
        except OSError:
            settled = False
        if wanted != have and wanted and settled and not build:
            reply["stale"] = True
        elif wanted != have and wanted and settled:
            t0 = time.monotonic()
            gen = self._build(layer_dir, ops, by_node, wanted, current)
            reply["built"], reply["seconds"] = True, round(time.monotonic() - t0, 4)
            current = (gen, wanted)
        if current is not None:
            reply["dir"] = os.path.join(layer_dir, current[0], "mnt")
            reply["files"] = len(current[1])
            reply["generation"] = current[0]
        return reply

    def _build(self, layer_dir: str, ops: Any, by_node: dict[int, str],
               wanted: frozenset[str], current: tuple[str, frozenset[str]] | None) -> str:
        key = hashlib.sha256("\n".join(sorted(wanted)).encode()).hexdigest()[:16]
        gen = f"g-{key}"
        gen_dir = os.path.join(layer_dir, gen)
        if _valid(gen_dir):  # built before (e.g. by a daemon that died since)
            if not _is_mount(os.path.join(gen_dir, "mnt")):
                _mount_gen(gen_dir)
        else:
            t0 = time.monotonic()
            if os.path.isdir(gen_dir):  # its tree is gone (the tmpfs was unmounted)
                _remove_generation(gen_dir)
            _ensure_trees(os.path.dirname(layer_dir))
            os.makedirs(layer_dir, mode=0o700, exist_ok=True)
            tmp = os.path.join(layer_dir, f".tmp-{uuid.uuid4().hex[:12]}")
            os.mkdir(tmp, 0o700)
            os.makedirs(_tree_of(tmp), mode=0o700)
            try:
                for sub in ("data", "mnt"):
                    os.mkdir(os.path.join(tmp, sub), 0o700)
                dirs, files = plan(ops.lazy_nodes, lambda n: by_node.get(id(n), ""), wanted)
                old_data = os.path.join(layer_dir, current[0], "data") if current else None

                def sources(hexd: str) -> list[str]:
                    own = [os.path.join(old_data, hexd)] if old_data else []
                    return own + [os.path.join(self.files.dir, hexd)]

                placed = build(_tree_of(tmp), os.path.join(tmp, "data"), dirs, files, sources)
                os.rename(_tree_of(tmp), _tree_of(gen_dir))
                os.rename(tmp, gen_dir)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(_tree_of(tmp), ignore_errors=True)
                raise
            _mount_gen(gen_dir)
            log.info("meta layer %s of %s: %d files (%d dirs) in %.3f s", gen,
                     os.path.basename(layer_dir)[:12], placed, len(dirs), time.monotonic() - t0)
        doc = {"version": META_VERSION, "gen": gen, "digests": sorted(wanted)}
        tmpj = os.path.join(layer_dir, f".current.{uuid.uuid4().hex[:8]}")
        with open(tmpj, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmpj, os.path.join(layer_dir, "current.json"))
        collect(layer_dir, gen, grace=GRACE)
        return gen


    def refresh_now(self, mounts: list[tuple[str, Any]]) -> None:
        """Build the next generation of every mounted layer that has new files (a lazy sandbox
        just closed: its fetches are done), ``REFRESH_WORKERS`` layers at a time (one: more
        at once took as long in all, under the GIL), the largest first, so the window in which
        a create gets the FUSE mount alone is short."""
        from concurrent.futures import ThreadPoolExecutor

        def one(item: tuple[str, Any]) -> None:
            mp, ops = item
            try:
                self.layer(ops, ops.lazy_layer.digest, mp, promised=True)
            except Exception as e:  # noqa: BLE001 - the next create tries again
                log.warning("meta layer refresh of %s: %s", mp, e)
            finally:
                with self._lock:
                    self._pending.discard(ops.lazy_layer.digest.removeprefix("sha256:"))

        # the largest layers first: they take longest
        order = sorted(mounts, key=lambda m: -len(getattr(m[1], "lazy_nodes", ())))
        with ThreadPoolExecutor(max(1, min(REFRESH_WORKERS, len(order))),
                                thread_name_prefix="meta-build") as pool:
            list(pool.map(one, order))

    def refresh(self, mounts: Callable[[], list[tuple[str, Any]]],
                stopped: Callable[[], bool]) -> None:
        """Background (a daemon thread, from the first ``meta`` request on): every
        ``REFRESH_EVERY`` s, build the next generation of each mounted layer whose fetches
        have been quiet for ``REFRESH_QUIET`` s, so the next create finds it ready."""
        seen: tuple[int, float] | None = None
        while not stopped():
            time.sleep(REFRESH_EVERY)
            try:  # nothing fetched or evicted since the last look: nothing to do
                now = (len(self.files.verified()), os.stat(self.files.dir).st_mtime)
            except OSError:
                continue
            if now == seen or self.files.fetching() or time.time() - now[1] < REFRESH_QUIET:
                continue
            seen = now
            for mp, ops in mounts():
                try:
                    self.layer(ops, ops.lazy_layer.digest, mp, quiet=REFRESH_QUIET)
                except Exception as e:  # noqa: BLE001 - the next create tries again
                    log.warning("meta layer refresh of %s: %s", mp, e)


_registry: dict[str, MetaLayers] = {}
_registry_lock = threading.Lock()


def handle(daemon: Any, req: dict[str, Any]) -> dict[str, Any]:
    """The daemon's ``meta`` request (``runtime_shim.lazyfs.daemon``): in passthrough mode,
    each layer's current meta generation; on the fuse fallback there is no file cache, so
    none."""
    if getattr(daemon, "mode", "") != "passthrough":
        return {"ok": True, "layers": [{"digest": x.get("digest"), "dir": "", "files": 0}
                                       for x in req.get("layers", ())]}
    with _registry_lock:
        meta = _registry.get(daemon.root)
        if meta is None:
            meta = _registry[daemon.root] = MetaLayers(daemon.root, daemon.files)

            def mounts() -> list[tuple[str, Any]]:
                with daemon.lock:
                    return list(daemon.ops.items())
            threading.Thread(target=meta.refresh, args=(mounts, lambda: daemon.stop),
                             name="meta-refresh", daemon=True).start()

    def ops_of(mp: str) -> Any:
        with daemon.lock:
            return daemon.ops.get(mp)
    if req.get("refresh"):
        with daemon.lock:
            now = list(daemon.ops.items())
        # promised before the answer: a create meanwhile takes what there is
        meta.promise(ops.lazy_layer.digest for _, ops in now)
        t = threading.Thread(target=meta.refresh_now, args=(now,), name="meta-refresh-now",
                             daemon=True)
        t.start()
        wait = req.get("wait")
        if isinstance(wait, (int, float)) and wait > 0:   # the closing sandbox waits (bounded)
            t.join(min(float(wait), CLOSE_WAIT))
        return {"ok": True, "done": not t.is_alive()}
    return meta.request(ops_of, req)


def building(root: str) -> int:
    """Layers of the daemon of node ``root`` with a meta build running or promised (0 before
    its first ``meta`` request): the daemon's ping reply, for callers that wait for builds."""
    with _registry_lock:
        meta = _registry.get(root)
    return meta.building() if meta is not None else 0


def refresh_soon(node_root: str | os.PathLike[str], wait: float = CLOSE_WAIT) -> None:
    """Client side (a lazy sandbox closed): ask the node daemon to build the meta layers of
    what was fetched now, and wait for that build at most ``wait`` s (0: not at all) — the
    sandbox that fetched the files pays for making them fast for the next one, off any
    create's path (a create never waits for a build: it would take the FUSE mounts alone,
    and a build running beside the next sandbox's workload competed with it for the node's
    CPU). Never raises; a no-op without a daemon."""
    from runtime_shim.lazyfs.control import daemon_request

    if not enabled():
        return
    try:
        daemon_request(node_root, {"op": "meta", "refresh": True, "wait": wait}, wait + 2.0)
    except Exception as e:  # noqa: BLE001 - an optimisation only
        log.debug("meta layer refresh: %s", e)


def _tell(node_root: str | os.PathLike[str], request: dict[str, Any], timeout: float) -> None:
    from runtime_shim.lazyfs.control import daemon_request

    try:
        daemon_request(node_root, request, timeout)
    except Exception as e:  # noqa: BLE001 - a hint: nothing waits for it
        log.debug("meta layers (hint): %s", e)


def meta_dirs(node_root: str | os.PathLike[str], layers: list[tuple[str, str]],
              timeout: float = 30.0) -> list[str]:
    """Client side (``lazy_layer_dirs``): the meta layer dir of each ``(digest, mountpoint)``
    (``""`` for none), asked of the node daemon in one request. Never raises: without an
    answer every layer is served by its FUSE mount alone."""
    from runtime_shim.lazyfs.control import daemon_request

    if not enabled() or not layers:
        return ["" for _ in layers]
    request = {"op": "meta", "layers": [{"digest": d, "mountpoint": mp} for d, mp in layers]}
    root = os.path.abspath(node_root)
    if not any(os.path.isdir(os.path.join(root, "meta", d.removeprefix("sha256:")))
               for d, _ in layers):
        # No layer has a generation on disk (a stack new to the node): there is nothing to
        # serve, and waiting for the answer kept a cold create behind the daemon's work on the
        # mounts it just made (17-90 ms measured). The request still goes, unanswered here:
        # it may start a build that is due, for the next create.
        threading.Thread(target=_tell, args=(node_root, request, timeout), daemon=True,
                         name="lazy-meta-hint").start()
        return ["" for _ in layers]
    try:
        reply = daemon_request(node_root, request, timeout)
    except Exception as e:  # noqa: BLE001 - an optimisation: the FUSE mounts serve anyway
        log.warning("meta layers: %s", e)
        return ["" for _ in layers]
    got = (reply or {}).get("layers") or []
    out = []
    for i, (digest, _) in enumerate(layers):
        x = got[i] if i < len(got) and isinstance(got[i], dict) else {}
        d = x.get("dir") if x.get("digest") == digest else ""
        out.append(d if d and trusted_meta_dir(root, digest, d) else "")
    return out


def trusted_meta_dir(node_root: str, digest: str, claimed: object) -> bool:
    """Whether a meta dir the daemon named for layer ``digest`` is one to stack under a
    sandbox: exactly ``<node>/meta/<hex>/g-<16 hex>/mnt`` (no ``..``, no other name), with no
    symlink on the way, and a read-only overlay mount really there. A reply is hostile until
    checked: a prefix test let ``<node>/meta/<hex>/../../../usr`` through (issue 34, item 1)."""
    hexd = digest.removeprefix("sha256:")
    if not isinstance(claimed, str) or not _is_hex(hexd):
        return False
    pattern = re.escape(os.path.join(node_root, "meta", hexd)) + r"/g-[0-9a-f]{16}/mnt"
    if not re.fullmatch(pattern, claimed) or os.path.realpath(claimed) != claimed:
        log.warning("meta layers: the daemon named %r for %s: ignored", claimed[:300], digest)
        return False
    return _is_mount(claimed)


__all__ = ["ENV_SWITCH", "META_VERSION", "MetaEntry", "MetaLayers", "build", "collect", "describe",
           "enabled", "handle", "meta_dirs", "mount_generation", "plan", "refresh_soon",
           "remove_unused",
           "safe_path"]
