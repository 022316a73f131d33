"""Layer reader: footer -> verified TOC -> entries, stat, single-file reads, frame iteration."""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence

import zstandard

from envbuild.errors import CorruptLayerError, LayerError, UnsupportedFormatError
from envbuild.layers._footer import (
    FOOTER_SIZE,
    SKIPPABLE_MAGIC,
    Footer,
    FooterError,
    parse_skippable_header,
)
from envbuild.layers._toc import (
    MAX_TOC_USIZE,
    Chunk,
    Entry,
    LazyEntries,
    RowEntries,
    Toc,
    TocFormatError,
    TocVersionError,
)
from envbuild.layers._zstd import FrameError, decompress_frame, frame_size

GetRange = Callable[[int, int], bytes]
MAX_FRAME_USIZE = 64 << 20   # readers refuse bigger frames (v1 writers make <= ~5 MiB)
_FETCH_BATCH = 4 << 20       # whole-layer reads fetch up to this many compressed bytes at once
# ... and decompress at most this many bytes per batch (or one frame): with _LOOKAHEAD batches
# in flight, iter_frames holds ~100 MiB whatever the TOC declares (zeros inflate ~30,000x)
_BATCH_USIZE = 16 << 20
_LOOKAHEAD = 4
_local = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


class ReadStats:
    """Counters of what a reader fetched and decompressed (for tests and benchmarks)."""

    def __init__(self) -> None:
        self.ranges = 0
        self.bytes_fetched = 0
        self.frames_decompressed = 0
        self.bytes_decompressed = 0


class LayerReader:
    """Read a layer blob through ``get_range(offset, length) -> bytes``.

    Give the blob's total ``size`` or a ``get_tail(n) -> bytes`` that returns its last ``n``
    bytes (an HTTP suffix range); the footer is the last 80 bytes. ``name`` (a digest, a path)
    prefixes every error message. ``expected_toc_digest`` (``sha256:...`` from the descriptor
    annotations or key record) is checked against the TOC in addition to the footer's digest.
    Construction fetches and verifies the TOC; frames are fetched only when needed.
    """

    def __init__(self, get_range: GetRange, size: int | None = None, *, name: str = "layer",
                 get_tail: Callable[[int], bytes] | None = None,
                 expected_toc_digest: str | None = None, workers: int = 2) -> None:
        self.name = name
        self.workers = workers
        self._get_range = get_range
        self.stats = ReadStats()
        self._close: Callable[[], None] | None = None
        self.footer = f = self._read_footer(size, get_tail)
        self.size = f.blob_size
        payload = self._read_toc_frame(f, expected_toc_digest)
        try:
            # bounded by the footer's toc_usize, which is bounded by MAX_TOC_USIZE
            raw_toc = decompress_frame(_dctx(), payload, f.toc_usize, "the footer")
        except FrameError as e:
            raise self._corrupt(f"TOC frame: {e}") from None
        try:
            self.toc = Toc.from_bytes(raw_toc, lazy=True)
        except TocVersionError as e:
            raise UnsupportedFormatError(f"layer {name}: {e}") from None
        except TocFormatError as e:
            raise self._corrupt(str(e)) from None
        if sum(c for c, _ in self.toc.frames) != f.toc_offset:
            raise self._corrupt("TOC frames do not cover the blob up to the TOC")
        entries = self.toc.entries
        assert isinstance(entries, LazyEntries | RowEntries)  # lazy=True: decoded on access
        self.rows = entries  # the TOC's entries, with their paths readable without decoding
        try:
            self._index: dict[str, int] = entries.path_index()
        except TypeError:
            raise self._corrupt("TOC entry paths are not strings") from None
        if len(self._index) != len(entries):
            raise self._corrupt("TOC lists a path twice")

    def _read_footer(self, size: int | None, get_tail: Callable[[int], bytes] | None) -> Footer:
        """The footer, from the last ``FOOTER_SIZE`` bytes (by ``size`` or ``get_tail``)."""
        if size is not None:
            if size < FOOTER_SIZE:
                raise self._corrupt(f"blob is {size} bytes, too short for a footer (truncated)")
            raw = self._fetch(size - FOOTER_SIZE, FOOTER_SIZE)
        elif get_tail is not None:
            raw = get_tail(FOOTER_SIZE)
        else:
            raise TypeError("LayerReader needs size or get_tail")
        try:
            f = Footer.decode(raw)
        except FooterError as e:
            cls = UnsupportedFormatError if e.unsupported else CorruptLayerError
            raise cls(f"layer {self.name}: {e}") from None
        if size is not None and f.blob_size != size:
            raise self._corrupt(f"footer says the blob is {f.blob_size} bytes but it is {size} "
                                "(truncated or extended)")
        return f

    def _read_toc_frame(self, f: Footer, expected_toc_digest: str | None) -> bytes:
        """The TOC frame's compressed payload, size-bounded and digest-checked (sets
        ``toc_digest``)."""
        if f.toc_usize > MAX_TOC_USIZE:
            # refused before fetching or inflating anything (docs/layer-format.md, "Limits")
            raise self._corrupt(f"TOC of {f.toc_usize} bytes exceeds the reader limit of "
                                f"{MAX_TOC_USIZE >> 20} MiB (a TOC bomb, or not a layer "
                                "envbuild wrote)")
        if f.toc_csize > _compress_bound(f.toc_usize):
            raise self._corrupt(f"TOC frame of {f.toc_csize} bytes is larger than zstd makes "
                                f"for {f.toc_usize} bytes")
        tocframe = self._fetch(f.toc_offset, 8 + f.toc_csize)
        magic, length = parse_skippable_header(tocframe[:8])
        if magic != SKIPPABLE_MAGIC or length != f.toc_csize:
            raise self._corrupt("no TOC frame where the footer points (wrong skippable header)")
        payload = tocframe[8:]
        sha = hashlib.sha256(payload).digest()
        if sha != f.toc_sha256:
            raise self._corrupt(f"TOC digest mismatch (footer says sha256:{f.toc_sha256.hex()}, "
                                f"TOC is sha256:{sha.hex()})")
        self.toc_digest = "sha256:" + sha.hex()
        if expected_toc_digest is not None and expected_toc_digest != self.toc_digest:
            raise self._corrupt(f"TOC digest mismatch (expected {expected_toc_digest}, "
                                f"got {self.toc_digest})")
        return payload

    # -- construction helpers -------------------------------------------------------------

    @classmethod
    def open_file(cls, path: str | os.PathLike, **kwargs) -> LayerReader:
        """Open a local blob (``os.pread``); close with ``close()`` or a ``with`` block."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            kwargs.setdefault("name", os.fspath(path))
            reader = cls(lambda off, n: os.pread(fd, n, off), size, **kwargs)
        except BaseException:
            os.close(fd)
            raise
        reader._close = lambda: os.close(fd)
        return reader

    @classmethod
    def from_store(cls, store, digest: str, **kwargs) -> LayerReader:
        """Read blob ``digest`` from a store (anything with ``stat(digest).size`` and
        ``get_range(digest, offset, length)``); the digest names the layer in errors."""
        size = store.stat(digest).size
        kwargs.setdefault("name", digest)
        return cls(lambda off, n: store.get_range(digest, off, n), size, **kwargs)

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self) -> LayerReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _corrupt(self, what: str) -> CorruptLayerError:
        return CorruptLayerError(f"layer {self.name}: {what}")

    def _fetch(self, offset: int, length: int) -> bytes:
        try:
            data = self._get_range(offset, length)
        except LayerError:
            raise
        except OSError as e:
            raise LayerError(f"layer {self.name}: read {length} bytes at {offset}: "
                             f"{e.strerror or e}") from e
        self.stats.ranges += 1
        self.stats.bytes_fetched += len(data)
        if len(data) != length:
            raise self._corrupt(f"short read at offset {offset}: wanted {length} bytes, got "
                                f"{len(data)} (truncated blob)")
        return data

    def _decompress(self, frame, usize: int, offset: int, exact: bool = False) -> bytes:
        """One data frame, never more than ``usize`` (the TOC's) bytes of output; ``exact``
        also checks the frame ends where the TOC says (verify)."""
        self._check_frame(len(frame), usize, offset)
        try:
            if exact and frame_size(frame) != len(frame):
                raise self._corrupt(f"frame at offset {offset} does not end where the TOC says")
            out = decompress_frame(_dctx(), frame, usize)
        except FrameError as e:
            raise self._corrupt(f"frame at offset {offset}: {e}") from None
        self.stats.frames_decompressed += 1
        self.stats.bytes_decompressed += usize
        return out

    def _check_frame(self, csize: int, usize: int, offset: int) -> None:
        if usize > MAX_FRAME_USIZE:
            raise self._corrupt(f"frame at offset {offset} claims {usize} bytes, over the "
                                f"{MAX_FRAME_USIZE} limit")
        if csize > _compress_bound(usize):
            raise self._corrupt(f"frame at offset {offset} is {csize} bytes, larger than zstd "
                                f"makes for the {usize} bytes the TOC says")

    # -- queries --------------------------------------------------------------------------

    def entries(self) -> Sequence[Entry]:
        """Every member in tar order."""
        try:
            return self.toc.entries[:]
        except TocFormatError as e:
            raise self._corrupt(str(e)) from None

    def stat(self, path: str) -> Entry:
        i = self._index.get(path.strip("/"))
        if i is None:
            raise LayerError(f"layer {self.name}: no member {path!r}")
        try:
            return self.toc.entries[i]
        except TocFormatError as e:
            raise self._corrupt(str(e)) from None

    def read(self, path: str) -> bytes:
        """The contents of one regular file (a hardlink reads its target), decompressing only the
        frames that hold it, verified against the TOC digest."""
        return b"".join(self.iter_read(path))

    def iter_read(self, path: str) -> Iterator[bytes]:
        """``read`` in pieces of at most one frame, fetching at most ``_FETCH_BATCH``
        compressed bytes at a time: memory stays bounded whatever size the TOC declares. The
        digest is checked after the last piece, so a caller that writes pieces out as they
        come must discard them on ``CorruptLayerError``."""
        e = self.stat(path)
        if e.type == "hardlink":
            e = self.stat(e.linkname)
        if e.type != "file":
            raise LayerError(f"layer {self.name}: {path} is a {e.type}, not a regular file")
        h = hashlib.sha256()
        need = e.size
        for run in _runs(e.chunks, _FETCH_BATCH):
            start = run[0].offset
            end = run[-1].offset + run[-1].csize
            if end > self.footer.toc_offset:
                raise self._corrupt(f"chunk of {e.path} points past the data frames")
            for c in run:  # before fetching: a frame's csize is bounded by its usize
                self._check_frame(c.csize, c.usize, c.offset)
            data = memoryview(self._fetch(start, end - start))
            for c in run:
                frame = self._decompress(data[c.offset - start:c.offset - start + c.csize],
                                         c.usize, c.offset)
                piece = frame[c.inner:c.inner + need]
                if not piece and need:
                    raise self._corrupt(f"chunk of {e.path} is outside its frame")
                need -= len(piece)
                h.update(piece)
                yield piece
        if need:
            raise self._corrupt(f"chunks of {e.path} hold fewer bytes than its size")
        if "sha256:" + h.hexdigest() != e.digest:
            raise self._corrupt(f"content of {e.path} does not match its TOC digest")

    def iter_frames(self, *, exact: bool = False, raw: bool = False) -> Generator:
        """Decompressed data frames in order (fetched and decompressed by a thread pool).
        With ``raw``, yields ``(compressed, decompressed)`` pairs."""
        batches = self._batches()
        # Imported here: concurrent.futures pulls in logging, a cost for every TOC-only reader.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=self.workers,
                                thread_name_prefix="layer-unzstd") as pool:
            pending: deque = deque()
            it = iter(batches)
            try:
                for b in it:
                    pending.append(pool.submit(self._decode_batch, *b, exact, raw))
                    if len(pending) >= _LOOKAHEAD:
                        yield from pending.popleft().result()
                while pending:
                    yield from pending.popleft().result()
            finally:
                for p in pending:
                    p.cancel()

    def _batches(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """The data frames in fetch batches: (blob offset, [(csize, usize)]), each frame's
        sizes checked before anything is fetched."""
        batches: list[tuple[int, list[tuple[int, int]]]] = []
        off = 0
        cur: list[tuple[int, int]] = []
        start = 0
        total = 0
        utotal = 0
        for csize, usize in self.toc.frames:
            self._check_frame(csize, usize, off)  # before fetching anything
            if cur and (total + csize > _FETCH_BATCH or utotal + usize > _BATCH_USIZE):
                batches.append((start, cur))
                start, cur, total, utotal = off, [], 0, 0
            cur.append((csize, usize))
            total += csize
            utotal += usize
            off += csize
        if cur:
            batches.append((start, cur))
        return batches

    def _decode_batch(self, start: int, sizes: list[tuple[int, int]], exact: bool,
                      raw: bool) -> list:
        """Fetch one batch and decompress its frames (``iter_frames``' worker)."""
        total = sum(c for c, _ in sizes)
        data = memoryview(self._fetch(start, total))
        out = []
        pos = 0
        if exact or raw:
            for csize, usize in sizes:
                frame = data[pos:pos + csize]
                d = self._decompress(frame, usize, start + pos, exact)
                out.append((frame, d) if raw else d)
                pos += csize
            return out
        # one C call per batch: see _writer._FrameSink for why not a Python loop
        frames: list[bytes | bytearray | memoryview] = []
        for csize, _usize in sizes:
            frames.append(data[pos:pos + csize])
            pos += csize
        usizes = struct.pack(f"={len(sizes)}Q", *(u for _, u in sizes))
        # decompressed_sizes sizes each output buffer from the TOC (never from the frame
        # header) and fails a frame that produces more: bounded like _decompress
        try:
            coll = _dctx().multi_decompress_to_buffer(frames, decompressed_sizes=usizes,
                                                      threads=1)
        except (zstandard.ZstdError, ValueError) as e:
            # name the frame and the cause: redo the batch one bounded frame at a time
            pos = 0
            for piece, (csize, usize) in zip(frames, sizes):
                self._decompress(piece, usize, start + pos)
                pos += csize
            raise self._corrupt(f"a frame between offsets {start} and {start + total} does "
                                f"not decompress ({e})") from None
        self.stats.frames_decompressed += len(sizes)
        self.stats.bytes_decompressed += sum(u for _, u in sizes)
        # zstandard's stubs do not declare BufferSegment's buffer protocol (__buffer__)
        return [memoryview(coll[i]) for i in range(len(sizes))]  # type: ignore[arg-type]

    def unpack(self, dest: str | os.PathLike, *, whiteouts: str = "apply", **kwargs) -> None:
        """Extract every member below ``dest``; see ``envbuild.layers.unpack_layer``."""
        from envbuild.layers._unpack import unpack_layer

        unpack_layer(self, dest, whiteouts=whiteouts, **kwargs)


def _compress_bound(usize: int) -> int:
    """An upper bound of ZSTD_compressBound(usize) (zstd's worst case for incompressible
    data) plus a frame header and checksum: a frame bigger than this was not made by zstd
    from ``usize`` bytes."""
    return usize + (usize >> 7) + 256


def _runs(chunks: list[Chunk], limit: int) -> Iterator[list[Chunk]]:
    """Group chunks whose frames are adjacent in the blob, up to ``limit`` compressed bytes
    (or one frame) per group: one ranged read per group."""
    run: list[Chunk] = []
    size = 0
    for c in chunks:
        if run and (run[-1].offset + run[-1].csize != c.offset or size + c.csize > limit):
            yield run
            run, size = [], 0
        run.append(c)
        size += c.csize
    if run:
        yield run
