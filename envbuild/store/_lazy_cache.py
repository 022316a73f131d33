"""The chunk cache of lazy layer reads (``envbuild.store.lazy``).

**Chunk cache key — content, not position**: a cached *piece* is the uncompressed bytes of
one file that one frame holds: ``file[start:end]``. Its key is
``sha256("envbuild.chunk.v1\\0" + file_digest + "\\0" + start + "\\0" + end)``: the file's
content digest (in the TOC) plus the byte range within the file, which determines the bytes
exactly, whatever layer, blob offset or neighbouring files the frame had. The same file in two
layers framed the same way (envbuild's framing cuts at the file's start and every 4 MiB
inside it, so it is) hits the same pieces; a file smaller than a frame is one piece,
``start=0, end=size``. The cache stores decompressed bytes, so a hit costs no decompression.
``MemoryChunkCache`` keeps pieces in memory and evicts the least recently used above
``max_bytes``. (The native filler writes each file into its object once verified, and keeps
no pieces: it reads through ``MemoryChunkCache(0)``.)
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

MiB = 1 << 20
_KEY_TAG = b"envbuild.chunk.v1\0"


def piece_key(file_digest: str, start: int, end: int) -> str:
    """The chunk-cache key of ``file[start:end]`` for a file with content digest
    ``file_digest``."""
    return hashlib.sha256(_KEY_TAG + f"{file_digest}\0{start}\0{end}".encode()).hexdigest()


class MemoryChunkCache:
    """An in-memory LRU of pieces: ``get(key)`` and ``put(key, data)``."""

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
