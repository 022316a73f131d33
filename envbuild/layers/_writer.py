"""Layer writer: tar headers + file contents -> frames -> compression pool -> blob, one pass.

The main thread walks members, writes headers and reads file contents straight into reusable
batch buffers (hashing each file as it goes); full batches of frames are compressed by a small
thread pool (zstandard releases the GIL) and written in order, hashing the tar (diff_id) and the
blob (layer digest) on the way out. Memory is bounded by ``inflight`` batch buffers.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import zstandard

from envbuild.errors import LayerError, bug
from envbuild.layers._footer import FOOTER_SIZE, Footer, skippable_header
from envbuild.layers._plan import FramePlanner, Framing, MiB
from envbuild.layers._stream import TarStream, iter_members
from envbuild.layers._tar import BLOCK, END_OF_ARCHIVE, TarFormatError, encode_header
from envbuild.layers._toc import Entry, LayerInfo, encode_v2, entry_row
from envbuild.layers._walk import walk_tree

ZSTD_LEVEL = 3
TOC_ZSTD_LEVEL = 3  # the TOC is compressed after all frames, on the critical path: level 9 took
#                     85 ms on a 15k-entry TOC for 3 % less (16 KB); level 3 takes ~15 ms
_PADS = [bytes(n) for n in range(BLOCK)]
_BATCH = 1 * MiB    # submit a buffer once it holds this much and a frame ends
_CAPACITY = 8 * MiB  # batch + the largest frame (max_frame + a 1 MiB extended header) + slack
_INFLIGHT = 4
_local = threading.local()


def _compress_batch(mv: memoryview, ends: list[int]):
    """Compress consecutive frames of one buffer. One C call for the whole batch: a Python loop
    over small frames would wait for the GIL before each frame while the main thread runs
    Python (measured: 35x slower on small frames)."""
    cctx = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    starts = [0, *ends[:-1]]
    return cctx.multi_compress_to_buffer([mv[s:e] for s, e in zip(starts, ends)], threads=1)


class FileChanged(Exception):
    pass


class _FrameSink:
    """Accepts tar bytes, cuts frames where the planner said, compresses and writes them."""

    def __init__(self, out: BinaryIO, workers: int) -> None:
        self.out = out
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="layer-zstd")
        # one thread, so FIFO: hashes the tar and writes + hashes compressed frames in order,
        # off the main thread (which reads files and hashes their contents)
        self.ordered = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layer-out")
        self.emits: deque = deque()
        self.free: list[tuple[bytearray, memoryview]] = []
        self.buf = bytearray(_CAPACITY)
        self.mv = memoryview(self.buf)
        self.fill = 0
        self.ends: list[int] = []
        self.pos = 0
        self.cuts: deque[int] = deque()
        self.next_cut = 1 << 62
        self.frame_index = 0
        self.frame_uoffset = 0
        self.pending: deque = deque()
        self.frames: list[tuple[int, int]] = []
        self.blob_size = 0
        self.blob_hash = hashlib.sha256()
        self.tar_hash = hashlib.sha256()
        # (hash, start, end) pieces of file contents in the current buffer: hashed on the
        # ordered thread with the tar, so the main thread only walks, encodes and reads
        self.hashes: list = []

    def add_cuts(self, cuts: list[int]) -> None:
        if cuts:
            if self.next_cut == 1 << 62:
                self.next_cut = cuts[0]
                self.cuts.extend(cuts[1:])
            else:
                self.cuts.extend(cuts)

    def _close_frame(self) -> None:
        self.ends.append(self.fill)
        self.frame_index += 1
        self.frame_uoffset = self.pos
        self.next_cut = self.cuts.popleft() if self.cuts else 1 << 62
        if self.fill >= _BATCH:
            self._submit()

    def _submit(self) -> None:
        if not self.ends:
            return
        if len(self.pending) >= _INFLIGHT:
            self._drain_one()
        fut = self.pool.submit(_compress_batch, self.mv, self.ends)
        hashed = self.ordered.submit(self._hash_batch, self.mv, self.fill, self.hashes)
        self.hashes = []
        self.pending.append((fut, hashed, self.buf, self.mv, self.ends))
        if self.free:
            self.buf, self.mv = self.free.pop()
        else:
            self.buf = bytearray(_CAPACITY)
            self.mv = memoryview(self.buf)
        self.fill = 0
        self.ends = []

    def _drain_one(self) -> None:
        fut, hashed, buf, mv, ends = self.pending.popleft()
        compressed = fut.result()
        self.emits.append(self.ordered.submit(self._emit, compressed, ends))
        while self.emits and (self.emits[0].done() or len(self.emits) > _INFLIGHT):
            self.emits.popleft().result()  # re-raises write errors
        hashed.result()
        self.free.append((buf, mv))

    def _hash_batch(self, mv: memoryview, fill: int, pieces: list) -> None:
        self.tar_hash.update(mv[:fill])
        for h, start, end in pieces:
            h.update(mv[start:end])

    def _emit(self, compressed, ends: list[int]) -> None:
        start = 0
        write, update, frames = self.out.write, self.blob_hash.update, self.frames
        for i, end in enumerate(ends):
            c = compressed[i]
            write(c)
            update(c)
            frames.append((len(c), end - start))
            self.blob_size += len(c)
            start = end

    def _room(self, k: int) -> None:
        if self.fill + k > _CAPACITY:
            raise bug(f"layer frame larger than the batch buffer ({self.fill} + {k} bytes)")

    def write(self, b: bytes) -> None:
        n = len(b)
        if self.pos + n < self.next_cut:  # fast path: no frame boundary inside
            fill = self.fill
            if fill + n > _CAPACITY:
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
        while n:
            k = min(n, self.next_cut - self.pos)
            self._room(k)
            fill = self.fill
            got = readv(fd, [self.mv[fill:fill + k]])
            if got == 0:
                raise FileChanged()
            self.hashes.append((h, fill, fill + got))  # a new list after each _submit
            self.fill = fill + got
            self.pos += got
            n -= got
            if self.pos == self.next_cut:
                self._close_frame()

    def copy_stream(self, f: BinaryIO, n: int, h) -> None:
        while n:
            k = min(n, self.next_cut - self.pos)
            self._room(k)
            fill = self.fill
            got = f.readinto(self.mv[fill:fill + k])
            if not got:
                raise FileChanged()
            self.hashes.append((h, fill, fill + got))
            self.fill = fill + got
            self.pos += got
            n -= got
            if self.pos == self.next_cut:
                self._close_frame()

    def finish(self) -> None:
        if self.fill or self.ends:
            if self.fill != (self.ends[-1] if self.ends else 0):
                raise bug("tar stream does not end on a frame boundary")
            self._submit()
        while self.pending:
            self._drain_one()
        while self.emits:
            self.emits.popleft().result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.ordered.shutdown(wait=True, cancel_futures=True)


class LayerWriter:
    """Write members one by one; ``finish()`` appends the TOC and footer and returns the info.

    Members are written in the order given (``pack_tree`` sorts them); ``add`` takes a
    ``read(sink, h) -> chunks`` callback for file contents so sources can be files or streams.
    """

    def __init__(self, out: BinaryIO, *, framing: str | Framing = "lazy", workers: int = 2,
                 name: str = "layer") -> None:
        self.framing = framing if isinstance(framing, Framing) else Framing.named(framing)
        self.name = name
        self.planner = FramePlanner(self.framing)
        self.sink = _FrameSink(out, workers)
        self.out = out
        self.entries: list[Entry] = []
        self.data: list[int | None] = []  # tar offset of each entry's contents (v2 TOC)
        self.file_hashes: list = []  # (entry, hash), digests set once the sink has hashed
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
        data = None
        if is_file:
            h = hashlib.sha256()
            self.file_hashes.append((e, h))
            if size:
                data = sink.pos
                if isinstance(source, (bytes, str)):
                    try:
                        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
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
        self.entries.append(e)
        self.data.append(data)

    def finish(self) -> LayerInfo:
        sink = self.sink
        sink.add_cuts(self.planner.end(len(END_OF_ARCHIVE)))
        sink.write(END_OF_ARCHIVE)
        sink.finish()
        frames = sink.frames
        off = sum(c for c, _ in frames)
        uoff = sink.pos
        for e, h in self.file_hashes:
            e.digest = "sha256:" + h.hexdigest()
        diff_id = "sha256:" + sink.tar_hash.hexdigest()
        entries = self.entries
        toc_json = encode_v2(self.framing.name, diff_id, uoff, frames, [e.path for e in entries],
                             list(map(entry_row, entries, self.data)))
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
                         entries=len(self.entries), frames=len(frames),
                         framing=self.framing.name)

    def close(self) -> None:
        self.sink.close()

    def __enter__(self) -> LayerWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def pack_tree(src_dir: str | os.PathLike, out: BinaryIO, *, framing: str | Framing = "lazy",
              source_date_epoch: int = 0, overlay_upper: bool = False,
              allow_devices: bool = True, workers: int = 2) -> LayerInfo:
    """Pack the tree below ``src_dir`` into a layer blob written to ``out`` (see the package
    docstring). Deterministic: the same tree gives the same bytes wherever and whenever."""
    entries = walk_tree(src_dir, source_date_epoch=source_date_epoch,
                        overlay_upper=overlay_upper, allow_devices=allow_devices)
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
