"""Lazy layer reads: list, stat and read files of a layer in a store without pulling it whole.

::

    layer = LazyLayer(store, digest, chunk_cache=MemoryChunkCache(256 << 20),
                      expected_toc_digest=annotation, size=descriptor_size)
    layer.listdir("usr/bin"); layer.stat("etc/os-release"); layer.read("etc/os-release")
    layer.read("usr/lib/libbig.so", offset=4096, size=512)
    layer.prefetch(["a.py", "b.py", ...])      # many files at once, requests in parallel
    layer.stats                                # requests, bytes_fetched, cache_hits, ...

**Opening costs one ranged read when the blob's size is known** (pass it from the lock's
descriptor): its last ``TOC_GUESS`` bytes, which hold the footer (the last 80 bytes) and, for
all but huge layers, the TOC right before it (a second read fetches a TOC that does not fit).
Without the size: a suffix range for the footer when the store is a ``TailReader``, as
``S3Store`` and ``LocalStore`` are (otherwise one ``stat`` first), then the TOC. Both are
verified (footer → TOC sha256, and ``expected_toc_digest`` from the descriptor annotation or key
record). After that, reads fetch only the zstd frames holding the files asked for: the frames
a request needs are sorted by offset and **adjacent frames are fetched in one ranged read**,
also across a gap of at most ``merge_gap`` bytes (default 16 KiB: with ``lazy`` framing, two
consecutive files' frames are separated by a small frame holding the next tar header, and a
request costs milliseconds — boto3 or server CPU, network latency — which buys far more than
16 KiB of transfer; measured in benchmarks/lazy_read.py: 4 KiB → 468 requests / 2.8 MB,
16 KiB → 371 / 3.8 MB, 64 KiB → 198 / 10.1 MB for the same 568 files). Runs are capped at ``max_request``
bytes so large prefetches still run in parallel on ``workers`` threads.

**Verification before use**: the TOC has one digest per file (sha256 of its contents), not
per frame. So the first read of *any* byte of a file fetches all of that file's frames and
checks the whole file against its TOC digest before returning anything (a mismatch is a
``CorruptLayerError`` naming the layer and the path); only verified bytes enter the cache.
For large files read in small pieces this front-loads the file's fetch; per-frame digests
would need a TOC format change (see the S3 issue notes).

The chunk cache (its key, its files): ``envbuild.store._lazy_cache``; reads over a presigned
URL without boto3 and the background marking of reads: ``envbuild.store._lazy_sources``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import zstandard

from envbuild.errors import CorruptLayerError, LayerError
from envbuild.layers import MAX_FRAME_USIZE, Chunk, Entry, FrameError, LayerReader, decompress_frame
from envbuild.store._lazy_cache import MemoryChunkCache, piece_key
from envbuild.store._lazy_sources import (  # noqa: F401  (_range_client: the filler's)
    HttpRanges,
    _leaf_pool,
    _range_client,
    background,
    is_background,
)
from envbuild.store.base import RangeReader, TailReader

MiB = 1 << 20
#: Bytes of a layer's tail read at open when its size is known: footer and TOC in one
#: request for TOCs up to this size (the venv layers of benchmarks/cold_start.py: 0.6 MB).
TOC_GUESS = 1 * MiB
#: Requests in flight for one large file read by ``LazyLayer.stream``: enough to keep a link
#: with ~10 ms first-byte latency busy (a frame of ~1 MB takes ~8 ms at 1 Gbit/s) while the
#: frames still arrive about in file order, so hashing follows the transfer.
STREAM_WORKERS = 3
#: TOC entries (and their pieces) a layer remembers by path (``LazyLayer._file``); past
#: this many the memo starts over.
MAX_REMEMBERED_ENTRIES = 65536
_local = threading.local()
_now = time.monotonic
#: ``$ENVBUILD_LAZY_OPEN_TRACE``: a file that gets one line per ranged read of frames (when,
#: how long, bytes, thread, decompression time) beside the daemon's per-open lines.
_TRACE = os.environ.get("ENVBUILD_LAZY_OPEN_TRACE") or None
_trace_lock = threading.Lock()


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


@dataclasses.dataclass
class LazyStats:
    """What a ``LazyLayer`` did (for tests, benchmarks and ``envbuild layer stat --lazy``)."""

    requests: int = 0          # ranged reads sent to the store (footer and TOC included)
    bytes_fetched: int = 0     # compressed bytes those reads returned
    toc_bytes: int = 0         # of which footer + TOC
    frames_fetched: int = 0
    bytes_decompressed: int = 0
    cache_hits: int = 0        # pieces served from the chunk cache
    cache_misses: int = 0
    files_verified: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Piece:
    chunk: Chunk
    start: int   # offset in the file
    length: int
    key: str


class LazyLayer:
    """A layer in a store, read through its TOC (see the module docstring).

    ``store``: any ``RangeReader`` (a ``Store``, or ``HttpRanges``). ``size``: the blob size
    when known (lock descriptor; saves a request on stores that are not a ``TailReader``).
    ``tail``: the blob's last bytes when the caller has them (its footer and TOC, as
    ``native`` hands its filler the tail its create fetched): no request for those; they
    are verified all the same (footer → TOC digest, ``expected_toc_digest``).
    ``workers``: parallel ranged reads for ``prefetch``. ``max_request``: cap on one merged
    read; ``merge_gap``: unneeded bytes a merged read may span. Thread-safe.
    """

    def __init__(self, store: RangeReader, digest: str, *, chunk_cache: Any = None,
                 expected_toc_digest: str | None = None, size: int | None = None,
                 workers: int = 8, max_request: int = 8 * MiB,
                 merge_gap: int = 16 << 10, tail: bytes | None = None) -> None:
        self.store = store
        self.digest = digest
        self.cache = chunk_cache if chunk_cache is not None else MemoryChunkCache()
        self.workers = workers
        self.max_request = max_request
        self.merge_gap = merge_gap
        self.stats = LazyStats()
        self._lock = threading.Lock()
        self._children: dict[str, list[str]] | None = None
        self._files: dict[str, Entry] = {}            # path -> its regular file's entry
        self._piece_lists: dict[str, list[_Piece]] = {}   # entry path -> its pieces
        self._tail: tuple[int, bytes] | None = None
        want_toc = expected_toc_digest or None
        if size is None and tail is None and isinstance(store, TailReader):
            actual: list[int] = []
            tail_reader = store

            def get_tail(n: int) -> bytes:
                data, total = tail_reader.get_tail(digest, n)
                self._count(len(data), toc=True)
                actual.append(total)
                return data

            self.reader = LayerReader(self._toc_range, get_tail=get_tail, name=digest,
                                      expected_toc_digest=want_toc)
            if actual and actual[0] != self.reader.footer.blob_size:
                raise CorruptLayerError(f"layer {digest}: footer says the blob is "
                                        f"{self.reader.footer.blob_size} bytes but it is "
                                        f"{actual[0]} (truncated or extended)")
        else:
            if size is None:
                size = store.stat(digest).size
            if tail is not None and 0 < len(tail) <= size:   # fetched by someone else
                self._tail = (size - len(tail), tail)
            else:
                # one request for footer and TOC: the TOC sits right before the footer, and
                # a tail of TOC_GUESS bytes holds it for all but huge layers (a second
                # request then)
                n = min(size, TOC_GUESS)
                self._tail = (size - n, store.get_range(digest, size - n, n))
                self._count(len(self._tail[1]), toc=True)
            self.reader = LayerReader(self._toc_range, size, name=digest,
                                      expected_toc_digest=want_toc)
            self._tail = None
        self.size = self.reader.footer.blob_size
        self.toc_digest = self.reader.toc_digest

    # -- fetching ----------------------------------------------------------------------------

    def _count(self, n: int, *, toc: bool = False, frames: int = 0) -> None:
        with self._lock:
            self.stats.requests += 1
            self.stats.bytes_fetched += n
            self.stats.frames_fetched += frames
            if toc:
                self.stats.toc_bytes += n

    def _toc_range(self, offset: int, length: int) -> bytes:
        if self._tail is not None:
            start, buf = self._tail
            if offset >= start and offset + length <= start + len(buf):
                return buf[offset - start:offset - start + length]
        data = self.store.get_range(self.digest, offset, length)
        self._count(len(data), toc=True)
        return data

    def _fetch_run(self, run: list[Chunk]) -> dict[int, bytes]:
        """One ranged read for adjacent frames; returns offset -> decompressed frame."""
        start, end = run[0].offset, run[-1].offset + run[-1].csize
        if end > self.reader.footer.toc_offset:
            raise self._corrupt(f"a chunk points past the data frames (offset {end})")
        t0 = _now()
        data = self.store.get_range(self.digest, start, end - start)
        t1 = _now()
        self._count(len(data), frames=len(run))
        if len(data) != end - start:
            raise self._corrupt(f"short read at offset {start}: wanted {end - start} bytes, "
                                f"got {len(data)} (truncated blob)")
        view = memoryview(data)
        out = {}
        for c in run:
            frame = view[c.offset - start:c.offset - start + c.csize]
            if c.usize > MAX_FRAME_USIZE:
                raise self._corrupt(f"frame at offset {c.offset} claims {c.usize} bytes, over "
                                    f"the {MAX_FRAME_USIZE} limit")
            try:
                # never more output than the TOC declares (a frame of zeros inflates ~30,000x)
                plain = decompress_frame(_dctx(), frame, c.usize)
            except FrameError as e:
                raise self._corrupt(f"frame at offset {c.offset}: {e}") from None
            out[c.offset] = plain
        with self._lock:
            self.stats.bytes_decompressed += sum(c.usize for c in run)
        if _TRACE:
            with _trace_lock, open(_TRACE, "a") as f:
                f.write(f"{t0:.6f} {(t1 - t0) * 1e3:.2f} GET {self.digest[7:19]} {len(data)} "
                        f"{threading.current_thread().name} dec={(_now() - t1) * 1e3:.2f} "
                        f"at={start} bg={int(is_background())}\n")
        return out

    def _runs(self, frames: Iterable[Chunk], max_run: int | None = None,
              merge_gap: int | None = None) -> list[list[Chunk]]:
        """Frames (deduplicated by offset) grouped into ranged reads: adjacent ones (up to
        ``merge_gap``, default the layer's, apart) together, at most ``max_run`` (default
        ``max_request``) bytes."""
        cap = self.max_request if max_run is None else max_run
        gap_max = self.merge_gap if merge_gap is None else merge_gap
        unique = sorted({c.offset: c for c in frames}.values(), key=lambda c: c.offset)
        runs: list[list[Chunk]] = []
        for c in unique:
            if runs:
                last, first = runs[-1][-1], runs[-1][0]
                gap = c.offset - (last.offset + last.csize)
                if 0 <= gap <= gap_max and c.offset + c.csize - first.offset <= cap:
                    runs[-1].append(c)
                    continue
            runs.append([c])
        return runs

    def _fetch_frames(self, frames: Iterable[Chunk], workers: int | None = None,
                      max_run: int | None = None, merge_gap: int | None = None
                      ) -> Iterator[dict[int, bytes]]:
        """Fetch frames in ranged reads (``_runs``), ``workers`` at a time; yields each read's
        decompressed frames (offset -> bytes) as it completes."""
        runs = self._runs(frames, max_run, merge_gap)
        workers = self.workers if workers is None else workers
        if len(runs) <= 1 or workers <= 1:
            for run in runs:
                yield self._fetch_run(run)
            return
        bg = is_background()
        pool = _leaf_pool(bg)

        def fetch(run: list[Chunk]) -> dict[int, bytes]:
            if not bg:
                return self._fetch_run(run)
            with background():  # the workers' requests are as background as ours
                return self._fetch_run(run)

        todo = iter(runs)
        pending: set[concurrent.futures.Future[dict[int, bytes]]] = set()

        def top_up() -> None:   # at most ``workers`` of this call's reads at once
            while len(pending) < workers and (run := next(todo, None)) is not None:
                pending.add(pool.submit(fetch, run))

        try:
            top_up()
            while pending:
                done, _ = concurrent.futures.wait(
                    pending, return_when=concurrent.futures.FIRST_COMPLETED)
                pending.difference_update(done)
                top_up()
                for fut in done:
                    yield fut.result()
        finally:
            for fut in pending:
                fut.cancel()
            concurrent.futures.wait(pending)   # none of this call's reads outlives it

    # -- files -------------------------------------------------------------------------------

    def _corrupt(self, what: str) -> CorruptLayerError:
        return CorruptLayerError(f"layer {self.digest}: {what}")

    def _file(self, path: str) -> Entry:
        # remembered: a fetched file is looked up by each of its reads, its verification, its
        # cache file's write and the predictions naming it; its TOC row (a JSON cell, checks)
        # was decoded 9,567 times during one cold_start heavy import
        e = self._files.get(path)
        if e is not None:
            return e
        e = self.reader.stat(path)
        if e.type == "hardlink":
            e = self.reader.stat(e.linkname)
        if e.type != "file":
            raise LayerError(f"layer {self.digest}: {path} is a {e.type}, not a regular file")
        if len(self._files) >= MAX_REMEMBERED_ENTRIES:
            self._files.clear()
        self._files[path] = e
        return e

    def _pieces_for(self, e: Entry) -> list[_Piece]:
        """``_pieces(e)``, remembered by path (as ``_file``); the list is shared: not to be
        changed."""
        got = self._piece_lists.get(e.path)
        if got is not None:
            return got
        if len(self._piece_lists) >= MAX_REMEMBERED_ENTRIES:
            self._piece_lists.clear()
        got = self._piece_lists[e.path] = self._pieces(e)
        return got

    @staticmethod
    def _pieces(e: Entry) -> list[_Piece]:
        pieces, pos, need = [], 0, e.size
        for c in e.chunks:
            n = min(c.usize - c.inner, need)
            pieces.append(_Piece(c, pos, n, piece_key(e.digest or "", pos, pos + n)))
            pos += n
            need -= n
        return pieces

    def _cached(self, pieces: Sequence[_Piece]) -> dict[str, bytes]:
        """The pieces of ``pieces`` the chunk cache holds whole (by key), counted as hits and
        the rest as misses."""
        have: dict[str, bytes] = {}
        for p in pieces:
            data = self.cache.get(p.key)
            if data is not None and len(data) == p.length:
                have[p.key] = data
        with self._lock:
            self.stats.cache_hits += len(have)
            self.stats.cache_misses += len(pieces) - len(have)
        return have

    def _load(self, entries: Sequence[Entry], workers: int | None = None, *,
              on_frames: Callable[[list[int]], None] | None = None,
              max_run: int | None = None, merge_gap: int | None = None) -> dict[str, bytes]:
        """Whole, verified contents of ``entries`` (by path), from the cache or fetched; every
        fetched piece goes into the cache. ``on_frames(offsets)`` is called as each ranged
        read completes, once every file whose frames have all arrived is verified and cached
        (a file wholly inside the reported frames is then readable from the cache)."""
        result: dict[str, bytes] = {}
        todo: list[tuple[Entry, list[_Piece], dict[str, bytes]]] = []
        for e in entries:
            pieces = self._pieces_for(e)
            have = self._cached(pieces)
            if len(have) == len(pieces):
                result[e.path] = b"".join(have[p.key] for p in pieces)
            else:
                todo.append((e, pieces, have))
        if not todo:
            return result
        frames: dict[int, bytes] = {}
        # the files waiting for each frame, to verify each file as soon as it is complete
        waiting: dict[int, list[int]] = {}
        left: list[int] = []
        for k, (_e, pieces, have) in enumerate(todo):
            need = {p.chunk.offset for p in pieces if p.key not in have}
            left.append(len(need))
            for off in need:
                waiting.setdefault(off, []).append(k)
        for got in self._fetch_frames((p.chunk for _, pieces, have in todo for p in pieces
                                       if p.key not in have), workers, max_run,
                                      merge_gap):
            frames.update(got)
            for off in got:
                for k in waiting.get(off, ()):
                    left[k] -= 1
                    if left[k] == 0:
                        e, pieces, have = todo[k]
                        result[e.path] = self._verify(e, pieces, have, frames)
            if on_frames is not None:
                on_frames(list(got))
        return result

    def _verify(self, e: Entry, pieces: list[_Piece], have: dict[str, bytes],
                frames: dict[int, bytes]) -> bytes:
        """``e``'s contents from cached pieces and fetched frames, checked against its TOC
        digest; its fetched pieces then go into the cache."""
        h, parts = hashlib.sha256(), []
        for p in pieces:
            data = have.get(p.key)
            if data is None:
                frame = frames[p.chunk.offset]
                data = frame[p.chunk.inner:p.chunk.inner + p.length]
                if len(data) != p.length:
                    raise self._corrupt(f"chunk of {e.path} is outside its frame")
            h.update(data)
            parts.append((p, data))
        if "sha256:" + h.hexdigest() != e.digest or sum(p.length for p in pieces) != e.size:
            raise self._corrupt(f"content of {e.path} does not match its TOC digest")
        for p, data in parts:
            if p.key not in have:
                self.cache.put(p.key, bytes(data))
        with self._lock:
            self.stats.files_verified += 1
        return b"".join(bytes(d) for _, d in parts)

    # -- public ------------------------------------------------------------------------------

    def compressed_size(self, path: str) -> int:
        """Bytes of the frames holding regular file ``path`` (what fetching it costs; frames
        shared with other files counted whole)."""
        return sum(c.csize for c in self._file(path).chunks)

    def stat(self, path: str) -> Entry:
        """The TOC entry of ``path`` (no request)."""
        return self.reader.stat(path)

    def entries(self) -> Sequence[Entry]:
        return self.reader.entries()

    def listdir(self, path: str = "") -> list[str]:
        """Names directly below directory ``path`` ("" or "/" is the root), sorted."""
        if self._children is None:
            children: dict[str, list[str]] = {}
            toc = self.reader.rows
            for i in range(len(toc)):
                p = toc.raw_path(i)
                parent, _, name = p.rpartition("/")
                children.setdefault(parent, []).append(name)
            self._children = {k: sorted(v) for k, v in children.items()}
        key = path.strip("/")
        if key and self.reader.stat(key).type != "dir":
            raise LayerError(f"layer {self.digest}: {path} is not a directory")
        return list(self._children.get(key, []))

    def read(self, path: str, offset: int = 0, size: int | None = None) -> bytes:
        """``size`` bytes (default: to the end) of regular file ``path`` from ``offset``;
        verified (see the module docstring)."""
        e = self._file(path)
        end = e.size if size is None else min(e.size, offset + max(size, 0))
        if offset >= end:
            return b""
        pieces = [p for p in self._pieces_for(e)
                  if p.start < end and p.start + p.length > offset]
        cached = [self.cache.get(p.key) for p in pieces]
        if all(d is not None and len(d) == p.length for d, p in zip(cached, pieces)):
            with self._lock:
                self.stats.cache_hits += len(pieces)
            data = b"".join(cached)  # type: ignore[arg-type]
            base = pieces[0].start
            return data[offset - base:end - base]
        return self._load([e])[e.path][offset:end]

    def stream(self, path: str, *, workers: int = STREAM_WORKERS) -> Iterator[bytes]:
        """The contents of regular file ``path``, in order, piece by piece, for a large file
        read whole (written to a cache file): its missing frames are fetched one request each,
        ``workers`` at a time in file order, each decompressed by the thread that fetched it,
        while this thread hashes and yields the pieces in order — transfer, decompression and
        hashing overlap instead of following each other. **Verified only at the end**: after
        the last piece the whole file is checked against its TOC digest and a mismatch raises
        ``CorruptLayerError`` from the generator, so a consumer must not use (expose, rename
        into place) what it got before the generator finished. Fetched pieces enter the chunk
        cache only once the file is verified."""
        e = self._file(path)
        pieces = self._pieces_for(e)
        have = self._cached(pieces)
        need = list({p.chunk.offset: p.chunk for p in pieces if p.key not in have}.values())
        pool = _leaf_pool(is_background())
        index = {c.offset: i for i, c in enumerate(need)}
        futs: dict[int, concurrent.futures.Future[dict[int, bytes]]] = {}

        def submit_upto(n: int) -> None:   # in file order, at most ``workers`` ahead of use
            for c in need[len(futs):n]:
                futs[c.offset] = pool.submit(self._fetch_run, [c])

        try:
            h, fetched, total = hashlib.sha256(), [], 0
            for p in pieces:
                data = have.get(p.key)
                if data is None:
                    submit_upto(index[p.chunk.offset] + max(1, workers))
                    frame = futs[p.chunk.offset].result()[p.chunk.offset]
                    data = frame[p.chunk.inner:p.chunk.inner + p.length]
                    if len(data) != p.length:
                        raise self._corrupt(f"chunk of {e.path} is outside its frame")
                    fetched.append((p, data))
                h.update(data)
                total += len(data)
                yield data
            if "sha256:" + h.hexdigest() != e.digest or total != e.size:
                raise self._corrupt(f"content of {e.path} does not match its TOC digest")
            for p, data in fetched:
                self.cache.put(p.key, data)
            with self._lock:
                self.stats.files_verified += 1
        finally:
            for fut in futs.values():
                fut.cancel()   # those not started yet

    def prefetch(self, paths: Iterable[str], *, batch_bytes: int = 64 * MiB,
                 workers: int | None = None,
                 on_frames: Callable[[list[int]], None] | None = None,
                 max_run: int | None = None, merge_gap: int | None = None) -> int:
        """Fetch, verify and cache the regular files among ``paths`` (others are skipped),
        ``workers`` (default: the layer's) requests at a time of at most ``max_run`` bytes
        each (default ``max_request``; smaller: a large file's frames in parallel) spanning
        gaps of at most ``merge_gap`` bytes (default: the layer's), frames
        shared by several files fetched once; returns how many files were loaded.
        ``on_frames``: told of each ranged read's frames once the files they complete are
        verified and cached (see ``_load``). Memory: about ``batch_bytes`` of frames at a
        time."""
        entries = []
        seen = set()
        for p in paths:
            try:
                e = self._file(p)
            except LayerError:
                continue
            if e.path not in seen:
                seen.add(e.path)
                entries.append(e)
        entries.sort(key=lambda e: e.chunks[0].offset if e.chunks else 0)
        batch: list[Entry] = []
        total = 0
        for e in entries:
            batch.append(e)
            total += sum(c.csize for c in e.chunks)
            if total >= batch_bytes:
                self._load(batch, workers, on_frames=on_frames, max_run=max_run,
                           merge_gap=merge_gap)
                batch, total = [], 0
        if batch:
            self._load(batch, workers, on_frames=on_frames, max_run=max_run,
                       merge_gap=merge_gap)
        return len(entries)


__all__ = ["HttpRanges", "LazyLayer", "LazyStats", "MemoryChunkCache",
           "background", "is_background", "piece_key"]
