"""The FUSE filesystem: mfusepy ``Operations`` serving a layer's tree from a ``LazyLayer``."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Iterator
from typing import Any

from envbuild.errors import EnvbuildError, RuntimeShimError
from envbuild.store.lazy import LazyLayer
from runtime_shim.lazyfs.frames import MISS_WINDOW, _Frames, _Readahead
from runtime_shim.lazyfs.fusewire import LAZY_STATS_XATTR
from runtime_shim.lazyfs.profile import _Trace
from runtime_shim.lazyfs.tree import Node, statfs_of

log = logging.getLogger("envbuild.lazyfs")

#: The immutable layer's kernel cache lifetime (entries, attributes, negative lookups).
CACHE_TTL = 86400.0


def _operations_base() -> type:
    try:
        import mfusepy
    except (ImportError, OSError) as e:  # OSError: libfuse3 itself is missing
        raise RuntimeShimError(f"lazy mode needs mfusepy and libfuse3: {e}",
                               hint="install the fuse3 package (scripts/setup.sh) and "
                                    "`pip install mfusepy`") from None
    return mfusepy.Operations



def make_operations(layer: LazyLayer, nodes: dict[str, Node], *,
                    on_init: Any = None, trace: _Trace | None = None, limits: Any = None):
    """The mfusepy ``Operations`` serving ``nodes`` with contents from ``layer``. ``on_init``
    is called once the kernel's INIT arrived (the mount is up); ``trace``, when given, is
    told of every read (the layer's access profile); ``limits`` (``filecache.FetchLimits``),
    when given, bounds how long a read waits for a fetch (then EIO, logged)."""
    import mfusepy

    cls = type("LazyOperations", (_LazyOperations, _operations_base()),
               {"_error": mfusepy.FuseOSError})
    return cls(layer, nodes, on_init, trace, limits)


class _LazyOperations:
    """The methods of ``make_operations``' filesystem (mixed into mfusepy's ``Operations``,
    which is imported only when a filesystem is made)."""

    use_ns = True
    _error: type[OSError]   # mfusepy's FuseOSError (set by ``make_operations``)

    def __init__(self, layer: LazyLayer, nodes: dict[str, Node], on_init: Any,
                 trace: _Trace | None, limits: Any) -> None:
        # exposed for the node daemon (profile prefetch) and tests
        self.lazy_layer, self.lazy_nodes = layer, nodes
        self.lazy_frames = _Frames(layer, nodes)
        # stopped by the daemon when the mount is gone
        self.lazy_readahead = _Readahead(layer, nodes, self.lazy_frames)
        self._stats_of = statfs_of(nodes)
        self._on_init, self._trace, self._limits = on_init, trace, limits

    def _node_at(self, path: str) -> Node:
        node = self.lazy_nodes.get(path.strip("/"))
        if node is None:
            raise self._error(errno.ENOENT)
        return node

    def init_with_config(self, conn, config) -> None:
        if config is not None:
            config.kernel_cache = 1
            config.use_ino = 1
            config.readdir_ino = 1
            config.entry_timeout = CACHE_TTL
            config.attr_timeout = CACHE_TTL
            config.negative_timeout = CACHE_TTL
        if self._on_init is not None:
            self._on_init()

    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        return self._node_at(path).attrs()

    def readlink(self, path: str) -> str:
        node = self._node_at(path)
        if not stat.S_ISLNK(node.mode):
            raise self._error(errno.EINVAL)
        return node.link

    def opendir(self, path: str) -> int:
        if not self._node_at(path).is_dir:
            raise self._error(errno.ENOTDIR)
        return 0

    def readdir(self, path: str, fh: int) -> Iterator[tuple[str, dict[str, int], int]]:
        nodes = self.lazy_nodes
        key = path.strip("/")
        node = self._node_at(key)
        if node.children is None:   # not a directory
            raise self._error(errno.ENOTDIR)
        parent = nodes[key.rpartition("/")[0]] if key else node
        yield ".", {"st_mode": node.mode, "st_ino": node.ino}, 0
        yield "..", {"st_mode": parent.mode, "st_ino": parent.ino}, 0
        prefix = key + "/" if key else ""
        for name in list(node.children):
            child = nodes.get(prefix + name)
            if child is not None:
                yield name, {"st_mode": child.mode, "st_ino": child.ino}, 0

    def open(self, path: str, flags: int) -> int:
        node = self._node_at(path)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise self._error(errno.EROFS)
        if not node.read_path:
            raise self._error(errno.EISDIR if node.is_dir else errno.EACCES)
        return 0  # nothing fetched until the first read

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        node = self._node_at(path)
        if offset >= node.size:
            return b""
        if self._trace is not None:
            self._trace.add(node)
        frames, readahead, layer = self.lazy_frames, self.lazy_readahead, self.lazy_layer
        try:
            if frames.missing(node):
                # one fetch per frame at a time: a second reader waits for it; the files
                # that follow in tar order come in the same ranged read (MISS_WINDOW)
                window = [node, *frames.following(node, MISS_WINDOW)]
                if self._limits is None:
                    frames.load(window)
                else:  # a store that stops answering is EIO in bounded time, not a hang
                    self._limits.bounded(f"read {node.read_path} of {layer.digest}",
                                         lambda: frames.load(window))
                readahead.schedule_after(window[-1])
                readahead.schedule(path.strip("/").rpartition("/")[0])
                readahead.schedule_extensions(node)
            return layer.read(node.read_path, offset, size)
        except EnvbuildError as e:
            log.error("read %s: %s", node.read_path, e)
            raise self._error(errno.EIO) from None

    def release(self, path: str, fh: int) -> int:
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        return self._stats_of

    def listxattr(self, path: str) -> list[str]:
        return list(self._node_at(path).xattrs)

    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        node = self._node_at(path)
        value = node.xattrs.get(name)
        if value is None:
            if name == LAZY_STATS_XATTR and path.strip("/") == "":
                return json.dumps({**self.lazy_layer.stats.as_dict(), "pid": os.getpid(),
                                   "mode": "fuse"}).encode()
            raise self._error(errno.ENODATA)
        return value

    # writes: refused (the mount is ro too; these make the answer EROFS, not ENOSYS)
    def _rofs(self, *args: Any, **kwargs: Any) -> int:
        raise self._error(errno.EROFS)

    chmod = chown = create = mkdir = mknod = rename = rmdir = symlink = truncate = \
        unlink = utimens = write = setxattr = removexattr = link = _rofs


def lazy_stats(mountpoint: str | os.PathLike[str]) -> dict[str, int]:
    """The ``LazyStats`` (and ``pid``) of the daemon serving ``mountpoint``: its root's
    ``LAZY_STATS_XATTR``, or, for a mount of a layer without extended attributes (which
    answers no getxattr at all: ``fusewire.MetaTree.xattrs_enosys``), the node daemon's "stats"
    reply (a node cache's mounts are ``<node>/lazy/<hex>``)."""
    try:
        return json.loads(os.getxattr(mountpoint, LAZY_STATS_XATTR))
    except OSError as e:
        if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            raise RuntimeShimError(f"read lazy layer stats at {mountpoint}: {e.strerror}") from e
    from runtime_shim.lazyfs.control import daemon_request

    mp = os.path.abspath(os.fspath(mountpoint))
    try:
        reply = daemon_request(os.path.dirname(os.path.dirname(mp)),
                               {"op": "stats", "mountpoint": mp}, 10.0)
    except OSError as e:
        raise RuntimeShimError(f"read lazy layer stats at {mountpoint}: its daemon: "
                               f"{e.strerror or e}") from e
    if not reply or not reply.get("ok"):
        why = reply.get("error", "no stats") if reply else "no daemon answers"
        raise RuntimeShimError(f"read lazy layer stats at {mountpoint}: {why}")
    return dict(reply["stats"])

