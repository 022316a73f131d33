"""The chunk cache of lazy layer reads (``envbuild.store.lazy``).

**Chunk cache key — content, not position**: a cached *piece* is the uncompressed bytes of
one file that one frame holds: ``file[start:end]``. Its key is
``sha256("envbuild.chunk.v1\\0" + file_digest + "\\0" + start + "\\0" + end)``: the file's
content digest (in the TOC) plus the byte range within the file, which determines the bytes
exactly, whatever layer, blob offset or neighbouring files the frame had. The same file in two
layers framed the same way (envbuild's framing cuts at the file's start and every 4 MiB
inside it, so it is) hits the same pieces; a file smaller than a frame is one piece,
``start=0, end=size``. The cache stores decompressed bytes, so a hit costs no decompression.
``ChunkCache`` (a node-local directory; ``MemoryChunkCache`` for tests and short-lived readers)
keeps each piece with a sha256 trailer and drops a piece that fails it (disk damage), then
refetches; it evicts least recently used pieces above ``max_bytes``.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

from envbuild.atomic import atomic_file, write_atomic
from envbuild.errors import LayerError

MiB = 1 << 20
CHUNK_CACHE_VERSION = 1
_KEY_TAG = b"envbuild.chunk.v1\0"
_TRAILER = 32


def piece_key(file_digest: str, start: int, end: int) -> str:
    """The chunk-cache key of ``file[start:end]`` for a file with content digest
    ``file_digest``."""
    return hashlib.sha256(_KEY_TAG + f"{file_digest}\0{start}\0{end}".encode()).hexdigest()


class MemoryChunkCache:
    """An in-memory LRU of pieces (same interface as ``ChunkCache``)."""

    def __init__(self, max_bytes: int = 256 * MiB) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            if key in self._items or len(data) > self.max_bytes:
                return
            self._items[key] = data
            self._size += len(data)
            while self._size > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._size -= len(old)


class ChunkCache:
    """Verified file pieces on this node's disk, keyed by content (see the module docstring).

    Layout (version 1)::

        <dir>/chunk-cache.json   {"version": 1}
        <dir>/<aa>/<key-hex>     piece bytes + sha256(piece bytes) (32 bytes)

    Writes are atomic (temp file, rename); a piece whose trailer does not match is deleted and
    reported as a miss. ``get`` bumps the file's mtime, the clock of the LRU eviction that runs
    when a ``put`` takes the cache over ``max_bytes`` (down to 90 %). Safe for several threads
    and processes (the size count is per process and re-scanned on eviction).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self.dir / "chunk-cache.json"
        if meta.exists():
            import json

            version = json.loads(meta.read_text()).get("version")
            if version != CHUNK_CACHE_VERSION:
                raise LayerError(f"chunk cache {self.dir} has version {version!r}; this "
                                 f"envbuild knows {CHUNK_CACHE_VERSION}",
                                 hint=f"remove {self.dir} (it is only a cache)")
        else:
            write_atomic(meta, '{"version": 1}', tmp_prefix=".tmp-")
        self._size = self._scan()[1]

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / key

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        data, trailer = raw[:-_TRAILER], raw[-_TRAILER:]
        if len(raw) < _TRAILER or hashlib.sha256(data).digest() != trailer:
            path.unlink(missing_ok=True)  # damaged on disk: refetch
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        return data

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if path.exists():
            return
        path.parent.mkdir(exist_ok=True)
        with atomic_file(path, tmp_prefix=".tmp-") as f:
            f.write(data)
            f.write(hashlib.sha256(data).digest())
        with self._lock:
            self._size += len(data) + _TRAILER
            over = self._size > self.max_bytes
        if over:
            self._evict()

    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        items, total = [], 0
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            with os.scandir(sub) as it:
                for e in it:
                    if e.name.startswith("."):
                        continue
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    items.append((st.st_mtime, st.st_size, Path(e.path)))
                    total += st.st_size
        return items, total

    def _evict(self) -> None:
        with self._lock:
            items, total = self._scan()
            for _, size, path in sorted(items):
                if total <= self.max_bytes * 0.9:
                    break
                path.unlink(missing_ok=True)
                total -= size
            self._size = total
