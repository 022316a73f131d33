"""A passthrough mount's ``open``: the file made present on the node and handed to the kernel.

The file's contents are made present in the node's file cache (fetched, verified, written
once per node), the cache file is registered with the kernel as the open's backing file
(reads then never reach user space), and a first open gives hints — a program's loader
files, a checked-hash pyc's source, a module's imports (the daemon's ``on_elf`` and
``on_first_open``). A part of ``runtime_shim.lazyfs.passthrough.PassthroughFS``."""

from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import stat
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
    _OPEN_IN,
    _OPEN_OUT,
    FOPEN_KEEP_CACHE,
    FOPEN_NOFLUSH,
    FOPEN_PASSTHROUGH,
)
from runtime_shim.lazyfs.profile import _Trace
from runtime_shim.lazyfs.tree import Node

if TYPE_CHECKING:
    from runtime_shim.lazyfs.fuseconn import _Conn

log = logging.getLogger("envbuild.lazyfs")

_PT = FOPEN_PASSTHROUGH | FOPEN_NOFLUSH
#: Backing ids kept registered after their last release (reopening a file then costs no
#: syscall); beyond this many, the least recently opened idle ones are closed.
MAX_IDLE_BACKING = 4096
#: a program read whole to find its loader files (``on_elf``) is at most this big: the
#: interpreter and DT_NEEDED names of a bigger one are not looked for (a hint, not worth the read)
ELF_HINT_MAX = 64 << 20

#: ``$ENVBUILD_LAZY_PYC_SOURCES=0`` turns off fetching a checked-hash pyc's source beside it
#: (``PassthroughFS._source_ahead``). Measured: see docs/notes/lazy-loading-log.md, "Fifth pass".
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


class _Opens:
    """The open path of ``PassthroughFS`` (a mixin: the mount's state is set up by its
    ``__init__``)."""

    lazy_layer: LazyLayer
    lazy_nodes: dict[str, Node]
    lazy_frames: _Frames
    readahead: _Readahead
    files: FileCache
    workers: ThreadPoolExecutor
    trace: _Trace | None
    on_elf: Callable[[Any, bytes], object] | None
    on_first_open: Callable[[Any, Node, str], object] | None
    follow_delay: Callable[[Any, Node], float | None] | None
    by_ino: dict[int, Node]
    stats: dict[str, int]
    _pycs: list[int]
    _elf_checked: set[int]
    _lock: threading.Lock
    _backing: collections.OrderedDict[int, list[int]]
    _fds: dict[int, int]
    _next_fh: int
    _no_backing_logged: bool

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
