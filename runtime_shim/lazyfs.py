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

**The daemon** is one process per mount, started detached (own session) so it outlives the
process that asked for it::

    python -m runtime_shim.lazyfs --store URL [--s3-endpoint URL] --digest D [--toc-digest T]
        [--size N] --mountpoint M --chunk-cache DIR [--chunk-cache-max 10G] [--memory-cache 64M]

It opens the store (``envbuild.store.open_store``: a directory, or ``s3://`` with the
credentials and ``AWS_ENDPOINT_URL`` of its environment unless ``--s3-endpoint`` is given) and the
layer *before* mounting, so a wrong digest or an unreachable store is an exit 1 with one line on
stderr and never a mount. It serves until the mount goes away (``umount``/``fusermount3 -u``) or
it gets SIGTERM/SIGINT (libfuse then unmounts). Reads that fail (store down, corrupt content)
return EIO and are logged on stderr. Pieces are cached in two levels: a small in-memory LRU
(``--memory-cache``) in front of the node's disk ``ChunkCache``, so the kernel's 128 KiB reads
of a file cut in 4 MiB pieces do not each re-read and re-hash the piece from disk.

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
from envbuild.store.lazy import ChunkCache, LazyLayer, MemoryChunkCache

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
    promoted, a put goes to both (same interface as ``ChunkCache``)."""

    def __init__(self, memory: MemoryChunkCache, disk: Any) -> None:
        self.memory = memory
        self.disk = disk

    def get(self, key: str) -> bytes | None:
        data = self.memory.get(key)
        if data is None and self.disk is not None:
            data = self.disk.get(key)
            if data is not None:
                self.memory.put(key, data)
        return data

    def put(self, key: str, data: bytes) -> None:
        self.memory.put(key, data)
        if self.disk is not None:
            self.disk.put(key, data)


# -- the filesystem ----------------------------------------------------------------------------

def _operations_base() -> type:
    try:
        import mfusepy
    except (ImportError, OSError) as e:  # OSError: libfuse3 itself is missing
        raise RuntimeShimError(f"lazy mode needs mfusepy and libfuse3: {e}",
                               hint="install the fuse3 package (scripts/setup.sh) and "
                                    "`pip install mfusepy`") from None
    return mfusepy.Operations


def make_operations(layer: LazyLayer, nodes: dict[str, Node]):
    """The mfusepy ``Operations`` serving ``nodes`` with contents from ``layer``."""
    import mfusepy

    FuseOSError = mfusepy.FuseOSError
    stats_of = statfs_of(nodes)
    fill_locks: dict[str, threading.Lock] = {}
    guard = threading.Lock()
    # Small files share frames (lazy framing): the first read of one fetches its frame, and
    # caching every file wholly inside that frame costs no extra request.
    frame_files: dict[int, list[str]] = {}
    for node in {id(n): n for n in nodes.values()}.values():
        if len(node.frames) == 1:
            frame_files.setdefault(node.frames[0], []).append(node.read_path)
    loaded: set[int] = set()  # frames whose files are all cached
    readahead = _Readahead(layer, nodes, loaded, guard)

    def node_at(path: str) -> Node:
        node = nodes.get(path.strip("/"))
        if node is None:
            raise FuseOSError(errno.ENOENT)
        return node

    class LazyOperations(_operations_base()):
        use_ns = True

        def init_with_config(self, conn, config) -> None:
            if config is not None:
                config.kernel_cache = 1
                config.use_ino = 1
                config.readdir_ino = 1
                config.entry_timeout = CACHE_TTL
                config.attr_timeout = CACHE_TTL
                config.negative_timeout = CACHE_TTL

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
            # one fetch per file at a time: a second reader of a file being fetched waits and
            # then hits the cache instead of fetching the file again
            with guard:
                lock = fill_locks.setdefault(node.read_path, threading.Lock())
            try:
                with lock:
                    missing = [f for f in node.frames if f not in loaded]
                    if missing:
                        mates = [p for f in missing for p in frame_files.get(f, ())]
                        layer.prefetch([node.read_path, *mates])
                        with guard:
                            loaded.update(missing)
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

    def __init__(self, layer: LazyLayer, nodes: dict[str, Node], loaded: set[int],
                 guard: threading.Lock, *, max_file: int = 1 << 20, budget: int = 8 << 20) -> None:
        self.layer, self.nodes, self.loaded, self.guard = layer, nodes, loaded, guard
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
            paths, frames, total = [], [], 0
            for name in d.children:
                n = self.nodes.get(prefix + name)
                if (n is None or not n.read_path or n.size > self.max_file
                        or all(f in self.loaded for f in n.frames)):
                    continue
                total += n.size
                if total > self.budget:
                    break
                paths.append(n.read_path)
                frames.extend(n.frames)
            if not paths:
                continue
            try:
                self.layer.prefetch(paths)
            except EnvbuildError as e:  # a foreground read will report it
                log.warning("readahead of %s: %s", directory or "/", e)
                continue
            with self.guard:
                self.loaded.update(frames)


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


def lazy_layer_dirs(node: Any, store: Any, layers: Sequence[Any]) -> list[str]:
    """``Sandbox.create(lazy=True)``: the lazy mounts of ``layers`` (``LayerRef``s, bottom to
    top) in node cache ``node``, their daemons started in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    url, endpoint = store_location(store)

    def one(layer: Any) -> str:
        return str(node.ensure_lazy(url, layer.digest, layer.toc_digest or None,
                                    s3_endpoint=endpoint, size=layer.size))

    if len(layers) <= 1:
        return [one(layer) for layer in layers]
    with ThreadPoolExecutor(min(8, len(layers)), thread_name_prefix="lazy-mount") as pool:
        return list(pool.map(one, layers))

# -- the daemon --------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime_shim.lazyfs",
                                description="Serve one layer as a read-only FUSE filesystem "
                                            "(an overlay lower dir) until unmounted.")
    p.add_argument("--store", required=True, help="store URL: a directory or s3://BUCKET/PREFIX")
    p.add_argument("--s3-endpoint", default=None)
    p.add_argument("--digest", required=True)
    p.add_argument("--toc-digest", default=None)
    p.add_argument("--size", type=int, default=None, help="blob size (saves a request)")
    p.add_argument("--mountpoint", required=True)
    p.add_argument("--chunk-cache", required=True, help="the node's chunk cache directory")
    p.add_argument("--chunk-cache-max", default="10G")
    p.add_argument("--memory-cache", default="64M")
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
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s lazyfs[%(process)d] %(levelname)s %(message)s")
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
        # The caching and inode options are also given as mount options: libfuse parses them
        # itself, which does not depend on mfusepy's view of libfuse's config struct (the
        # struct route alone left st_ino unset with libfuse 3.14: hardlinks got two inodes).
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
