"""Where lazy layer reads go (``envbuild.store.lazy``): ``HttpRanges``, ranged reads of one
blob over plain HTTP to a presigned URL (the lazy filler's store, without boto3), and the
process-wide thread pools for parallel reads, with reads marked as ``background`` work
(readahead, prefetch) kept apart from the reads a reader waits for."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator

from envbuild.store._http import Backoff, RangeClient
from envbuild.store.base import BlobInfo, RangeReader

_priority = threading.local()


@contextlib.contextmanager
def background() -> Iterator[None]:
    """Mark the store requests this thread makes (and the parallel reads they start) as
    background work (readahead, prefetch): a node's ``FetchLimits`` lets reads a reader
    waits for go first."""
    prev = getattr(_priority, "background", False)
    _priority.background = True
    try:
        yield
    finally:
        _priority.background = prev


def is_background() -> bool:
    """Whether this thread's store requests are background work (``background``)."""
    return getattr(_priority, "background", False)


#: Threads of the process-wide pools that send one ranged read each for a ``LazyLayer``
#: (``_fetch_frames``, ``stream``); a node's store budget (``FetchLimits``) bounds the
#: requests in flight anyway.
LEAF_WORKERS = 16
_leaf_pools: dict[bool, concurrent.futures.ThreadPoolExecutor] = {}
_leaf_lock = threading.Lock()


def _leaf_pool(bg: bool) -> concurrent.futures.ThreadPoolExecutor:
    """The pool for parallel reads: one for a reader's, one for background work (``bg``:
    ``is_background`` of the caller), so a reader's reads never queue behind readahead.
    Kept for the process: a pool per call started new threads for every call. Its tasks are
    leaves (one request each, never waiting for another task), so sharing the threads cannot
    deadlock."""
    with _leaf_lock:
        pool = _leaf_pools.get(bg)
        if pool is None:
            pool = _leaf_pools[bg] = concurrent.futures.ThreadPoolExecutor(
                LEAF_WORKERS, thread_name_prefix="lazy-get-bg" if bg else "lazy-get")
        return pool


_clients: dict[tuple[int, float], RangeClient] = {}
_clients_lock = threading.Lock()


def _range_client(attempts: int, timeout: float) -> RangeClient:
    """The process's ``RangeClient`` for these settings, shared by every layer's
    ``HttpRanges``: the layers of a stack live on one store server, so their reads share its
    keep-alive connections (a client per layer opened one per layer and thread)."""
    with _clients_lock:
        client = _clients.get((attempts, timeout))
        if client is None:
            client = _clients[(attempts, timeout)] = RangeClient(
                attempts=attempts, connect_timeout=timeout, read_timeout=timeout,
                backoff=Backoff(0.05, 2.0))
        return client


class HttpRanges(RangeReader):
    """Ranged reads of one blob over plain keep-alive HTTP to a presigned GET URL: the store of
    a process that should not load boto3 to read (the lazy layer daemon: boto3 costs it ~0.3 s
    of start-up and ~2.4 ms of CPU per request, ``http.client`` ~0.5 ms).

    A ``RangeReader``. Only ``get_range`` of ``digest`` goes over the URL, through the shared
    ``envbuild.store._http.RangeClient`` (shared keep-alive connections, ``attempts`` tries
    on connection errors and 5xx with bounded backoff, bodies bounded by the range);
    everything else, any range once the URL is within a minute of its expiry (``X-Amz-Date`` +
    ``X-Amz-Expires``) or refused (403), and any answer that is not the bytes (404, 416, no
    answer) goes to ``fallback()``, the full store, opened on first need, so errors are the
    store's own."""

    def __init__(self, digest: str, url: str, fallback: Callable[[], RangeReader], *,
                 attempts: int = 4, timeout: float = 30.0) -> None:
        import urllib.parse

        self.digest = digest
        self.url = url
        self.client = _range_client(attempts, timeout)
        self._fallback = fallback
        self._store: RangeReader | None = None
        self.expires = float("inf")
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
        try:
            import calendar
            import time

            signed = calendar.timegm(time.strptime(q["X-Amz-Date"][0], "%Y%m%dT%H%M%SZ"))
            self.expires = signed + int(q["X-Amz-Expires"][0]) - 60
        except (KeyError, ValueError, IndexError):
            pass

    def store(self) -> RangeReader:
        if self._store is None:
            with _fallback_lock:
                if self._store is None:
                    self._store = self._fallback()
        return self._store

    def stat(self, digest: str) -> BlobInfo:
        return self.store().stat(digest)

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        import time

        if digest != self.digest or length <= 0 or self._store is not None \
                or time.time() >= self.expires:
            return self.store().get_range(digest, offset, length)
        resp = self.client.get(self.url, offset, length)
        if resp.ok:
            return resp.body
        # 403 (expired, refused), 404, 416, or no answer: the store says what it means
        return self.store().get_range(digest, offset, length)


_fallback_lock = threading.Lock()
