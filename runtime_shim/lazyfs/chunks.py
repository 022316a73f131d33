"""The daemon's chunk cache: an in-memory LRU in front of the node's disk ``ChunkCache``."""

from __future__ import annotations

import logging
import threading
from typing import Any

from envbuild.errors import EnvbuildError
from envbuild.store.lazy import MemoryChunkCache

log = logging.getLogger("envbuild.lazyfs")


class TieredChunkCache:
    """An in-memory LRU of pieces in front of the node's disk ``ChunkCache``: a disk hit is
    promoted, a put goes to both (same interface as ``ChunkCache``). Disk writes (a file and
    a sha256 trailer per piece: a third of a prefetch's CPU) are done by a background thread,
    off the path of the read that fetched the piece; the memory tier holds it meanwhile."""

    def __init__(self, memory: MemoryChunkCache, disk: Any) -> None:
        import queue

        self.memory = memory
        self.disk = disk
        self._queue: queue.Queue[tuple[str, bytes]] = queue.Queue(maxsize=4096)
        if disk is not None:
            threading.Thread(target=self._write_behind, name="chunk-cache-writer",
                             daemon=True).start()

    def get(self, key: str) -> bytes | None:
        data = self.memory.get(key)
        if data is None and self.disk is not None:
            data = self.disk.get(key)
            if data is not None:
                self.memory.put(key, data)
        return data

    def put(self, key: str, data: bytes) -> None:
        import queue

        self.memory.put(key, data)
        if self.disk is not None:
            try:
                self._queue.put_nowait((key, data))
            except queue.Full:  # writes fall behind: write this one here
                self._put_disk(key, data)

    def _put_disk(self, key: str, data: bytes) -> None:
        try:
            self.disk.put(key, data)
        except (OSError, EnvbuildError) as e:  # a cache: the piece is refetched if needed
            log.warning("chunk cache write: %s", e)

    def _write_behind(self) -> None:
        while True:
            key, data = self._queue.get()
            self._put_disk(key, data)

