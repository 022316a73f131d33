"""FUSE passthrough mounts: the kernel reads fetched files itself, never asking user space.

A lazy layer served this way is a FUSE filesystem spoken directly over ``/dev/fuse`` (the
kernel protocol, ``include/uapi/linux/fuse.h``; libfuse 3.14 of Debian 12 cannot do
passthrough, which came with libfuse 3.16), mounted with ``mount(2)``. It presents exactly
the tree of ``runtime_shim.lazyfs`` ("what the mount presents"): metadata comes from the TOC
(``tree.build_tree``) with day-long entry, attribute and negative-lookup timeouts, cached
readdir and symlinks. What differs is ``open``:

1. the file's contents are made present in the node's content-addressed file cache
   (``filecache.FileCache``: fetched once per node — single-flight across every layer and
   sandbox — and verified whole against the TOC digest before it is written);
2. the cache file is registered with the kernel (``ioctl(FUSE_DEV_IOC_BACKING_OPEN)`` on the
   ``/dev/fuse`` fd: a backing id), and ``open`` is answered with ``FOPEN_PASSTHROUGH`` and
   that id. From then on ``read``, ``mmap`` and ``splice`` of the file go to the cache file's
   page cache in the kernel: native speed, and one page cache for identical files of every
   layer. The backing id stays registered after the last release, so reopening the file is a
   dictionary lookup and one reply (``MAX_IDLE_BACKING`` bounds the idle ones); ``close``
   costs no round trip (``FOPEN_NOFLUSH``).

Passthrough is negotiated at ``FUSE_INIT`` (``FUSE_PASSTHROUGH``, bit 37 of the init flags:
bit 5 of ``flags2``, with ``max_stack_depth`` 1: backing files live on a plain filesystem so
that overlayfs can still stack on the mount). ``probe`` tries it once per daemon on a scratch
mount: when the kernel does not offer it or refuses the ioctl, the daemon serves every layer
with the libfuse filesystem (``fuseops``, reads through user space) instead; a single file
whose backing open fails is served by reads from its cache file (logged once).

Requests are read by one thread per mount; an ``open`` that must fetch is handed to a worker
so lookups go on meanwhile. The fetch's wait is bounded (``FetchLimits.timeout``): a store
that stops answering makes ``open`` fail with EIO, logged with the reason, never a hang.

Where the parts live: the ``/dev/fuse`` connection, INIT and the probe in ``fuseconn``; the
open path (fetch, verify, backing file, first-open hints) in ``passthrough_open``; here the
mount's request loop and its answers. This module re-exports the others' public names.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import select
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from envbuild.store.lazy import LazyLayer
from runtime_shim.lazyfs.filecache import FileCache
from runtime_shim.lazyfs.frames import _Frames, _Readahead
from runtime_shim.lazyfs.fuseconn import (
    FUSE_DEV_IOC_BACKING_CLOSE,
    FUSE_DEV_IOC_BACKING_OPEN,
    MS_NODEV,
    MS_NOSUID,
    MS_RDONLY,
    PASSTHROUGH_ENV,
    _Conn,
    _ioctl_int,
    passthrough_wanted,
    probe,
)
from runtime_shim.lazyfs.fusewire import (
    _BUFSIZE,
    _IN_HEADER,
    _NO_REPLY,
    _OPEN_IN,
    _READ_IN,
    _RELEASE_IN,
    _WRITES,
    DESTROY,
    FLUSH,
    FSYNC,
    INIT,
    OPEN,
    READ,
    RELEASE,
    MetaTree,
)
from runtime_shim.lazyfs.passthrough_open import (
    _TRACE,
    ELF_HINT_MAX,
    MAX_IDLE_BACKING,
    PYC_LEARN_MAX,
    PYC_SOURCE_MAX,
    PYC_SOURCES,
    _Opens,
    _trace_lock,
    may_be_elf,
    pyc_source,
    pyc_source_wanted,
)
from runtime_shim.lazyfs.profile import _Trace
from runtime_shim.lazyfs.tree import Node, statfs_of

if TYPE_CHECKING:
    from runtime_shim.lazyfs.metaserve import MetaServer

log = logging.getLogger("envbuild.lazyfs")

__all__ = [
    "ELF_HINT_MAX", "FUSE_DEV_IOC_BACKING_CLOSE", "FUSE_DEV_IOC_BACKING_OPEN", "MAX_IDLE_BACKING",
    "MS_NODEV", "MS_NOSUID", "MS_RDONLY", "OPEN", "PASSTHROUGH_ENV", "PRELOAD", "PYC_LEARN_MAX",
    "PYC_SOURCES", "PYC_SOURCE_MAX", "PassthroughFS", "_Conn", "_OPEN_IN", "_TRACE",
    "_ioctl_int", "_trace_lock", "may_be_elf", "passthrough_wanted", "probe", "pyc_source",
    "pyc_source_wanted",
]

#: ``$ENVBUILD_LAZY_PRELOAD=on`` writes every file a fetch made wholly present (a miss
#: window, readahead) to the file cache at once, by one background writer
#: (``FileCache.preload``). Off (the default), only the files fetched because they are
#: predicted to be opened (``_Frames.load(ahead=True)``: start-up files, a program's
#: libraries, an import prediction, a profile) are; the window's and the readahead's guesses
#: are written at their first open, from the frames in the chunk cache (~0.3 ms an open).
#: Measured (cold_start at 1gbit:10ms, 6 pairs taking turns, writing no guess against
#: writing all): the daemon's CPU per workload 2.75 vs 3.92 s (the writer wrote ~4,000
#: read-ahead files nobody opened, each a handful of syscalls under the GIL), the import
#: 2.63 vs 3.04 s, the total 3.93 vs 4.56 s (lower in 5 of 6 pairs).
PRELOAD = os.environ.get("ENVBUILD_LAZY_PRELOAD", "").strip().lower() in ("1", "on", "yes")


class PassthroughFS(_Opens):
    """One lazy layer as a passthrough FUSE mount (module docstring). ``mount()`` mounts;
    ``serve()`` answers requests until the mount goes away (call it in a thread; ``on_init``
    runs once INIT was answered). Exposes ``lazy_layer``, ``lazy_nodes``, ``lazy_frames``
    like ``fuseops.make_operations`` (profile prefetch, tests)."""

    def __init__(self, layer: LazyLayer, nodes: dict[str, Node], mountpoint: str,
                 files: FileCache, *, workers: ThreadPoolExecutor,
                 trace: _Trace | None = None, on_init: Callable[[], None] | None = None,
                 want_passthrough: bool = True,
                 on_elf: Callable[[PassthroughFS, bytes], object] | None = None,
                 on_first_open: Callable[[PassthroughFS, Node, str], object] | None = None,
                 follow_delay: Callable[[PassthroughFS, Node], float | None] | None = None,
                 no_xattrs_enosys: bool = False,
                 metaserver: MetaServer | None = None) -> None:
        self.lazy_layer, self.lazy_nodes = layer, nodes
        # this layer's pycs read so far: [checked-hash, all] (``_learn_pyc``)
        self._pycs = [0, 0]
        self.lazy_frames = _Frames(layer, nodes, on_loaded=self._loaded, report_all=PRELOAD,
                                   present=lambda n: bool(n.digest) and self.files.present(n.digest))
        self.readahead = self.lazy_readahead = _Readahead(layer, nodes, self.lazy_frames)
        if PYC_SOURCES:   # a guessed checked-hash pyc brings its source (``_pyc_companion``)
            self.lazy_frames.companion = self._pyc_companion
        self.mountpoint, self.files, self.workers = mountpoint, files, workers
        self.trace, self.on_init, self.want_passthrough = trace, on_init, want_passthrough
        self.on_elf = on_elf   # told of each fetched ELF file (the daemon fetches its libraries)
        self._elf_checked: set[int] = set()   # inodes whose first open told on_elf
        # told of each file's first open with its cache file (Python import prediction)
        self.on_first_open = on_first_open
        # when a first open moves the tar-order readahead (None: never; see ``_open``)
        self.follow_delay = follow_delay
        has_xattrs = any(node.xattrs for node in nodes.values())
        # A layer without one extended attribute (no opaque dir either: those are
        # ``trusted.overlay.opaque``) answers GETXATTR with ENOSYS, so the kernel never asks
        # this mount again (``fc->no_getxattr``: getxattr is EOPNOTSUPP, which overlayfs takes
        # as "no such attribute"; a sandbox's getxattr of such a file gets ENOTSUP where an
        # unpacked layer says ENODATA, both "none"). Overlay asks each lower dentry it looks
        # up for its opaque, redirect and metacopy attributes: ~3,000 round trips through
        # this server's GIL in the cold_start workload, the importer waiting on each. The
        # root's stats attribute is then asked of the daemon (``fuseops.lazy_stats``). Off
        # for mounts made without the daemon (tests that read the stats attribute directly).
        self.meta = MetaTree(nodes, statfs_of(nodes),
                             xattrs_enosys=no_xattrs_enosys and not has_xattrs,
                             stats=self.lazy_stats)
        self.by_ino, self.dir_path = self.meta.by_ino, self.meta.dir_path
        # the metadata server that reads this mount's requests (``metaserve``), if any
        self.metaserver = metaserver
        self.served_by_metaserver = False
        self._meta_counts: memoryview | None = None   # the server's counters (``metaserve``)
        self._lock = threading.Lock()
        # ino -> [backing id, opens], least recently opened first
        self._backing: collections.OrderedDict[int, list[int]] = collections.OrderedDict()
        self._fds: dict[int, int] = {}             # fh -> cache file fd (no passthrough)
        self._next_fh = 1
        self._no_backing_logged = False
        self.conn: _Conn | None = None
        self.stats = {"opens": 0, "passthrough_opens": 0, "userspace_reads": 0}
        self.ops: collections.Counter[int] = collections.Counter()  # requests by opcode

    @property
    def passthrough(self) -> bool:
        return self.conn is not None and self.conn.passthrough

    def mount(self) -> None:
        self.conn = _Conn(self.mountpoint, f"envbuild-lazy-{self.lazy_layer.digest[7:19]}")

    def serve(self) -> None:
        conn = self.conn
        assert conn is not None
        fwd = None
        try:
            if self.metaserver is not None:
                # INIT first, here: the mount is ready (the create goes on) while the server
                # takes the tree; requests meanwhile wait in the kernel for it
                self._serve_fuse(conn, until_init=True)
                got = self.metaserver.adopt(self.mountpoint, conn.fd, self.lazy_nodes,
                                            self.meta.statfs, self.meta.xattrs_enosys)
                if got is not None:
                    fwd, self._meta_counts = got
            if fwd is not None:
                os.set_blocking(conn.fd, False)
                if self._serve_fuse(conn, server=fwd):
                    self.served_by_metaserver = True
                    if self._serve_forwarded(conn, fwd):
                        return
                    self.served_by_metaserver = False
                os.set_blocking(conn.fd, True)
                log.warning("the metadata server stopped serving %s: the daemon reads its "
                            "requests from now on", self.mountpoint)
            self._serve_fuse(conn)
        finally:
            if fwd is not None:
                fwd.close()
            with self._lock:
                for fd in self._fds.values():
                    os.close(fd)
                self._fds.clear()
            conn.close()

    def _serve_fuse(self, conn: _Conn, *, until_init: bool = False,
                    server: Any = None) -> bool:
        """Read and answer the mount's requests until it goes away (False), or until INIT was
        answered (``until_init``), or, with ``server`` (the metadata server's forwarding
        socket; ``conn.fd`` non-blocking), until the server says it is ready to read them
        (True; False if it went away first)."""
        from runtime_shim.lazyfs.metaserve import READY

        # one buffer for the mount's reads: os.read would allocate (and shrink) 1 MiB for each
        # request of ~100 bytes; each request is copied out as bytes, so nothing keeps a view
        # of the buffer past the next read
        rbuf = bytearray(_BUFSIZE)
        view = memoryview(rbuf)
        poller = None
        if server is not None:
            poller = select.poll()
            poller.register(conn.fd, select.POLLIN)
            poller.register(server.fileno(), select.POLLIN)
        while True:
            if poller is not None and any(fd != conn.fd for fd, _ in poller.poll()):
                try:
                    return bool(server.recv(16) == READY)
                except OSError:
                    return False
            try:
                n = os.readv(conn.fd, (rbuf,))
                buf = view[:n].tobytes()
            except OSError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                    continue   # ENOENT: the request was interrupted before we read it
                if e.errno != errno.ENODEV:   # ENODEV: unmounted
                    log.error("fuse read on %s: %s", self.mountpoint, e.strerror)
                return False
            self._dispatch(conn, buf)
            if until_init and _IN_HEADER.unpack_from(buf)[1] == INIT:
                return False

    def _serve_forwarded(self, conn: _Conn, fwd: Any) -> bool:
        """Answer the requests the metadata server forwards (``metaserve``); True when the
        mount went away, False when the server did (its socket closed without ``GONE``)."""
        from runtime_shim.lazyfs.metaserve import FORWARD_MAX, GONE, RELEASED, RELEASES_MAX, REQUEST

        while True:
            try:
                buf = fwd.recv(FORWARD_MAX + 8 * RELEASES_MAX + 1)
            except InterruptedError:
                continue
            except OSError:
                return False
            tag = buf[:1]
            if tag == REQUEST and len(buf) >= 1 + _IN_HEADER.size:
                length = int.from_bytes(buf[1:5], "little")
                self._dispatch(conn, buf[1:1 + length])
                released = buf[1 + length:]
            elif tag == RELEASED:
                released = buf[1:]
            elif tag == GONE:
                return True
            else:   # closed (b""), or not a message of ours
                return False
            for (nodeid,) in struct.iter_unpack("<Q", released[:len(released) // 8 * 8]):
                self._release(nodeid, 0)

    def requests_by_opcode(self) -> collections.Counter[int]:
        """FUSE requests of this mount by opcode: the daemon's and its metadata server's."""
        total = collections.Counter(self.ops)
        counts = self._meta_counts
        if counts is not None:
            for opcode, n in enumerate(counts):
                if n:
                    total[opcode] += n
        return total

    # -- requests ------------------------------------------------------------------------------

    def _dispatch(self, conn: _Conn, buf: bytes) -> None:
        length, opcode, unique, nodeid, _uid, _gid, _pid, _ext, _ = _IN_HEADER.unpack_from(buf)
        body = memoryview(buf)[_IN_HEADER.size:length]
        self.ops[opcode] += 1
        if opcode in _NO_REPLY:
            return
        try:
            if opcode == INIT:
                conn.init(unique, bytes(body), self.want_passthrough)
                if self.on_init is not None:
                    self.on_init()
                return
            if opcode == OPEN:
                self._open(conn, unique, nodeid, bytes(body))
                return
            payload = self._answer(opcode, nodeid, body)
        except OSError as e:
            conn.reply(unique, error=e.errno or errno.EIO)
            return
        except Exception:  # noqa: BLE001 - one bad request must not end the mount
            log.exception("fuse request %d on %s", opcode, self.mountpoint)
            conn.reply(unique, error=errno.EIO)
            return
        conn.reply(unique, payload)

    def _answer(self, opcode: int, nodeid: int, body: memoryview) -> bytes:
        if self.meta.answers(opcode, nodeid, body):
            return self.meta.answer(opcode, nodeid, body)
        if opcode == READ:
            fh, offset, size, _ = _READ_IN.unpack_from(body)
            with self._lock:
                fd = self._fds.get(fh)
                self.stats["userspace_reads"] += 1
            if fd is None:
                raise OSError(errno.EBADF, "no such handle")
            return os.pread(fd, size, offset)
        if opcode == RELEASE:
            fh, _, _ = _RELEASE_IN.unpack_from(body)
            self._release(nodeid, fh)
            return b""
        if opcode in (FLUSH, FSYNC, DESTROY):
            return b""
        if opcode in _WRITES:
            raise OSError(errno.EROFS, "read-only")
        raise OSError(errno.ENOSYS, "not implemented")

    def lazy_stats(self) -> dict[str, Any]:
        with self._lock:
            extra = dict(self.stats)
        return {**self.lazy_layer.stats.as_dict(), **extra, "pid": os.getpid(),
                "requests_by_opcode": {str(k): v for k, v in
                                       sorted(self.requests_by_opcode().items())},
                "mode": "passthrough" if self.passthrough else "userspace",
                "hedged_reads": self.lazy_frames.hedged,
                # who reads this mount's requests: its metadata server (``metaserve``), or
                # the daemon alone; what the server answered itself
                "metadata_server": self.served_by_metaserver,
                "metadata_server_requests": (sum(self._meta_counts)
                                             if self._meta_counts is not None else 0)}

    def _release(self, nodeid: int, fh: int) -> None:
        # a passthrough file (fh 0) keeps its backing id registered: the next open of it is
        # answered without a syscall (``_evict_backing`` bounds how many stay)
        with self._lock:
            fd = self._fds.pop(fh, None) if fh else None
            if fh == 0:
                held = self._backing.get(nodeid)
                if held is not None:
                    held[1] -= 1
        if fd is not None:
            os.close(fd)
