"""Lazy layers: a read-only FUSE filesystem per layer, served from the store by ``LazyLayer``.

(How reads are served once a file is fetched — FUSE passthrough into the node's file cache,
or this docstring's libfuse path as the fallback — is in ``passthrough`` and
docs/lazy-loading.md; what the mount presents is the same either way.)

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
mount (protocol: ``runtime_shim.lazyfs.control``), started detached (own session) by
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

Where each concern lives (this package re-exports the public names):

==================  ========================================================================
``tree``            the TOC-backed inode table: ``build_tree`` → path → ``Node`` (pure)
``chunks``          ``TieredChunkCache``: memory LRU in front of the node's disk chunk cache
``frames``          fetching frames for the filesystem: one fetch per frame at a time,
                    directory readahead, profile prefetch in order
``passthrough``     the FUSE passthrough filesystem over ``/dev/fuse`` (the default where
                    the kernel offers it): fetched files are read by the kernel itself;
                    its connection and probe in ``fuseconn``, its open in
                    ``passthrough_open``
``filecache``       the node's content-addressed file cache (single-flight), fetch
                    concurrency and timeouts
``fuseops``         the libfuse filesystem (the fallback): ``make_operations`` (mfusepy),
                    ``lazy_stats``
``profile``         lazy profiles: record the first run's reads, prefetch them next time
``control``         the daemon's control socket: who may talk to it, the protocol,
                    ``daemon_request``
``daemon``          the node daemon process serving every lazy mount of a node cache;
                    its parts: ``daemon_requests``, ``daemon_mounts``, ``daemon_ahead``,
                    ``daemon_profiles``, ``daemon_memory``
``metalayer``       files already on the node served by overlayfs alone (meta layers);
                    their trees in ``metatree``, their generations on disk in ``metagen``
``pydeps``          what a ``.pyc`` imports next (``pystartup``: an interpreter's start-up
                    files), fetched ahead by ``pyahead``
``mounts``          client side: ``lazy_layer_dirs`` (``Sandbox.create(lazy=True)``),
                    ``store_location``
``__main__``        ``python -m runtime_shim.lazyfs``
==================  ========================================================================

Dependencies point one way: ``runtime_shim.node.nodecache`` uses ``control`` (to start and ask the
daemon); nothing here imports ``nodecache``.
"""

from __future__ import annotations

from envbuild._lazy import lazy_exports
from runtime_shim.lazyfs.chunks import TieredChunkCache
from runtime_shim.lazyfs.control import DAEMON_IDLE_EXIT, daemon_request
from runtime_shim.lazyfs.frames import BACKGROUND_WORKERS, prefetch_in_order
from runtime_shim.lazyfs.fuseops import (
    CACHE_TTL,
    LAZY_STATS_XATTR,
    lazy_stats,
    make_operations,
)
from runtime_shim.lazyfs.mounts import lazy_layer_dirs, store_location
from runtime_shim.lazyfs.profile import (
    PROFILE_NAMESPACE,
    PROFILE_VERSION,
    PROFILE_WINDOW,
    profile_key,
    read_profile,
)
from runtime_shim.lazyfs.tree import Node, build_tree, statfs_of

__all__ = [
    "BACKGROUND_WORKERS",
    "CACHE_TTL",
    "DAEMON_IDLE_EXIT",
    "LAZY_STATS_XATTR",
    "Node",
    "PROFILE_NAMESPACE",
    "PROFILE_VERSION",
    "PROFILE_WINDOW",
    "TieredChunkCache",
    "build_tree",
    "collect_objects",
    "daemon_request",
    "describe",
    "describe_native",
    "describe_objects",
    "index_layer_file",
    "index_reader",
    "lazy_layer_dirs",
    "lazy_stats",
    "make_operations",
    "prefetch_in_order",
    "profile_key",
    "read_profile",
    "statfs_of",
    "store_location",
]

# Imported on first use: what the CLI and the build read of meta layers and import indexes.
__getattr__, _ = lazy_exports(__name__, {
    "collect_objects": "runtime_shim.lazyfs.objcollect",
    "describe": "runtime_shim.lazyfs.metalayer",
    "describe_native": "runtime_shim.lazyfs.native",
    "describe_objects": "runtime_shim.lazyfs.objgc",
    "index_layer_file": "runtime_shim.lazyfs.pyindex",
    "index_reader": "runtime_shim.lazyfs.pyindex",
})
