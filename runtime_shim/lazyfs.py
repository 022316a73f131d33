"""Lazy layers: a read-only FUSE filesystem per layer, served from the store by ``LazyLayer``.

In lazy mode a sandbox does not wait for its layers to be pulled and unpacked: each layer is a
FUSE mount at ``<node>/lazy/<hex>`` (``NodeCache.ensure_lazy``) that overlayfs takes as a lower
dir in place of ``<node>/layers/<hex>``. Opening the layer costs two ranged reads (footer and
TOC); a file's contents are fetched on the first ``read`` of that file, verified whole against
its TOC digest (``envbuild.store.lazy``), kept in the node's chunk cache and then in the
kernel's page cache, which every sandbox on the host shares because they share the mount.

**What the mount presents** — exactly what ``LayerReader.unpack(dest, whiteouts="overlay")``
writes, so a lazy and an unpacked layer are interchangeable as overlay lower dirs:

- every TOC member with its mode, owner, mtime (atime and ctime equal it), size, symlink target,
  device numbers and extended attributes;
- an OCI whiteout ``D/.wh.NAME`` appears as ``D/NAME``, a 0/0 character device (the overlayfs
  whiteout), mode 0600 and the whiteout's owner; ``D/.wh..wh..opq`` does not appear, ``D`` carries
  ``trusted.overlay.opaque=y`` instead (getxattr and listxattr); other ``.wh..wh.*`` names are
  skipped. A later member of the same name replaces an earlier one (tar order), as on unpack;
- hardlinks are one inode: same inode number, ``st_nlink`` counting every name;
- inode numbers are stable per path for a given layer: the root is 1, member *i* of the TOC
  is *i* + 2 (a hardlink has its target's), directories missing from the TOC are synthesised
  (mode 0755, root-owned) after those;
- ``statfs`` answers (overlayfs refuses a lower dir whose filesystem does not: "overlayfs:
  statfs failed"); the filesystem is read-only (``ro``), ``default_permissions`` lets the kernel
  check modes, ``allow_other`` lets any uid through (sandboxes run commands as other users);
- ``open`` fetches nothing; ``read`` fetches through ``LazyLayer.read``. The layer is immutable,
  so the kernel caches everything for a day: page cache kept across opens (``kernel_cache``),
  entries, attributes and negative lookups (``*_timeout``);
- the mount root answers ``getxattr(LAZY_STATS_XATTR)`` (not listed by listxattr) with the JSON
  of the layer's ``LazyStats`` plus ``pid`` — what this daemon fetched so far. It is invisible
  inside sandboxes: overlayfs takes the root's xattrs from the sandbox's upper dir.

**The daemon** is one process per node cache serving every lazy layer of the host, each its own
mount (see "the node daemon" below for the protocol), started detached (own session) by
``NodeCache.ensure_lazy`` so it outlives the process that asked for it::

    python -m runtime_shim.lazyfs --node ROOT [--chunk-cache-max 10G] [--memory-cache 256M]

(``--store URL --digest D --mountpoint M --chunk-cache DIR ...`` serves one layer instead, in
the foreground: for debugging.) It opens the store the client names (``envbuild.store.open_store``)
only when needed: with a presigned URL of the blob (``S3Store.presigned_get_url``) ranged reads
go over plain HTTP (``envbuild.store.lazy.HttpRanges``) and boto3 is never loaded unless the URL
expires. A layer is opened (footer, TOC) *before* it is mounted, so a wrong digest or an
unreachable store is an error reply with one line and never a mount. A mount is served until it
goes away (``umount``/``fusermount3 -u``); SIGTERM/SIGINT/SIGHUP unmount all. Reads that fail
(store down, corrupt content) return EIO and are logged on stderr. Pieces are cached in two
levels: an in-memory LRU (``--memory-cache``) in front of the node's disk ``ChunkCache``, both
shared by all the layers, so the kernel's 128 KiB reads of a file cut in 4 MiB pieces do not
each re-read and re-hash the piece from disk.

Why mfusepy and not pyfuse3: mfusepy is pure ctypes over the system's libfuse3 (the ``fuse3``
package), installs in a second and runs libfuse's multi-threaded loop, so a read blocked on
the store does not stall lookups; pyfuse3 must be compiled (~55 s, a C toolchain and
``libfuse3-dev`` on every node) and runs every handler on one trio thread, so blocking
``LazyLayer`` calls would need a thread pool of our own. Its low-level API (our own inode
numbers as kernel node ids) would buy nothing here: ``use_ino`` reports our inode numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import os
import stat
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from envbuild.errors import EnvbuildError, RuntimeShimError
from envbuild.layers import Entry
from envbuild.store.lazy import ChunkCache, HttpRanges, LazyLayer, MemoryChunkCache

log = logging.getLogger("envbuild.lazyfs")

#: xattr of the mount root that returns the daemon's ``LazyStats`` as JSON (not listed).
LAZY_STATS_XATTR = "user.envbuild.lazy.stats"
#: The immutable layer's kernel cache lifetime (entries, attributes, negative lookups).
CACHE_TTL = 86400.0
OPAQUE_XATTR = "trusted.overlay.opaque"
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_IFMT = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK,
         "char": stat.S_IFCHR, "block": stat.S_IFBLK, "fifo": stat.S_IFIFO}
_NS = 10 ** 9
#: Parallel requests of a background load (readahead, profile prefetch); reads use the layer's.
BACKGROUND_WORKERS = 2


# -- the tree (pure) ---------------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Node:
    """One inode of the presented tree. Hardlinked names share one ``Node``."""

    ino: int
    mode: int        # type and permission bits
    uid: int
    gid: int
    mtime: int
    size: int = 0
    rdev: int = 0
    nlink: int = 1
    link: str = ""             # symlink target
    read_path: str = ""        # regular file: the TOC path LazyLayer reads
    frames: tuple[int, ...] = ()  # regular file: blob offsets of the frames holding it
    xattrs: dict[str, bytes] = dataclasses.field(default_factory=dict)
    children: dict[str, None] | None = None  # directory: names in tar order

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    def attrs(self) -> dict[str, int]:
        t = self.mtime * _NS
        return {"st_ino": self.ino, "st_mode": self.mode, "st_nlink": self.nlink,
                "st_uid": self.uid, "st_gid": self.gid, "st_size": self.size,
                "st_rdev": self.rdev, "st_blocks": (self.size + 511) // 512,
                "st_atime": t, "st_mtime": t, "st_ctime": t}


def build_tree(entries: Sequence[Entry]) -> dict[str, Node]:
    """Path (``""`` is the root, no leading ``/``) → ``Node``: the layer as an overlay lower
    dir (see the module docstring). Pure: no I/O."""
    nodes: dict[str, Node] = {"": Node(1, stat.S_IFDIR | 0o755, 0, 0, 0, children={})}
    next_ino = len(entries) + 2

    def parent_dir(path: str) -> Node:
        nonlocal next_ino
        parent = path.rpartition("/")[0]
        node = nodes.get(parent)
        if node is not None and node.is_dir:
            return node
        grand = parent_dir(parent)  # missing (or shadowed by a non-dir): synthesise
        node = Node(next_ino, stat.S_IFDIR | 0o755, 0, 0, 0, children={})
        next_ino += 1
        _place(nodes, grand, parent, node)
        return node

    for i, e in enumerate(entries):
        path = e.path.strip("/")
        if not path:
            continue
        base = path.rpartition("/")[2]
        parent = parent_dir(path)
        if base.startswith(WHITEOUT_PREFIX):
            if base == OPAQUE_MARKER:
                parent.xattrs[OPAQUE_XATTR] = b"y"
            elif not base.startswith(".wh..wh.") and base[4:] not in ("", ".", ".."):
                target = path[:len(path) - len(base)] + base[4:]
                _place(nodes, parent, target,
                       Node(i + 2, stat.S_IFCHR | 0o600, e.uid, e.gid, e.mtime, rdev=0))
            continue
        if e.type == "hardlink":
            node = nodes.get(e.linkname.strip("/"))
            if node is None or not stat.S_ISREG(node.mode):
                log.warning("hardlink %s points to %s, not an earlier regular file: skipped",
                            path, e.linkname)
                continue
            if nodes.get(path) is node:
                continue
            node.nlink += 1
            _place(nodes, parent, path, node)
            continue
        old = nodes.get(path)
        if e.type == "dir" and old is not None and old.is_dir:
            # a synthesised parent (or a repeated dir) takes the member's metadata
            old.mode, old.uid, old.gid, old.mtime = stat.S_IFDIR | e.mode, e.uid, e.gid, e.mtime
            old.xattrs.update(e.xattrs)
            continue
        fmt = _IFMT.get(e.type)
        if fmt is None:
            log.warning("member %s has unknown type %r: skipped", path, e.type)
            continue
        node = Node(i + 2, fmt | e.mode, e.uid, e.gid, e.mtime, xattrs=dict(e.xattrs))
        if e.type == "file":
            node.size, node.read_path = e.size, path
            node.frames = tuple(c.offset for c in e.chunks)
        elif e.type == "symlink":
            node.link, node.size = e.linkname, len(os.fsencode(e.linkname))
        elif e.type in ("char", "block"):
            node.rdev = os.makedev(e.devmajor, e.devminor)
        elif e.type == "dir":
            node.children = {}
        _place(nodes, parent, path, node)
    for node in nodes.values():
        if node.is_dir:
            node.nlink = 2
    for path, node in nodes.items():  # a directory's ".." links its parent
        if node.is_dir and path:
            nodes[path.rpartition("/")[0]].nlink += 1
    return nodes


def _place(nodes: dict[str, Node], parent: Node, path: str, node: Node) -> None:
    """Put ``node`` at ``path`` below ``parent``, replacing what was there (a replaced
    directory takes its subtree with it; a replaced hardlink name drops one link)."""
    old = nodes.get(path)
    if old is not None:
        if old.is_dir:
            prefix = path + "/"
            for p in [p for p in nodes if p.startswith(prefix)]:
                del nodes[p]
        elif stat.S_ISREG(old.mode) and old.nlink > 1:
            old.nlink -= 1
    nodes[path] = node
    assert parent.children is not None
    parent.children.pop(path.rpartition("/")[2], None)  # re-added last: tar order
    parent.children[path.rpartition("/")[2]] = None


def statfs_of(nodes: dict[str, Node]) -> dict[str, int]:
    total = sum(n.size for n in {id(n): n for n in nodes.values()}.values()
                if stat.S_ISREG(n.mode))
    return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": (total + 4095) // 4096,
            "f_bfree": 0, "f_bavail": 0, "f_files": len(nodes), "f_ffree": 0,
            "f_favail": 0, "f_namemax": 255, "f_flag": os.ST_RDONLY}


# -- caching -----------------------------------------------------------------------------------

class TieredChunkCache:
    """An in-memory LRU of pieces in front of the node's disk ``ChunkCache``: a disk hit is
    promoted, a put goes to both (same interface as ``ChunkCache``). Disk writes (a file and
    a sha256 trailer per piece: a third of a prefetch's CPU) are done by a background thread,
    off the path of the read that fetched the piece; the memory tier holds it meanwhile."""

    def __init__(self, memory: MemoryChunkCache, disk: Any) -> None:
        import queue

        self.memory = memory
        self.disk = disk
        self._queue: queue.Queue[tuple[str, bytes]] = queue.Queue(maxsize=4096)
        if disk is not None:
            threading.Thread(target=self._write_behind, name="chunk-cache-writer",
                             daemon=True).start()

    def get(self, key: str) -> bytes | None:
        data = self.memory.get(key)
        if data is None and self.disk is not None:
            data = self.disk.get(key)
            if data is not None:
                self.memory.put(key, data)
        return data

    def put(self, key: str, data: bytes) -> None:
        import queue

        self.memory.put(key, data)
        if self.disk is not None:
            try:
                self._queue.put_nowait((key, data))
            except queue.Full:  # writes fall behind: write this one here
                self._put_disk(key, data)

    def _put_disk(self, key: str, data: bytes) -> None:
        try:
            self.disk.put(key, data)
        except (OSError, EnvbuildError) as e:  # a cache: the piece is refetched if needed
            log.warning("chunk cache write: %s", e)

    def _write_behind(self) -> None:
        while True:
            key, data = self._queue.get()
            self._put_disk(key, data)


# -- the filesystem ----------------------------------------------------------------------------

def _operations_base() -> type:
    try:
        import mfusepy
    except (ImportError, OSError) as e:  # OSError: libfuse3 itself is missing
        raise RuntimeShimError(f"lazy mode needs mfusepy and libfuse3: {e}",
                               hint="install the fuse3 package (scripts/setup.sh) and "
                                    "`pip install mfusepy`") from None
    return mfusepy.Operations


class _Frames:
    """Which frames of a layer are loaded (every file inside them verified and cached) or being
    fetched, so a read waits for a fetch in flight (readahead, prefetch) instead of repeating
    it. Small files share frames (lazy framing): loading a frame caches every file wholly
    inside it, which costs no extra request."""

    def __init__(self, layer: LazyLayer, nodes: dict[str, Node]) -> None:
        self.layer = layer
        self.cv = threading.Condition()
        self.loaded: set[int] = set()
        self.inflight: set[int] = set()
        self.mates: dict[int, list[str]] = {}
        for node in {id(n): n for n in nodes.values()}.values():
            if len(node.frames) == 1:
                self.mates.setdefault(node.frames[0], []).append(node.read_path)

    def missing(self, node: Node) -> bool:
        return any(f not in self.loaded for f in node.frames)

    def load(self, nodes: Sequence[Node], *, wait: bool = True,
             workers: int | None = None) -> None:
        """Load the frames of ``nodes``; ``wait=False`` (background): only those no one is
        fetching, and return at once if there are none. ``workers``: parallel requests
        (default: the layer's)."""
        while True:
            with self.cv:
                missing = {f for n in nodes for f in n.frames if f not in self.loaded}
                if not missing:
                    return
                mine = missing - self.inflight
                if not mine:
                    if not wait:
                        return
                    self.cv.wait()
                    continue
                self.inflight |= mine
            ok = False
            try:
                paths = [n.read_path for n in nodes if any(f in mine for f in n.frames)]
                paths += [p for f in sorted(mine) for p in self.mates.get(f, ())]
                self.layer.prefetch(paths, workers=workers)
                ok = True
            finally:
                with self.cv:
                    self.inflight -= mine
                    if ok:
                        self.loaded |= mine
                    self.cv.notify_all()
            if not wait:
                return


class _Trace:
    """The files of a layer in the order they were first read, until ``until`` (monotonic
    clock) or ``max_files``: what a lazy profile records."""

    def __init__(self, until: float, max_files: int = 20000) -> None:
        self.until, self.max_files = until, max_files
        self.paths: list[str] = []
        self._seen: set[int] = set()

    def add(self, node: Node) -> None:
        import time

        if node.ino in self._seen or len(self.paths) >= self.max_files \
                or time.monotonic() > self.until:
            return
        self._seen.add(node.ino)
        self.paths.append(node.read_path)


def prefetch_in_order(frames: _Frames, nodes: dict[str, Node], paths: Sequence[str], *,
                      first_batch: int = 1 << 20, max_batch: int = 16 << 20,
                      workers: int = BACKGROUND_WORKERS) -> int:
    """Load the regular files among ``paths`` in their order, in batches whose merged reads
    run in parallel, skipping frames someone else is fetching (a reader waits for those).
    Batches start at ``first_batch`` bytes and double up to ``max_batch``: the first files
    (what starts first) arrive soon, the rest in few large requests; a reader waiting for a
    frame waits for its whole batch; ``workers`` parallel requests, few, so that reads
    (on-demand fetches) are not queued behind them. Returns the files asked for."""
    batch: list[Node] = []
    size = count = 0
    limit = first_batch
    for p in paths:
        n = nodes.get(p.strip("/"))
        if n is None or not n.read_path or not frames.missing(n):
            continue
        batch.append(n)
        size += n.size
        count += 1
        if size >= limit:
            frames.load(batch, wait=False, workers=workers)
            batch, size, limit = [], 0, min(limit * 2, max_batch)
    if batch:
        frames.load(batch, wait=False, workers=workers)
    return count


def make_operations(layer: LazyLayer, nodes: dict[str, Node], *,
                    on_init: Any = None, trace: _Trace | None = None):
    """The mfusepy ``Operations`` serving ``nodes`` with contents from ``layer``. ``on_init``
    is called once the kernel's INIT arrived (the mount is up); ``trace``, when given, is
    told of every read (the layer's access profile)."""
    import mfusepy

    FuseOSError = mfusepy.FuseOSError
    stats_of = statfs_of(nodes)
    frames = _Frames(layer, nodes)
    readahead = _Readahead(layer, nodes, frames)

    def node_at(path: str) -> Node:
        node = nodes.get(path.strip("/"))
        if node is None:
            raise FuseOSError(errno.ENOENT)
        return node

    class LazyOperations(_operations_base()):
        use_ns = True
        # exposed for the node daemon (profile prefetch) and tests
        lazy_layer, lazy_nodes, lazy_frames = layer, nodes, frames

        def init_with_config(self, conn, config) -> None:
            if config is not None:
                config.kernel_cache = 1
                config.use_ino = 1
                config.readdir_ino = 1
                config.entry_timeout = CACHE_TTL
                config.attr_timeout = CACHE_TTL
                config.negative_timeout = CACHE_TTL
            if on_init is not None:
                on_init()

        def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
            return node_at(path).attrs()

        def readlink(self, path: str) -> str:
            node = node_at(path)
            if not stat.S_ISLNK(node.mode):
                raise FuseOSError(errno.EINVAL)
            return node.link

        def opendir(self, path: str) -> int:
            if not node_at(path).is_dir:
                raise FuseOSError(errno.ENOTDIR)
            return 0

        def readdir(self, path: str, fh: int) -> Iterator[tuple[str, dict[str, int], int]]:
            key = path.strip("/")
            node = node_at(key)
            if not node.is_dir:
                raise FuseOSError(errno.ENOTDIR)
            parent = nodes[key.rpartition("/")[0]] if key else node
            yield ".", {"st_mode": node.mode, "st_ino": node.ino}, 0
            yield "..", {"st_mode": parent.mode, "st_ino": parent.ino}, 0
            prefix = key + "/" if key else ""
            for name in list(node.children):
                child = nodes.get(prefix + name)
                if child is not None:
                    yield name, {"st_mode": child.mode, "st_ino": child.ino}, 0

        def open(self, path: str, flags: int) -> int:
            node = node_at(path)
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
                raise FuseOSError(errno.EROFS)
            if not node.read_path:
                raise FuseOSError(errno.EISDIR if node.is_dir else errno.EACCES)
            return 0  # nothing fetched until the first read

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            node = node_at(path)
            if offset >= node.size:
                return b""
            if trace is not None:
                trace.add(node)
            try:
                if frames.missing(node):
                    # one fetch per frame at a time: a second reader waits for it
                    frames.load([node])
                    readahead.schedule(path.strip("/").rpartition("/")[0])
                return layer.read(node.read_path, offset, size)
            except EnvbuildError as e:
                log.error("read %s: %s", node.read_path, e)
                raise FuseOSError(errno.EIO) from None

        def release(self, path: str, fh: int) -> int:
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            return stats_of

        def listxattr(self, path: str) -> list[str]:
            return list(node_at(path).xattrs)

        def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
            node = node_at(path)
            value = node.xattrs.get(name)
            if value is None:
                if name == LAZY_STATS_XATTR and path.strip("/") == "":
                    return json.dumps({**layer.stats.as_dict(), "pid": os.getpid()}).encode()
                raise FuseOSError(errno.ENODATA)
            return value

        # writes: refused (the mount is ro too; these make the answer EROFS, not ENOSYS)
        def _rofs(self, *args: Any, **kwargs: Any) -> int:
            raise FuseOSError(errno.EROFS)

        chmod = chown = create = mkdir = mknod = rename = rmdir = symlink = truncate = \
            unlink = utimens = write = setxattr = removexattr = link = _rofs

    return LazyOperations()


class _Readahead:
    """Directory readahead: after a file of directory D was fetched, fetch D's other small
    regular files in the background, once per directory, at most ``budget`` bytes. Tar order
    keeps a directory's files together, so this is a few merged ranged reads; it serves
    programs that open a package's files one by one (Python imports, shared libraries)."""

    def __init__(self, layer: LazyLayer, nodes: dict[str, Node], frames: _Frames, *,
                 max_file: int = 1 << 20, budget: int = 8 << 20) -> None:
        self.layer, self.nodes, self.frames = layer, nodes, frames
        self.max_file, self.budget = max_file, budget
        self.done: set[str] = set()
        self.queue: list[str] = []
        self.cv = threading.Condition()
        threading.Thread(target=self._run, name="lazy-readahead", daemon=True).start()

    def schedule(self, directory: str) -> None:
        with self.cv:
            if directory in self.done:
                return
            self.done.add(directory)
            self.queue.append(directory)
            self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                directory = self.queue.pop()  # the latest first: what runs now
            d = self.nodes.get(directory)
            if d is None or not d.is_dir:
                continue
            prefix = directory + "/" if directory else ""
            todo, total = [], 0
            for name in d.children:
                n = self.nodes.get(prefix + name)
                if (n is None or not n.read_path or n.size > self.max_file
                        or not self.frames.missing(n)):
                    continue
                total += n.size
                if total > self.budget:
                    break
                todo.append(n)
            if not todo:
                continue
            try:
                self.frames.load(todo, wait=False, workers=BACKGROUND_WORKERS)
            except EnvbuildError as e:  # a foreground read will report it
                log.warning("readahead of %s: %s", directory or "/", e)


def lazy_stats(mountpoint: str | os.PathLike[str]) -> dict[str, int]:
    """The ``LazyStats`` (and ``pid``) of the daemon serving ``mountpoint``."""
    try:
        return json.loads(os.getxattr(mountpoint, LAZY_STATS_XATTR))
    except OSError as e:
        raise RuntimeShimError(f"read lazy layer stats at {mountpoint}: {e.strerror}") from e


def store_location(store: Any) -> tuple[str, str | None]:
    """``(url, s3_endpoint)`` another process can open ``store`` with (the daemon's
    ``--store``/``--s3-endpoint``): a ``LocalStore``'s absolute root, an ``S3Store``'s URL and
    endpoint. Credentials are not passed: the daemon inherits the environment."""
    url = getattr(store, "url", None)
    if isinstance(url, str) and url.startswith("s3://"):
        return url, getattr(store, "endpoint", None)
    root = getattr(store, "root", None)
    if root is not None:
        return os.path.abspath(os.fspath(root)), None
    raise RuntimeShimError(f"lazy mode cannot serve layers from {store!r}: the FUSE daemon is "
                           "another process and must open the store by URL",
                           hint="use a store directory or an s3:// store, or drop --lazy")


#: Store record namespace of lazy profiles; the name is ``profile_key(layer digests)``.
PROFILE_NAMESPACE = "lazy-profiles"
PROFILE_VERSION = 1
#: Seconds after a layer stack's first mount during which its reads are recorded.
PROFILE_WINDOW = 10.0


def profile_key(digests: Sequence[str]) -> str:
    """The name of the lazy profile of a layer stack (bottom to top). Versioned: a profile
    is a hint, but one recorded under another format must not be read as this one."""
    import hashlib

    return hashlib.sha256(("envbuild.lazy-profile.v1\0" + "\0".join(digests)).encode()
                          ).hexdigest()


def read_profile(store: Any, digests: Sequence[str]) -> dict[str, list[str]] | None:
    """Layer digest → the files its stack's first lazy run read, in order (``None``: no
    usable profile). Record ``lazy-profiles/<profile_key>``::

        {"version": 1, "layers": [{"digest": D, "files": [PATH, ...]}, ...]}

    written by the node daemon ``PROFILE_WINDOW`` seconds after it first mounted the stack,
    or when one of its mounts goes away if that is sooner (stargz's prioritized files,
    recorded instead of declared)."""
    get = getattr(store, "get_record", None)
    if get is None:
        return None
    try:
        rec = get(PROFILE_NAMESPACE, profile_key(digests))
    except EnvbuildError as e:  # a hint only: never fail a sandbox for it
        log.warning("read lazy profile: %s", e)
        return None
    if not isinstance(rec, dict) or rec.get("version") != PROFILE_VERSION:
        return None
    out = {}
    for layer in rec.get("layers", ()):
        if isinstance(layer, dict) and isinstance(layer.get("files"), list):
            out[str(layer.get("digest"))] = [str(p) for p in layer["files"]]
    return out


def lazy_layer_dirs(node: Any, store: Any, layers: Sequence[Any]) -> list[str]:
    """``Sandbox.create(lazy=True)``: the lazy mounts of ``layers`` (``LayerRef``s, bottom to
    top) in node cache ``node``, asked of the node daemon in parallel. An ``S3Store`` hands the
    daemon a presigned URL per blob, so it reads ranges without loading boto3. Layers not
    mounted yet get the stack's lazy profile prefetched in the background (``read_profile``),
    or, without one, have their reads recorded as the profile."""
    from concurrent.futures import ThreadPoolExecutor

    from runtime_shim.nodecache import _lazy_mount_state

    url, endpoint = store_location(store)
    presign = getattr(store, "presigned_get_url", None)
    digests = [x.digest for x in layers]
    profile, record = None, None
    if not all(_lazy_mount_state(node.lazy_dir(d)) == "ok" for d in digests):
        profile = read_profile(store, digests)
        record = None if profile is not None else {
            "key": profile_key(digests), "layers": digests, "store": url,
            "s3_endpoint": endpoint}

    def one(layer: Any) -> str:
        ranges_url = presign(layer.digest) if presign is not None else None
        return str(node.ensure_lazy(url, layer.digest, layer.toc_digest or None,
                                    s3_endpoint=endpoint, size=layer.size,
                                    ranges_url=ranges_url, record_profile=record))

    if len(layers) <= 1:
        dirs = [one(layer) for layer in layers]
    else:
        with ThreadPoolExecutor(min(8, len(layers)), thread_name_prefix="lazy-mount") as pool:
            dirs = list(pool.map(one, layers))
    if profile:
        daemon_request(node.root, {"op": "prefetch", "layers": [
            {"mountpoint": d, "paths": profile.get(x.digest, [])}
            for d, x in zip(dirs, layers)]}, 10.0)
    return dirs


# -- the node daemon ---------------------------------------------------------------------------
#
# One process per node cache serves every lazy layer of the host, each as its own FUSE mount
# (one libfuse session and loop per mount, in threads of this process): the interpreter, the
# imports, the chunk caches and the store connections are paid for once, not once per layer.
# Clients (``NodeCache.ensure_lazy``) talk to it over a Unix socket in the abstract namespace
# (``daemon_address``: no socket file to go stale; it vanishes with the process), one JSON
# line each way:
#
#     {"op": "ping"}                                   -> {"ok": true, "pid": P}
#     {"op": "mount", "mountpoint": M, "store": URL, "s3_endpoint": E|null, "digest": D,
#      "toc_digest": T|null, "size": N|null, "ranges_url": U|null,
#      "profile": {"key", "layers", "store", "s3_endpoint"}|null}
#     {"op": "prefetch", "layers": [{"mountpoint": M, "paths": [PATH, ...]}, ...]}
#                                                      -> {"ok": true, "started": N}
#                                                      -> {"ok": true, "pid": P}
#                                                      |  {"ok": false, "error": TEXT}
#
# "mount" opens the layer (footer, TOC: a wrong digest is an error reply, never a mount) and
# answers once the kernel's INIT arrived. A mount ends when it is unmounted; the daemon exits
# once it has served no mount and no request for ``DAEMON_IDLE_EXIT`` seconds, and on
# SIGTERM/SIGINT/SIGHUP it unmounts everything first. "prefetch" (the stack's profile, sent
# once all its mounts are up, so it does not slow their opening) loads files of mounted layers
# in the background; a mount's "profile" makes the daemon record the layer's
# reads and save the stack's profile (``read_profile``) to the store. A client that finds no daemon (connection
# refused, or reset by one that is exiting) starts one and asks again.

#: Seconds a daemon without mounts or requests waits before it exits.
DAEMON_IDLE_EXIT = 1.0


def daemon_address(node_root: str | os.PathLike[str]) -> bytes:
    """The abstract Unix socket address of the daemon of node cache ``node_root``."""
    import hashlib

    key = hashlib.sha256(os.fsencode(os.path.abspath(node_root))).hexdigest()[:32]
    return b"\0envbuild-lazyfs-" + key.encode()


def daemon_request(node_root: str | os.PathLike[str], req: dict[str, Any],
                   timeout: float) -> dict[str, Any] | None:
    """Send ``req`` to the node daemon and return its reply; ``None`` when no daemon answers
    (none runs, or it is exiting)."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(daemon_address(node_root))
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        try:
            sock.sendall(json.dumps(req).encode() + b"\n")
            reply = _read_line(sock)
        except (BrokenPipeError, ConnectionResetError):
            return None
        except TimeoutError:
            raise RuntimeShimError(f"the lazy layer daemon of {node_root} did not answer "
                                   f"within {timeout:.0f} s") from None
        return json.loads(reply) if reply else None
    finally:
        sock.close()


def _read_line(sock: Any) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        part = sock.recv(65536)
        if not part:
            break
        buf += part
    return buf


class _NodeDaemon:
    def __init__(self, root: str, chunk_cache_max: int, memory_cache: int) -> None:
        self.root = root
        self.cache = TieredChunkCache(MemoryChunkCache(memory_cache),
                                      ChunkCache(os.path.join(root, "chunks"), chunk_cache_max))
        self.lock = threading.Lock()
        self.mounts: dict[int, str] = {}      # id -> mountpoint
        self.threads: list[threading.Thread] = []
        self.busy = 0
        self.last = 0.0
        self.stop = False
        self._next = 0
        self._stores: dict[tuple[str, str | None], Any] = {}
        self.profiles: dict[str, dict[str, Any]] = {}  # key -> {"req", "traces", "saved"}
        self.ops: dict[str, Any] = {}  # mountpoint -> its Operations

    def _store(self, url: str, endpoint: str | None) -> Any:
        from envbuild.store import open_store

        with self.lock:
            store = self._stores.get((url, endpoint))
        if store is None:
            store = open_store(url, s3_endpoint=endpoint)
            with self.lock:
                store = self._stores.setdefault((url, endpoint), store)
        return store

    def serve(self) -> int:
        import signal
        import socket
        import time

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(daemon_address(self.root))
        except OSError as e:
            log.info("another daemon serves %s (%s): exiting", self.root, e.strerror)
            return 0
        sock.listen(64)
        sock.settimeout(0.1)

        def stop(signum: int, frame: Any) -> None:
            self.stop = True
        # Before any mount: libfuse installs its own handlers only where none is set, and
        # those would end just one of the sessions.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, stop)
        log.info("lazy layer daemon of %s up", self.root)
        self.last = time.monotonic()
        try:
            while not self.stop:
                try:
                    conn, _ = sock.accept()
                except TimeoutError:
                    with self.lock:
                        idle = (not self.mounts and not self.busy
                                and time.monotonic() - self.last > DAEMON_IDLE_EXIT)
                    if idle:
                        break
                    continue
                with self.lock:
                    self.busy += 1
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        finally:
            sock.close()
        if self.stop:
            from runtime_shim.mount import unmount

            with self.lock:
                targets = list(self.mounts.values())
            for mp in targets:
                try:
                    unmount(mp)
                except EnvbuildError as e:
                    log.warning("%s", e)
        for t in list(self.threads):
            t.join(5)
        log.info("lazy layer daemon of %s exits", self.root)
        return 0

    def _handle(self, conn: Any) -> None:
        import time

        try:
            conn.settimeout(None)
            req = json.loads(_read_line(conn) or b"{}")
            op = req.get("op")
            if op == "ping":
                reply: dict[str, Any] = {"ok": True, "pid": os.getpid()}
            elif op == "mount":
                reply = self._mount(req)
            elif op == "prefetch":
                reply = self._start_prefetch(req)
            else:
                reply = {"ok": False, "error": f"unknown request {op!r}"}
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except Exception:  # noqa: BLE001 - a bad client must not take the daemon down
            log.exception("request failed")
        finally:
            conn.close()
            with self.lock:
                self.busy -= 1
                self.last = time.monotonic()

    def _mount(self, req: dict[str, Any]) -> dict[str, Any]:
        import time

        mp, digest = req["mountpoint"], req["digest"]
        url, endpoint = req["store"], req.get("s3_endpoint")
        ready = threading.Event()
        try:
            if req.get("ranges_url"):  # the full store (boto3) only if the URL stops working
                store = HttpRanges(digest, req["ranges_url"], lambda: self._store(url, endpoint))
            else:
                store = self._store(url, endpoint)
            layer = LazyLayer(store, digest, chunk_cache=self.cache,
                              expected_toc_digest=req.get("toc_digest") or None,
                              size=req.get("size"))
            nodes = build_tree(layer.entries())
            prof = req.get("profile")
            trace = self._trace(prof, digest) if prof else None
            ops = make_operations(layer, nodes, on_init=ready.set, trace=trace)
        except EnvbuildError as e:
            log.error("serve %s: %s", digest, e.message)
            return {"ok": False, "error": "\n".join(e.render_lines())}
        failed: list[str] = []
        with self.lock:
            self._next += 1
            key = self._next
            self.mounts[key] = mp

        def run() -> None:
            import mfusepy

            log.info("serving %s (%d entries, TOC %d bytes) at %s", digest, len(nodes),
                     layer.stats.toc_bytes, mp)
            try:
                # The caching and inode options are also given as mount options: libfuse
                # parses them itself, which does not depend on mfusepy's view of libfuse's
                # config struct (the struct route alone left st_ino unset with libfuse 3.14:
                # hardlinks got two inodes).
                mfusepy.FUSE(ops, mp, foreground=True, nothreads=False, ro=True,
                             allow_other=True, default_permissions=True,
                             fsname=f"envbuild-lazy-{digest[7:19]}", subtype="envbuild",
                             use_ino=True, readdir_ino=True, kernel_cache=True,
                             entry_timeout=CACHE_TTL, attr_timeout=CACHE_TTL,
                             negative_timeout=CACHE_TTL)
            except BaseException as e:  # noqa: BLE001 - reported to the client
                failed.append(f"mount {mp}: libfuse failed ({e})")
            finally:
                if prof:
                    self._save_profile(prof["key"])
                with self.lock:
                    del self.mounts[key]
                    if self.ops.get(mp) is ops:
                        del self.ops[mp]
                    self.last = time.monotonic()
                ready.set()
                log.info("unmounted %s; stats %s", mp, json.dumps(layer.stats.as_dict()))

        t = threading.Thread(target=run, name=f"fuse-{digest[7:19]}", daemon=True)
        with self.lock:
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        t.start()
        if not ready.wait(req.get("timeout", 30)) or failed:
            why = failed[0] if failed else "the kernel did not send INIT in time"
            log.error("%s", why)
            return {"ok": False, "error": why}
        with self.lock:
            self.ops[mp] = ops
        return {"ok": True, "pid": os.getpid()}

    def _start_prefetch(self, req: dict[str, Any]) -> dict[str, Any]:
        started = 0
        for item in req.get("layers", ()):
            with self.lock:
                ops = self.ops.get(item["mountpoint"])
            if ops is not None and item.get("paths"):
                threading.Thread(target=self._prefetch,
                                 args=(ops, item["paths"], ops.lazy_layer.digest),
                                 name="prefetch", daemon=True).start()
                started += 1
        return {"ok": True, "started": started}

    def _prefetch(self, ops: Any, paths: Sequence[str], digest: str) -> None:
        import time

        t0 = time.monotonic()
        try:
            n = prefetch_in_order(ops.lazy_frames, ops.lazy_nodes, paths)
        except EnvbuildError as e:  # a foreground read will report it
            log.warning("prefetch of %s: %s", digest, e)
            return
        log.info("prefetched %d of %d profiled files of %s in %.2f s", n, len(paths), digest,
                 time.monotonic() - t0)

    def _trace(self, prof: dict[str, Any], digest: str) -> _Trace:
        import time

        with self.lock:
            rec = self.profiles.get(prof["key"])
            if rec is None:
                rec = self.profiles[prof["key"]] = {
                    "req": prof, "traces": {}, "saved": False,
                    "until": time.monotonic() + PROFILE_WINDOW}
                timer = threading.Timer(PROFILE_WINDOW, self._save_profile, (prof["key"],))
                timer.daemon = True
                timer.start()
            trace = rec["traces"][digest] = _Trace(rec["until"])
        return trace

    def _save_profile(self, key: str) -> None:
        with self.lock:
            rec = self.profiles.get(key)
            if rec is None or rec["saved"]:
                return
            rec["saved"] = True
        prof, traces = rec["req"], rec["traces"]
        with self.lock:
            layers = [{"digest": d, "files": list(traces[d].paths)}
                      for d in prof["layers"] if d in traces]
        if not any(x["files"] for x in layers):
            return
        try:
            store = self._store(prof["store"], prof.get("s3_endpoint"))
            store.put_record(PROFILE_NAMESPACE, key,
                             {"version": PROFILE_VERSION, "layers": layers})
        except Exception as e:  # noqa: BLE001 - a hint only; never take a mount down for it
            log.warning("save lazy profile %s: %s", key, e)
            return
        log.info("saved lazy profile %s (%d files)", key,
                 sum(len(x["files"]) for x in layers))


# -- the daemon command ------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime_shim.lazyfs",
                                description="Serve lazy layers as read-only FUSE filesystems "
                                            "(overlay lower dirs): every layer of a node cache "
                                            "(--node), or one layer at --mountpoint.")
    p.add_argument("--node", default=None,
                   help="the node cache directory: serve its lazy mounts until none is left")
    p.add_argument("--store", help="store URL: a directory or s3://BUCKET/PREFIX")
    p.add_argument("--s3-endpoint", default=None)
    p.add_argument("--digest")
    p.add_argument("--toc-digest", default=None)
    p.add_argument("--size", type=int, default=None, help="blob size (saves a request)")
    p.add_argument("--mountpoint")
    p.add_argument("--chunk-cache", help="the node's chunk cache directory")
    p.add_argument("--chunk-cache-max", default="10G")
    p.add_argument("--memory-cache", default="256M")
    p.add_argument("--debug", action="store_true", help="libfuse debug output")
    return p


def open_layer(args: argparse.Namespace) -> tuple[LazyLayer, dict[str, Node]]:
    from envbuild.store import open_store
    from runtime_shim.nodecache import parse_size

    store = open_store(args.store, s3_endpoint=args.s3_endpoint)
    cache = TieredChunkCache(MemoryChunkCache(parse_size(args.memory_cache)),
                             ChunkCache(args.chunk_cache, parse_size(args.chunk_cache_max)))
    layer = LazyLayer(store, args.digest, chunk_cache=cache,
                      expected_toc_digest=args.toc_digest or None, size=args.size)
    return layer, build_tree(layer.entries())


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s lazyfs[%(process)d] %(levelname)s %(message)s")
    from runtime_shim.nodecache import parse_size

    if args.node:
        try:
            _operations_base()
        except EnvbuildError as e:
            print("\n".join(e.render_lines()), file=sys.stderr)
            return 1
        return _NodeDaemon(os.path.abspath(args.node), parse_size(args.chunk_cache_max),
                           parse_size(args.memory_cache)).serve()
    missing = [f"--{n}" for n in ("store", "digest", "mountpoint", "chunk-cache")
               if not getattr(args, n.replace("-", "_"))]
    if missing:
        parser.error(f"without --node, these are required: {', '.join(missing)}")
    try:
        layer, nodes = open_layer(args)
        _operations_base()
    except EnvbuildError as e:
        print("\n".join(e.render_lines()), file=sys.stderr)
        return 1
    import mfusepy

    log.info("serving %s (%d entries, TOC %d bytes) at %s", args.digest, len(nodes),
             layer.stats.toc_bytes, args.mountpoint)
    try:
        mfusepy.FUSE(make_operations(layer, nodes), args.mountpoint, foreground=True,
                     nothreads=False, debug=args.debug, ro=True, allow_other=True,
                     default_permissions=True, fsname=f"envbuild-lazy-{args.digest[7:19]}",
                     subtype="envbuild", use_ino=True, readdir_ino=True, kernel_cache=True,
                     entry_timeout=CACHE_TTL, attr_timeout=CACHE_TTL,
                     negative_timeout=CACHE_TTL)
    except RuntimeError as e:
        print(f"error: mount {args.mountpoint}: libfuse failed ({e})", file=sys.stderr)
        return 1
    log.info("unmounted %s; stats %s", args.mountpoint, json.dumps(layer.stats.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
