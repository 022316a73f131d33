"""Layer writer: tar headers + file contents -> frames -> compression threads -> blob, one pass.

The main thread walks members, writes headers and reads file contents straight into reusable
batch buffers; full batches of frames are compressed by worker threads (zstandard releases the
GIL) and taken in order by one output thread, which hashes the tar (diff_id) and each file's
contents, writes the frames hashing the blob (layer digest), and formats the TOC rows. Memory
is bounded by ``_INFLIGHT`` batch buffers.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import BinaryIO, Protocol

import zstandard

from envbuild.errors import LayerError, bug
from envbuild.layers._footer import FOOTER_SIZE, Footer, skippable_header
from envbuild.layers._plan import FramePlanner, Framing, MiB
from envbuild.layers._stream import TarStream, iter_members
from envbuild.layers._tar import (
    BLOCK,
    END_OF_ARCHIVE,
    MAX_PAX_HEADER,
    TarFormatError,
    encode_header,
)
from envbuild.layers._toc import (
    Entry,
    LayerInfo,
    TocFormatError,
    check_writable,
    encode_v2,
    entry_row,
    json_string,
)
from envbuild.layers._walk import FileSource, OnDropped, walk_tree

ZSTD_LEVEL = 3
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
TOC_ZSTD_LEVEL = 3  # the TOC is compressed after all frames, on the critical path: level 9 took
#                     85 ms on a 15k-entry TOC for 3 % less (16 KB); level 3 takes ~15 ms
_PADS = [bytes(n) for n in range(BLOCK)]
_BATCH = 2 * MiB  # submit a buffer once it holds this much and a frame ends (fewer, bigger
#                  batches: less queue/lock/GIL traffic; 4 MiB measured no better)
# batches compressed or being written while the main thread fills the next one: enough to keep
# two compression threads and the output thread busy. Each buffer holds _BATCH + the largest
# frame (see _capacity); fresh buffers cost page faults (~6 ms per 8 MiB here), so they are
# few, reused within a pack and kept for the next one (_BufferPool).
_INFLIGHT = 4


def _capacity(framing: Framing) -> int:
    """Bytes a batch buffer may have to hold: a batch is submitted at the first frame end at or
    after _BATCH, and a frame is at most max_frame, or a shared frame (< shared_frame) plus one
    member header (<= MAX_PAX_HEADER + 2 blocks) and a small file."""
    shared = framing.shared_frame + MAX_PAX_HEADER + 2 * BLOCK + framing.small_file
    return _BATCH + max(framing.max_frame, shared) + MAX_PAX_HEADER + 64 * 1024


class _BufferPool:
    """Batch buffers kept between packs (at most ``keep``), so a process that packs many layers
    pays the page faults of fresh buffers once. Thread-safe."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.lock = threading.Lock()
        self.free: list[bytearray] = []

    def get(self, size: int) -> tuple[bytearray, memoryview]:
        with self.lock:
            for i, b in enumerate(self.free):
                if len(b) >= size:
                    buf = self.free.pop(i)
                    return buf, memoryview(buf)
        buf = bytearray(size)
        return buf, memoryview(buf)

    def put(self, bufs: list[bytearray]) -> None:
        with self.lock:
            self.free.extend(bufs)
            self.free.sort(key=len, reverse=True)
            del self.free[self.keep:]


_POOL = _BufferPool(keep=_INFLIGHT + 1)


class FileChanged(Exception):
    pass


class _Batch:
    """One buffer of whole frames on its way through the threads: compressed by a worker,
    hashed (tar, file pieces), written and turned into TOC rows by the output thread."""

    __slots__ = ("buf", "mv", "fill", "ends", "pieces", "local", "done", "compressed", "error",
                 "compressed_lock", "done_lock")

    def __init__(self, buf: bytearray, mv: memoryview) -> None:
        self.buf, self.mv = buf, mv
        self.fill = 0
        self.ends: list[int] = []   # frame ends in the buffer
        self.pieces: list = []      # (hash, start, end): file contents to hash, in order
        self.local: list = []       # the same for files wholly in this batch: hashed by the
        #                             compression worker, in parallel with other batches
        self.done: list = []        # (entry, data offset, hash or None) completed members
        self.compressed: zstandard.BufferWithSegmentsCollection | None = None
        self.error: BaseException | None = None
        # plain locks as one-shot signals: released by the worker / output thread when done
        # (a Future + ThreadPoolExecutor.submit cost ~10x more main-thread time per batch)
        self.compressed_lock = threading.Lock()
        self.compressed_lock.acquire()
        self.done_lock = threading.Lock()
        self.done_lock.acquire()


class _FrameSink:
    """Accepts tar bytes, cuts frames where the planner said, compresses and writes them.

    Threads: ``workers`` compression threads (zstandard releases the GIL; one C call per batch
    of frames, since a Python loop over small frames would wait for the GIL before each one)
    and one output thread that takes batches in order: sha256 of the tar and of each file's
    pieces, then writes the compressed frames (hashing the blob) and formats the TOC rows of
    the members completed in that batch. Files wholly inside one batch are hashed by the
    worker that compresses it (a file's hash needs its pieces in order, so only files that
    span batches are left to the output thread): that balances ~0.3 CPU-s of sha256 per
    200 MB between the threads instead of serializing it on the output thread. The main
    thread only walks, encodes headers and reads files into the batch buffers. At most
    ``_INFLIGHT`` batches are in flight."""

    def __init__(self, out: BinaryIO, workers: int, capacity: int) -> None:
        self.out = out
        self.capacity = capacity
        self.free: list[tuple[bytearray, memoryview]] = []
        self.owned: list[bytearray] = []  # every buffer this sink took from _POOL
        self.batch = self._new_batch()
        self.mv = self.batch.mv
        self.fill = 0
        self.pos = 0
        self.cuts: deque[int] = deque()
        self.next_cut = 1 << 62
        self.pending: deque[_Batch] = deque()
        self.frames: list[tuple[int, int]] = []
        self.blob_size = 0
        self.blob_hash = hashlib.sha256()
        self.tar_hash = hashlib.sha256()
        self.obuf = bytearray(0)    # output thread: compressed frames of one batch
        self.omv = memoryview(self.obuf)
        self.rows: list[str] = []   # TOC v2 rows and JSON-encoded paths, in member order
        self.paths: list[str] = []
        self.error: BaseException | None = None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.outq: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._compress_loop, name=f"layer-zstd-{i}",
                                         daemon=True) for i in range(max(1, workers))]
        self.threads.append(threading.Thread(target=self._output_loop, name="layer-out",
                                             daemon=True))
        for t in self.threads:
            t.start()

    def add_cuts(self, cuts: list[int]) -> None:
        if cuts:
            if self.next_cut == 1 << 62:
                self.next_cut = cuts[0]
                self.cuts.extend(cuts[1:])
            else:
                self.cuts.extend(cuts)

    def _close_frame(self) -> None:
        self.batch.ends.append(self.fill)
        self.next_cut = self.cuts.popleft() if self.cuts else 1 << 62
        if self.fill >= _BATCH:
            self._submit()

    def _submit(self) -> None:
        b = self.batch
        if not b.ends:
            return
        if len(self.pending) >= _INFLIGHT:
            self._drain_one()
        b.fill = self.fill
        self.jobs.put(b)
        self.outq.put(b)
        self.pending.append(b)
        self.batch = self._new_batch()
        self.fill = 0

    def _new_batch(self) -> _Batch:
        if self.free:
            buf, mv = self.free.pop()
        else:
            buf, mv = _POOL.get(self.capacity)
            self.owned.append(buf)
        self.mv = mv
        return _Batch(buf, mv)

    def _drain_one(self) -> None:
        b = self.pending.popleft()
        b.done_lock.acquire()
        if self.error is not None:
            raise self.error  # a write error (disk full ...), raised in the caller's thread
        self.free.append((b.buf, b.mv))

    def _compress_loop(self) -> None:
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        get = self.jobs.get
        while (b := get()) is not None:
            try:
                if self.error is None:
                    mv, ends = b.mv, b.ends
                    b.compressed = cctx.multi_compress_to_buffer(
                        [mv[s:e] for s, e in zip([0, *ends[:-1]], ends)], threads=1)
                    for h, start, end in b.local:
                        h.update(mv[start:end])
            except BaseException as e:  # noqa: BLE001 - handed to the output thread
                b.error = e
            b.compressed_lock.release()

    def _output_loop(self) -> None:
        get = self.outq.get
        while (b := get()) is not None:
            try:
                if self.error is None:
                    self._output(b)
            except BaseException as e:  # noqa: BLE001 - re-raised by _drain_one
                self.error = e
            b.done_lock.release()

    def _output(self, b: _Batch) -> None:
        mv = b.mv
        self.tar_hash.update(mv[:b.fill])
        for h, start, end in b.pieces:
            h.update(mv[start:end])
        b.compressed_lock.acquire()
        if b.error is not None:
            raise b.error
        compressed = b.compressed
        assert compressed is not None  # set by the worker unless it failed (b.error)
        b.compressed = None
        # gather the frames into one reused buffer: one write and one hash call per batch
        # instead of two per frame (each releases and retakes the GIL, which under CPU
        # contention from other processes stalls the main thread)
        need = compressed.size()
        if len(self.obuf) < need:
            self.obuf = bytearray(max(need, 2 * len(self.obuf)))
            self.omv = memoryview(self.obuf)
        omv, frames = self.omv, self.frames
        pos = start = 0
        for i, end in enumerate(b.ends):
            c = compressed[i]
            n = len(c)
            omv[pos:pos + n] = c  # type: ignore[call-overload]  # a buffer: zstandard stubs omit it
            frames.append((n, end - start))
            pos += n
            start = end
        del compressed
        out = omv[:pos]
        self.out.write(out)
        self.blob_hash.update(out)
        self.blob_size += pos
        rows, paths = self.rows, self.paths
        for e, data, h in b.done:
            if h is not None:
                e.digest = "sha256:" + h.hexdigest()
            rows.append(entry_row(e, data))
            paths.append(json_string(e.path))

    def _room(self, k: int) -> None:
        if self.fill + k > self.capacity:
            raise bug(f"layer frame larger than the batch buffer ({self.fill} + {k} bytes)")

    def write(self, b: bytes) -> None:
        n = len(b)
        if self.pos + n < self.next_cut:  # fast path: no frame boundary inside
            fill = self.fill
            if fill + n > self.capacity:
                self._room(n)
            self.mv[fill:fill + n] = b
            self.fill = fill + n
            self.pos += n
            return
        i = 0
        while i < n:
            k = min(n - i, self.next_cut - self.pos)
            self._room(k)
            self.mv[self.fill:self.fill + k] = b[i:i + k]
            self.fill += k
            self.pos += k
            i += k
            if self.pos == self.next_cut:
                self._close_frame()

    def copy_fd(self, fd: int, n: int, h) -> None:
        """Read exactly ``n`` bytes of ``fd`` into the stream, hashing them into ``h``."""
        readv = os.readv
        self._copy(lambda view: readv(fd, [view]), n, h)

    def copy_stream(self, f: _ReadInto, n: int, h) -> None:
        """The same from a binary stream (a tar being re-framed)."""
        self._copy(f.readinto, n, h)

    def _copy(self, readinto, n: int, h) -> None:
        batch = self.batch
        first = len(batch.pieces)
        while n:
            k = min(n, self.next_cut - self.pos)
            self._room(k)
            fill = self.fill
            got = readinto(self.mv[fill:fill + k])
            if not got:
                raise FileChanged()
            self.batch.pieces.append((h, fill, fill + got))  # a new batch after _submit
            self.fill = fill + got
            self.pos += got
            n -= got
            if not n and self.batch is batch:
                self._local(batch, first)
            if self.pos == self.next_cut:
                self._close_frame()

    @staticmethod
    def _local(batch: _Batch, first: int) -> None:
        """The file whose pieces start at ``first`` ended in the batch it started in (which is
        not submitted yet): its hash may be computed out of order, by the compression worker."""
        batch.local.extend(batch.pieces[first:])
        del batch.pieces[first:]

    def finish(self) -> None:
        b = self.batch
        if self.fill or b.ends or b.done:
            if self.fill != (b.ends[-1] if b.ends else 0):
                raise bug("tar stream does not end on a frame boundary")
            if not b.ends:
                raise bug("members completed after the last frame")
            self._submit()
        while self.pending:
            self._drain_one()

    def close(self) -> None:
        if self.error is None:
            self.error = LayerError("layer writer closed")  # workers skip what is left
        for t in self.threads:
            (self.outq if t.name == "layer-out" else self.jobs).put(None)
        for t in self.threads:
            t.join()
        for b in self.pending:  # buffers of batches drained by the threads above
            self.free.append((b.buf, b.mv))
        self.pending.clear()
        self.mv = self.batch = None  # type: ignore[assignment]  # closed: drop the buffers
        _POOL.put(self.owned)  # every thread is done with them
        self.owned = []


class LayerWriter:
    """Write members one by one; ``finish()`` appends the TOC and footer and returns the info.

    Members are written in the order given (``pack_tree`` sorts them); ``add`` takes a file
    path or a binary stream for file contents. File digests are computed off the calling
    thread: ``Entry.digest`` of an added file is set by the time ``finish()`` returns.
    """

    def __init__(self, out: BinaryIO, *, framing: str | Framing = "lazy", workers: int = 2,
                 name: str = "layer") -> None:
        self.framing = framing if isinstance(framing, Framing) else Framing.named(framing)
        self.name = name
        self.planner = FramePlanner(self.framing)
        self.sink = _FrameSink(out, workers, _capacity(self.framing))
        self.out = out
        self.count = 0
        self._paths: set[str] = set()

    def add(self, e: Entry, source=None) -> None:
        """Append one member. ``source`` is a path (bytes/str) for ``file`` contents, or a
        binary stream positioned at them."""
        if e.path in self._paths:
            raise LayerError(f"write layer {self.name}: duplicate member {e.path!r}")
        self._paths.add(e.path)
        try:
            hdr = encode_header(e)
        except ValueError as err:
            raise LayerError(f"write layer {self.name}: {err}") from None
        is_file = e.type == "file"
        size = e.size if is_file else 0
        sink = self.sink
        cuts = self.planner.member(len(hdr), size, is_file)
        if cuts:
            sink.add_cuts(cuts)
        sink.write(hdr)
        data = h = None
        if is_file:
            h = hashlib.sha256()
            if size:
                data = sink.pos
                if isinstance(source, (bytes, str)):
                    try:
                        if type(source) is FileSource:  # from walk_tree: open by dir fd
                            fd = os.open(source.name, _OPEN_FLAGS, dir_fd=source.dir_fd)
                        else:
                            fd = os.open(source, _OPEN_FLAGS)
                    except OSError as err:
                        raise LayerError(f"write layer {self.name}: open {e.path}: "
                                         f"{err.strerror}") from err
                    try:
                        sink.copy_fd(fd, size, h)
                    except FileChanged:
                        raise LayerError(f"write layer {self.name}: {e.path} shrank while being "
                                         "packed") from None
                    except OSError as err:
                        raise LayerError(f"write layer {self.name}: read {e.path}: "
                                         f"{err.strerror}") from err
                    finally:
                        os.close(fd)
                else:
                    try:
                        sink.copy_stream(source, size, h)
                    except FileChanged:
                        raise LayerError(f"write layer {self.name}: input ends inside "
                                         f"{e.path}") from None
                pad = -size % BLOCK
                if pad:
                    sink.write(_PADS[pad])
        # the output thread sets the digest and formats the TOC row once the batch holding
        # the end of this member is hashed (tar offset of the contents: ``data``)
        sink.batch.done.append((e, data, h))
        self.count += 1

    def finish(self) -> LayerInfo:
        sink = self.sink
        sink.add_cuts(self.planner.end(len(END_OF_ARCHIVE)))
        sink.write(END_OF_ARCHIVE)
        sink.finish()
        frames = sink.frames
        off = sum(c for c, _ in frames)
        uoff = sink.pos
        diff_id = "sha256:" + sink.tar_hash.hexdigest()
        toc_json = encode_v2(self.framing.name, diff_id, uoff, frames, sink.paths, sink.rows)
        try:
            check_writable(toc_json, self.count)
        except TocFormatError as err:
            raise LayerError(f"write layer {self.name}: {err}",
                             hint="fewer members, shorter paths or smaller xattrs per layer "
                                  "(split the tree into several layers)") from None
        toc_z = zstandard.ZstdCompressor(level=TOC_ZSTD_LEVEL).compress(toc_json)
        toc_sha = hashlib.sha256(toc_z).digest()
        footer = Footer(toc_offset=off, toc_csize=len(toc_z), toc_usize=len(toc_json),
                        toc_sha256=toc_sha).encode()
        tail = skippable_header(len(toc_z)) + toc_z + footer
        self.out.write(tail)
        sink.blob_hash.update(tail)
        size = off + len(tail)
        assert len(footer) == FOOTER_SIZE
        return LayerInfo(digest="sha256:" + sink.blob_hash.hexdigest(), diff_id=diff_id,
                         size=size, uncompressed_size=uoff, toc_digest="sha256:" + toc_sha.hex(),
                         entries=self.count, frames=len(frames),
                         framing=self.framing.name)

    def close(self) -> None:
        self.sink.close()

    def __enter__(self) -> LayerWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pack_tree(src_dir: str | os.PathLike, out: BinaryIO, *, framing: str | Framing = "lazy",
              source_date_epoch: int = 0, overlay_upper: bool = False,
              allow_devices: bool = True, workers: int = 2,
              entry_filter: Callable[[Iterator[tuple[Entry, str | None]]],
                                     Iterator[tuple[Entry, str | None]]] | None = None,
              overlay_xattr: str = "trusted", on_dropped: OnDropped | None = None,
              ) -> LayerInfo:
    """Pack the tree below ``src_dir`` into a layer blob written to ``out`` (see the package
    docstring). Deterministic: the same tree gives the same bytes wherever and whenever.

    ``entry_filter`` sees the walk's ``(entry, source path)`` pairs in layer order and yields
    the ones to pack, possibly changed or fewer: how pack-diff applies its policy to an
    untrusted sandbox's upper dir (drop devices, strip setuid bits, cap sizes) without a
    second copy of the tree. It must keep layer order and keep hardlinks pointing at members
    it yields, and use each source path before taking the next entry (``walk_tree``).

    ``overlay_upper``: ``src_dir`` is an overlayfs upper dir (mounted with the
    ``overlay_xattr`` namespace); only its real whiteouts and opaque dirs become OCI ones, and
    names or attributes that only look like them are refused, or left out and told to
    ``on_dropped`` (``walk_tree``)."""
    entries = walk_tree(src_dir, source_date_epoch=source_date_epoch,
                        overlay_upper=overlay_upper, allow_devices=allow_devices,
                        overlay_xattr=overlay_xattr, on_dropped=on_dropped)
    if entry_filter is not None:
        entries = entry_filter(entries)
    with LayerWriter(out, framing=framing, workers=workers, name=os.fspath(src_dir)) as w:
        for e, src in entries:
            w.add(e, src)
        return w.finish()


def pack_tar(src: BinaryIO, out: BinaryIO, *, framing: str | Framing = "lazy", name: str = "tar",
             workers: int = 2) -> LayerInfo:
    """Re-frame an existing POSIX/PAX tar stream into a layer, keeping member order and names
    (a leading ``./`` is dropped, as is the ``.`` member). Headers are re-encoded canonically;
    names are not checked here: readers enforce the safety rules on unpack."""
    stream = TarStream(iter(lambda: src.read(1 << 20), b""))
    with LayerWriter(out, framing=framing, workers=workers, name=name) as w:
        try:
            for e, _ in iter_members(stream):
                while e.path.startswith("./"):
                    e.path = e.path[2:]
                if e.type == "hardlink":
                    while e.linkname.startswith("./"):
                        e.linkname = e.linkname[2:]
                if e.path in ("", "."):
                    stream.skip(e.size)
                    continue
                w.add(e, _StreamSource(stream) if e.size else None)
        except TarFormatError as err:
            raise LayerError(f"import tar {name}: {err}") from None
        return w.finish()


class _ReadInto(Protocol):
    """What ``LayerWriter.add`` reads a member's contents from when not a path."""

    def readinto(self, view: memoryview, /) -> int: ...


class _StreamSource:
    """``readinto`` over a TarStream, bounded by the caller."""

    def __init__(self, stream: TarStream) -> None:
        self.stream = stream

    def readinto(self, view: memoryview) -> int:
        n = 0
        for piece in self.stream.pieces(len(view)):
            view[n:n + len(piece)] = piece
            n += len(piece)
        return n
