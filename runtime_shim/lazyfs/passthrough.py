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
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import logging
import os
import select
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from envbuild.errors import EnvbuildError, RuntimeShimError
from envbuild.store.lazy import LazyLayer
from runtime_shim.lazyfs.filecache import FileCache
from runtime_shim.lazyfs.frames import MISS_WINDOW, _Frames, _Readahead
from runtime_shim.lazyfs.fusewire import (
    _BACKING_MAP,
    _BUFSIZE,
    _IN_HEADER,
    _INIT_IN,
    _INIT_OUT,
    _NO_REPLY,
    _OPEN_IN,
    _OPEN_OUT,
    _READ_IN,
    _RELEASE_IN,
    _WANT,
    _WRITES,
    DESTROY,
    FLUSH,
    FOPEN_KEEP_CACHE,
    FOPEN_NOFLUSH,
    FOPEN_PASSTHROUGH,
    FSYNC,
    FUSE_DO_READDIRPLUS,
    FUSE_INIT_EXT,
    FUSE_KERNEL_MINOR,
    FUSE_KERNEL_VERSION,
    FUSE_PASSTHROUGH,
    INIT,
    OPEN,
    READ,
    RELEASE,
    MetaTree,
    readdirplus_wanted,
    reply_bytes,
)
from runtime_shim.lazyfs.profile import _Trace
from runtime_shim.lazyfs.tree import Node, statfs_of

if TYPE_CHECKING:
    from runtime_shim.lazyfs.metaserve import MetaServer

log = logging.getLogger("envbuild.lazyfs")

# -- passthrough's part of the kernel ABI (the rest, and the wire format: ``fusewire``) ------
_PT = FOPEN_PASSTHROUGH | FOPEN_NOFLUSH
#: Backing ids kept registered after their last release (reopening a file then costs no
#: syscall); beyond this many, the least recently opened idle ones are closed.
MAX_IDLE_BACKING = 4096
#: a program read whole to find its loader files (``on_elf``) is at most this big: the
#: interpreter and DT_NEEDED names of a bigger one are not looked for (a hint, not worth the read)
ELF_HINT_MAX = 64 << 20


def _iow(nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (229 << 8) | nr   # _IOW(FUSE_DEV_IOC_MAGIC=229, nr, size)


FUSE_DEV_IOC_BACKING_OPEN = _iow(1, _BACKING_MAP.size)
FUSE_DEV_IOC_BACKING_CLOSE = _iow(2, 4)

# the process's own symbols (libc is loaded): find_library would run ldconfig at import
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4

#: Where the mode choice can be forced: ``0``/``off`` (always the libfuse path), ``1``/``on``
#: (passthrough or fail), unset/``auto`` (passthrough when the kernel offers it).
PASSTHROUGH_ENV = "ENVBUILD_LAZY_PASSTHROUGH"


class _Conn:
    """One mounted FUSE connection: the ``/dev/fuse`` fd and what INIT negotiated."""

    def __init__(self, mountpoint: str, fsname: str) -> None:
        self.mountpoint = mountpoint
        self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        data = (f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other,"
                "default_permissions").encode()
        if _libc.mount(fsname.encode(), mountpoint.encode(), b"fuse.envbuild",
                       MS_RDONLY | MS_NOSUID | MS_NODEV, data) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise RuntimeShimError(f"mount FUSE at {mountpoint}: {os.strerror(err)}")
        self.passthrough = False
        self.kernel_minor = 0
        self.lock = threading.Lock()

    def reply(self, unique: int, payload: bytes = b"", error: int = 0) -> None:
        try:
            os.write(self.fd, reply_bytes(unique, payload, error))
        except OSError as e:   # ENOENT: the request was interrupted; ENODEV: unmounted
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("fuse reply on %s: %s", self.mountpoint, e.strerror)

    def init(self, unique: int, body: bytes, want_passthrough: bool) -> None:
        major, minor, max_readahead, flags, flags2 = _INIT_IN.unpack_from(body)
        kflags = flags | (flags2 << 32 if flags & FUSE_INIT_EXT else 0)
        self.kernel_minor = minor
        want = _WANT | (FUSE_PASSTHROUGH if want_passthrough else 0) \
            | (FUSE_DO_READDIRPLUS if readdirplus_wanted() else 0)
        got = want & kflags
        self.passthrough = bool(got & FUSE_PASSTHROUGH)
        self.reply(unique, _INIT_OUT.pack(
            FUSE_KERNEL_VERSION, FUSE_KERNEL_MINOR, max_readahead, got & 0xFFFFFFFF,
            64, 48, 1 << 20, 1, 256, 0, got >> 32, 1 if self.passthrough else 0, 0))

    def backing_open(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _ioctl_int(self.fd, FUSE_DEV_IOC_BACKING_OPEN, _BACKING_MAP.pack(fd, 0, 0))
        finally:
            os.close(fd)

    def backing_close(self, backing_id: int) -> None:
        try:
            _ioctl_int(self.fd, FUSE_DEV_IOC_BACKING_CLOSE, struct.pack("<I", backing_id))
        except OSError as e:
            log.warning("backing close %d on %s: %s", backing_id, self.mountpoint, e.strerror)

    def close(self) -> None:
        os.close(self.fd)


_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p]
_libc.ioctl.restype = ctypes.c_int


def _ioctl_int(fd: int, request: int, arg: bytes) -> int:
    """``ioctl`` returning its (non-negative) result: ``fcntl.ioctl`` with a buffer returns the
    buffer, not the value, and the backing id is the value."""
    buf = ctypes.create_string_buffer(arg, len(arg))
    r = _libc.ioctl(fd, request, buf)
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return r


class PassthroughFS:
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

    # -- open: fetch, verify, hand the kernel the cache file --------------------------------------

    def _open(self, conn: _Conn, unique: int, nodeid: int, body: bytes) -> None:
        _t0 = _now()
        flags, _ = _OPEN_IN.unpack_from(body)
        node = self.by_ino.get(nodeid)
        if node is None:
            conn.reply(unique, error=errno.ENOENT)
            return
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            conn.reply(unique, error=errno.EROFS)
            return
        if not node.read_path:
            conn.reply(unique, error=errno.EISDIR if node.is_dir else errno.EACCES)
            return
        if self.trace is not None:
            self.trace.add(node)
        with self._lock:
            held = self._backing.get(nodeid)
            if held is not None:  # the hot path: a file opened before, still registered
                held[1] += 1
                self._backing.move_to_end(nodeid)
                self.stats["opens"] += 1
                self.stats["passthrough_opens"] += 1
        if held is not None:
            conn.reply(unique, _OPEN_OUT.pack(0, _PT, held[0]))
            return
        self.readahead.schedule_extensions(node)
        if PYC_SOURCES and node.read_path.endswith(".pyc"):
            self._source_ahead(node)
        digest = node.digest
        # a file fetched ahead of its reader (the daemon's ``follow_delay``) says less of the
        # blob's tar order: an import prediction's never moves it, a loader's or start-up
        # file's only a moment later (after the command that is starting)
        delay = 0.0 if self.follow_delay is None else self.follow_delay(self, node)
        if digest and self.files.cached(digest):
            if delay is not None and not self.lazy_frames.missing(node):
                # written to files/ as its frames landed (a window, readahead): the reader is
                # going through fetched files, so the tar-order readahead follows it as below
                self.readahead.schedule_after(node, delay=delay)
            self._finish_open(conn, unique, node, digest, inline=True, t0=_t0, kind="file")
        elif not self.lazy_frames.missing(node):
            # no store request (its frames are in the chunk cache): answer here; a reader
            # going through the blob in tar order keeps the readahead ahead of it
            if delay is not None:
                self.readahead.schedule_after(node, delay=delay)
            self._finish_open(conn, unique, node, digest, inline=True, t0=_t0, kind="chunk")
        else:
            self.workers.submit(self._finish_open, conn, unique, node, digest, t0=_t0,
                                kind="miss")

    def _fetch(self, node: Node) -> bytes | Iterable[bytes]:
        # one fetch per frame at a time (a second reader waits); small files that share the
        # frame are cached with it, and the directory's other small files follow (readahead)
        if len(node.frames) > 1 and self.lazy_frames.missing(node):
            # a large file: its frames in parallel, written to files/ as they verify-hash
            self.readahead.schedule_after(node)
            pieces = self.lazy_frames.stream(node)
            if self.on_elf is not None and may_be_elf(node):
                return self._elf_peek(node, pieces)
            return pieces
        if self.lazy_frames.missing(node):
            own = set(node.frames)
            rest = [n for n in self.lazy_frames.following(node, MISS_WINDOW)
                    if own.isdisjoint(n.frames)]
            if rest:
                # the rest of the miss window goes in a second request, sent beside this
                # file's own: the open waits for its own frames only, not for the window's
                # transfer, decompression and verification (a program opens one file after
                # the other: at 1 Gbit/s a 1 MiB window doubles each miss). Same bytes.
                self.workers.submit(self._load_behind, rest)
            self.lazy_frames.load([node])
            self.readahead.schedule_after(rest[-1] if rest else node)
            self.readahead.schedule(node.read_path.rpartition("/")[0])
        return self.lazy_layer.read(node.read_path)

    def _elf_peek(self, node: Node, pieces: Iterable[bytes]) -> Iterator[bytes]:
        """``pieces`` (a large file streamed in file order), passed through; if they are a
        program's, its loader's files are fetched ahead as soon as the bytes naming them
        arrived — the interpreter from the first piece (program headers), the needed
        libraries once the dynamic section is in — instead of after the whole file
        (python3.11: 6.8 MB, its dynamic section at 5.5 MB). A hint only: the bytes are not
        verified yet, and what they name is fetched and verified against its own digest."""
        from runtime_shim.lazyfs.elfdeps import parse

        buf = bytearray()
        told = 0   # 1: the interpreter was looked up; 2: the needed libraries too
        for piece in pieces:
            if told < 2:
                buf += piece
                if buf[:4] != b"\x7fELF":
                    told = 2
                else:
                    interp, needed = parse(buf)
                    if (told == 0 and interp) or needed:
                        told = 2 if needed else 1
                        self._elf_checked.add(node.ino)   # told here: not again at the reply
                        assert self.on_elf is not None
                        self.on_elf(self, bytes(buf))   # submits the lookups: returns at once
                if told == 2:
                    buf = bytearray()
            yield piece

    def _source_ahead(self, node: Node) -> None:
        """At the first open of a pyc, when this layer's pycs are checked-hash ones
        (``pyc_source_wanted``): fetch its source beside it (the importer opens the source
        right after to check the hash), as a file predicted to be opened."""
        source = self._pyc_companion(node)
        if source is not None:
            self.workers.submit(self._load_ahead, [source])

    def _pyc_companion(self, node: Node) -> Node | None:
        """The source of the pyc ``node`` still to fetch, when this layer's pycs are
        checked-hash ones (``pyc_source_wanted``), else None: loaded beside the pyc at its
        open (``_source_ahead``) and with it when a window or the readahead guesses it (its
        open reads the source a moment after the pyc's — too late to fetch it then)."""
        if not node.read_path.endswith(".pyc") or not pyc_source_wanted(*self._pycs):
            return None
        src = pyc_source(node.read_path)
        s = self.lazy_nodes.get(src) if src else None
        if s is None or not s.read_path or s.size > PYC_SOURCE_MAX \
                or not self.lazy_frames.to_fetch(s):
            return None
        return s

    def _load_ahead(self, nodes: list[Node]) -> None:
        try:
            self.lazy_frames.load(nodes, wait=False, ahead=True)
        except EnvbuildError as e:  # its own open reports it
            log.warning("source ahead on %s: %s", self.lazy_layer.digest, e.message)

    def _learn_pyc(self, path: str) -> None:
        """Count the pyc at ``path`` (its cache file) as checked-hash or not (the header's
        flags word: 3 = a hash the importer checks against the source)."""
        try:
            with open(path, "rb", buffering=0) as f:
                head = f.read(8)
        except OSError:
            return
        checked = len(head) == 8 and int.from_bytes(head[4:8], "little") == 3
        with self._lock:
            self._pycs[0] += checked
            self._pycs[1] += 1

    def _load_behind(self, nodes: list[Node]) -> None:
        try:
            self.lazy_frames.load(nodes, wait=False)
        except EnvbuildError as e:  # a foreground open of one of them reports it
            log.warning("window after a miss on %s: %s", self.lazy_layer.digest, e.message)

    def _loaded(self, nodes: list[Node]) -> None:
        # files fetched ahead of their opens (start-up files, libraries, an import prediction,
        # a profile; with ``PRELOAD`` every file a fetch made present) are written to files/
        # in the background, so that their first open is a backing open only (not a write on
        # the reader's thread); the others are written by their first open, from the frames
        for node in nodes:
            digest = node.digest
            if digest:
                self.files.preload(digest, functools.partial(self.lazy_layer.read,
                                                             node.read_path),
                                   f"{node.read_path} of {self.lazy_layer.digest}")

    def _finish_open(self, conn: _Conn, unique: int, node: Node, digest: str, *,
                     inline: bool = False, t0: float = 0.0, kind: str = "") -> None:
        try:
            path = self.files.path(digest, lambda: self._fetch(node),
                                   f"open {node.read_path} of {self.lazy_layer.digest}",
                                   inline=inline)
            payload = self._open_path(conn, node, path)
            if PYC_SOURCES and node.read_path.endswith(".pyc") \
                    and self._pycs[1] < PYC_LEARN_MAX:
                self._learn_pyc(path)
            with self._lock:
                self.stats["opens"] += 1
        except EnvbuildError as e:
            log.error("open %s: %s", node.read_path, e.message)
            conn.reply(unique, error=errno.EIO)
            return
        except OSError as e:
            log.error("open %s: %s", node.read_path, e)
            conn.reply(unique, error=errno.EIO)
            return
        conn.reply(unique, payload)
        if (self.on_elf is not None or self.on_first_open is not None) \
                and node.ino not in self._elf_checked:
            # the first open of a file, however it was answered (a miss, a window's frames, a
            # file written to files/ as they landed, a large file streamed): if it is a
            # program, its loader's files are fetched ahead (after the reply: a hint only);
            # a module's imports likewise (on_first_open)
            self._elf_checked.add(node.ino)
            if self.on_first_open is not None:
                try:
                    self.on_first_open(self, node, path)
                except Exception:  # noqa: BLE001 - a hint only
                    log.exception("first-open hint after %s", node.read_path)
            if self.on_elf is not None and may_be_elf(node):
                self.workers.submit(self._elf_hint, node, path)
        if _TRACE is not None:
            _trace_open(self.lazy_layer.digest, node, t0, kind)

    def _elf_hint(self, node: Node, path: str) -> None:
        try:
            with open(path, "rb") as f:
                if f.read(4) != b"\x7fELF" or node.size > ELF_HINT_MAX:
                    return
                f.seek(0)
                data = f.read(ELF_HINT_MAX)
            assert self.on_elf is not None
            self.on_elf(self, data)
        except Exception:  # noqa: BLE001 - a hint only: never fail anything for it
            log.exception("fetch ahead after %s", node.read_path)

    def _open_path(self, conn: _Conn, node: Node, path: str) -> bytes:
        size = os.stat(path).st_size
        if size != node.size:  # a TOC whose digest names other content (cached by another)
            raise RuntimeShimError(f"{node.read_path}: the TOC says {node.size} bytes but its "
                                   f"digest names {size} bytes of content")
        if conn.passthrough:
            try:
                bid = conn.backing_open(path)
            except OSError as e:
                if not self._no_backing_logged:
                    self._no_backing_logged = True
                    log.warning("passthrough refused for %s (%s): reads of such files go "
                                "through user space", path, e.strerror)
            else:
                idle: list[int] = []
                with self._lock:
                    held = self._backing.get(node.ino)
                    self.stats["passthrough_opens"] += 1
                    if held is None:
                        self._backing[node.ino] = [bid, 1]
                        if len(self._backing) > MAX_IDLE_BACKING:
                            idle = self._evict_backing()
                    else:   # another open raced us: use its id, drop ours
                        held[1] += 1
                        idle, bid = [bid], held[0]
                for old in idle:
                    conn.backing_close(old)
                return _OPEN_OUT.pack(0, _PT, bid)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        with self._lock:
            fh = self._next_fh
            self._next_fh += 1
            self._fds[fh] = fd
        return _OPEN_OUT.pack(fh, FOPEN_KEEP_CACHE | FOPEN_NOFLUSH, 0)

    def _evict_backing(self) -> list[int]:
        """(Caller holds the lock.) Drop the least recently opened idle backing ids beyond
        ``MAX_IDLE_BACKING``; returns them, to be closed outside the lock."""
        out = []
        for ino, (bid, opens) in list(self._backing.items()):
            if len(self._backing) <= MAX_IDLE_BACKING * 0.9:
                break
            if opens <= 0:
                del self._backing[ino]
                out.append(bid)
        return out

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


#: ``$ENVBUILD_LAZY_PYC_SOURCES=0`` turns off fetching a checked-hash pyc's source beside it
#: (``PassthroughFS._source_ahead``). Measured: see docs/lazy-loading.md, "Fifth pass".
PYC_SOURCES = os.environ.get("ENVBUILD_LAZY_PYC_SOURCES", "1").strip().lower() \
    not in ("0", "off")
#: Sources larger than this are left to their own open.
PYC_SOURCE_MAX = 1 << 20
#: A layer's first pycs whose headers are read to learn whether they are checked-hash ones
#: (then the decision stands: a header read is an open, a read and a close per pyc open).
PYC_LEARN_MAX = 64


def pyc_source(pyc: str) -> str | None:
    """The source path of ``D/__pycache__/M.TAG[.opt-N].pyc``: ``D/M.py`` (None for a pyc
    outside a ``__pycache__``, which is sourceless)."""
    head, _, name = pyc.rpartition("/")
    parent, _, cache = head.rpartition("/")
    if cache != "__pycache__" or not name.endswith(".pyc"):
        return None
    module = name.split(".", 1)[0]
    if not module:
        return None
    return f"{parent}/{module}.py" if parent else f"{module}.py"


def pyc_source_wanted(checked: int, seen: int) -> bool:
    """Whether a layer whose pycs read so far were ``checked`` checked-hash ones of ``seen``
    has its pycs' sources fetched ahead: once one was, while nine in ten are (a layer of
    timestamp pycs, whose sources the importer only stats, costs no bytes)."""
    return checked > 0 and checked * 10 >= seen * 9


def may_be_elf(node: Node) -> bool:
    """Whether the first open of ``node`` is worth reading for an ELF header (the loader
    files of a program or library, fetched ahead): an executable, or a name with ``.so`` in it
    (``libc.so.6``, ``_multiarray_umath.cpython-311-x86_64-linux-gnu.so``), of at most
    ``ELF_HINT_MAX`` bytes. The cold_start workload's ~1,200 first opens are mostly modules
    and data: each was a thread-pool hand-off, an open and a read under the GIL, for nothing.
    A hint only: a library named otherwise is fetched by the loader's own open."""
    if not stat.S_ISREG(node.mode) or node.size < 64 or node.size > ELF_HINT_MAX:
        return False
    return bool(node.mode & 0o111) or ".so" in node.read_path.rpartition("/")[2]


_now = time.monotonic
#: ``$ENVBUILD_LAZY_OPEN_TRACE``: a file that gets one line per first open (when, which
#: layer and file, how long it waited, how it was answered) - for measuring the miss path.
_TRACE = os.environ.get("ENVBUILD_LAZY_OPEN_TRACE") or None
_trace_lock = threading.Lock()


def _trace_open(layer: str, node: Node, t0: float, kind: str) -> None:
    t1 = _now()
    with _trace_lock, open(_TRACE, "a") as f:  # type: ignore[arg-type]
        f.write(f"{t0:.6f} {(t1 - t0) * 1e3:.2f} {kind} {layer[7:19]} {node.size} "
                f"{node.read_path}\n")


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


def passthrough_wanted() -> bool | None:
    """``$ENVBUILD_LAZY_PASSTHROUGH``: False (off), True (on: required), None (auto)."""
    raw = os.environ.get(PASSTHROUGH_ENV, "auto").strip().lower()
    if raw in ("0", "off", "no", "false"):
        return False
    if raw in ("1", "on", "yes", "true"):
        return True
    return None


def probe(scratch: str, files_dir: str) -> tuple[bool, str]:
    """Whether this kernel serves FUSE passthrough for us: mount an empty filesystem at
    ``scratch`` (created and removed here), answer INIT asking for ``FUSE_PASSTHROUGH``, and
    register a file of ``files_dir`` as a backing file. ``(ok, why not)``."""
    from runtime_shim.isolation.mount import unmount

    if passthrough_wanted() is False:
        return False, f"disabled by ${PASSTHROUGH_ENV}"
    if not os.path.exists("/dev/fuse"):
        return False, "no /dev/fuse"
    os.makedirs(scratch, exist_ok=True)
    os.makedirs(files_dir, exist_ok=True)
    try:
        conn = _Conn(scratch, "envbuild-lazy-probe")
    except (RuntimeShimError, OSError) as e:
        os.rmdir(scratch)
        return False, str(e)
    result: list[tuple[bool, str]] = []
    try:
        def answer_init() -> None:
            buf = os.read(conn.fd, _BUFSIZE)
            length, opcode, unique, *_ = _IN_HEADER.unpack_from(buf)
            conn.init(unique, buf[_IN_HEADER.size:length], True)
            if not conn.passthrough:
                result.append((False, f"the kernel (FUSE 7.{conn.kernel_minor}) did not "
                                      "offer FUSE_PASSTHROUGH"))
                return
            probe_file = os.path.join(files_dir, ".probe")
            with open(probe_file, "wb") as f:
                f.write(b"probe")
            try:
                bid = conn.backing_open(probe_file)
            except OSError as e:
                result.append((False, f"FUSE_DEV_IOC_BACKING_OPEN refused: {e.strerror}"))
                return
            finally:
                os.unlink(probe_file)
            conn.backing_close(bid)
            result.append((True, ""))

        # the kernel sends INIT as it mounts; nothing else arrives unless someone looks
        t = threading.Thread(target=answer_init, daemon=True)
        t.start()
        t.join(10)
    except OSError as e:
        result.append((False, f"probe mount: {e.strerror}"))
    finally:
        try:
            unmount(scratch)
        except EnvbuildError as e:
            log.warning("%s", e)
        conn.close()
        try:
            os.rmdir(scratch)
        except OSError:
            pass
    return result[0] if result else (False, "the probe mount did not answer INIT")
