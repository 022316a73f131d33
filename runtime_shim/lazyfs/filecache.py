"""The node's file cache and fetch limits: whole verified files keyed by content digest, fetched
once per node (single-flight), with a bounded number of store requests in flight and a
bounded wait for each fetch.

``<node>/files/<hex>`` holds the contents of a regular file whose TOC digest is
``sha256:<hex>``, written only after ``LazyLayer`` verified every byte against that digest
(atomically: a temporary name, then ``rename``). Identical files of different layers are one
cache file, fetched once per node. The passthrough mounts (``runtime_shim.lazyfs.passthrough``)
hand these files to the kernel as backing files, so reads of a fetched file never reach user
space. A cache file is re-hashed the first time a daemon process uses it (the node's disk is
trusted only as far as the chunk cache trusts it: checked before use). Files whose frames a
fetch brought are written in the background (``FileCache.preload``) so that their first open
costs a backing open only; a large file is written from a stream of pieces and renamed into
place only once the stream verified it.

``FetchLimits`` is the node's budget for the store: at most ``concurrency`` ranged requests
at a time across every layer and sandbox of the node (``BoundedRanges`` wraps the store each
``LazyLayer`` reads), and at most ``timeout`` seconds for a caller to wait for a fetch — past
that the caller gets ``FetchTimeout`` (the filesystem answers EIO and logs why) while the
fetch itself goes on in the background, bounded by the store client's own timeouts.
Background requests (readahead, prefetch: ``envbuild.store.lazy.background``) wait while
requests a reader waits for are in flight, for at most ``BACKGROUND_YIELD`` seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from envbuild.errors import RuntimeShimError
from envbuild.oci import DIGEST_RE

log = logging.getLogger("envbuild.lazyfs")

#: Default number of store requests a node has in flight at once (all layers, all sandboxes).
DEFAULT_FETCH_CONCURRENCY = 16
#: Default seconds a read (or passthrough open) waits for the store before it fails with EIO.
DEFAULT_FETCH_TIMEOUT = 30.0
#: Files waiting to be written to the file cache in the background (``FileCache.preload``).
PRELOAD_QUEUE = 512
#: Longest a background request waits for reads in flight before it goes anyway (seconds).
BACKGROUND_YIELD = 0.02
#: A content digest, as TOCs write it; its hex part names the cache file. Only this one form:
#: ``cached`` verifies against ``sha256:<hex>`` and ``present`` looks that form up, so a bare
#: hex digest accepted here would see a good cache file as corrupt and remove it.
#: The file cache format (the directory layout above); a daemon ignores other versions.
FILE_CACHE_VERSION = 1


class FetchTimeout(RuntimeShimError):
    """A fetch did not finish within ``FetchLimits.timeout`` (the store is slow or gone)."""


@dataclasses.dataclass(frozen=True)
class FetchSettings:
    """How much of the store a node may use at once, and how long a reader waits."""

    concurrency: int = DEFAULT_FETCH_CONCURRENCY
    timeout: float = DEFAULT_FETCH_TIMEOUT

    @classmethod
    def from_env(cls, concurrency: int | None = None,
                 timeout: float | None = None) -> FetchSettings:
        """Explicit values, else ``$ENVBUILD_LAZY_FETCH_CONCURRENCY`` /
        ``$ENVBUILD_LAZY_FETCH_TIMEOUT``, else the defaults."""
        def env(name: str, cast: Callable[[str], Any], default: Any) -> Any:
            raw = os.environ.get(name)
            if not raw:
                return default
            try:
                return cast(raw)
            except ValueError:
                raise RuntimeShimError(f"${name}={raw!r} is not a number",
                                       hint=f"unset it or give e.g. {default}") from None
        c = concurrency if concurrency is not None else env(
            "ENVBUILD_LAZY_FETCH_CONCURRENCY", int, DEFAULT_FETCH_CONCURRENCY)
        t = timeout if timeout is not None else env(
            "ENVBUILD_LAZY_FETCH_TIMEOUT", float, DEFAULT_FETCH_TIMEOUT)
        if c < 1 or t <= 0:
            raise RuntimeShimError(f"lazy fetch concurrency {c} / timeout {t} out of range",
                                   hint="concurrency >= 1, timeout > 0 seconds")
        return cls(int(c), float(t))


class FetchLimits:
    """The node's store budget (see the module docstring): a semaphore of ``concurrency``
    requests and a pool that runs fetches whose callers wait at most ``timeout`` seconds."""

    def __init__(self, settings: FetchSettings) -> None:
        self.settings = settings
        self.requests = threading.BoundedSemaphore(settings.concurrency)
        self.pool = ThreadPoolExecutor(max(4, settings.concurrency),
                                       thread_name_prefix="lazy-fetch")
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0  # the most requests seen at once (a measure, for tests)
        self._cv = threading.Condition()
        self.demand = 0          # requests in flight that a reader waits for
        # what readers waited for a free slot (seconds in all, and the longest): a measure of
        # background requests holding the budget when a reader needs it
        self.slot_wait = {"foreground_s": 0.0, "foreground_max_s": 0.0, "foreground_n": 0}

    def bounded(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` run in the pool; its result, or ``FetchTimeout`` after ``timeout`` s."""
        fut = self.pool.submit(fn)
        return wait_for(fut, what, self.settings.timeout)

    def request(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (one store request) within the node's concurrency bound. A background
        request (``envbuild.store.lazy.background``: readahead, prefetch) first waits while
        reads a reader waits for are in flight, for at most ``BACKGROUND_YIELD`` seconds (so
        a reader waiting for frames a background fetch has claimed is not starved): on a
        shared link the reader's bytes then arrive without sharing it with guesses."""
        from envbuild.store.lazy import is_background

        if is_background():
            with self._cv:
                if self.demand:
                    self._cv.wait_for(lambda: not self.demand, BACKGROUND_YIELD)
            return self._request(fn)
        with self._cv:
            self.demand += 1
        try:
            return self._request(fn, foreground=True)
        finally:
            with self._cv:
                self.demand -= 1
                if not self.demand:
                    self._cv.notify_all()

    def _request(self, fn: Callable[[], Any], *, foreground: bool = False) -> Any:
        t0 = time.monotonic() if foreground else 0.0
        with self.requests:
            with self._lock:
                if foreground:
                    waited = time.monotonic() - t0
                    w = self.slot_wait
                    w["foreground_s"] += waited
                    w["foreground_max_s"] = max(w["foreground_max_s"], waited)
                    w["foreground_n"] += 1
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return fn()
            finally:
                with self._lock:
                    self.in_flight -= 1


def wait_for(fut: Future, what: str, timeout: float) -> Any:
    import concurrent.futures

    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        raise FetchTimeout(f"{what}: the store did not answer within {timeout:g} s",
                           hint="the store is unreachable or slow; "
                                "$ENVBUILD_LAZY_FETCH_TIMEOUT sets the limit") from None


class BoundedRanges:
    """A ``RangeReader`` (and ``TailReader`` when the wrapped store is one) whose ranged reads
    take a slot of the node's ``FetchLimits`` first: every layer of the node shares one budget."""

    def __init__(self, store: Any, limits: FetchLimits) -> None:
        self._store, self._limits = store, limits
        if hasattr(store, "get_tail"):
            self.get_tail = lambda digest, n: limits.request(lambda: store.get_tail(digest, n))

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        return self._limits.request(lambda: self._store.get_range(digest, offset, length))

    def stat(self, digest: str) -> Any:
        return self._limits.request(lambda: self._store.stat(digest))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class FileCache:
    """``<directory>/<hex>``: verified whole files by content digest (module docstring);
    ``path(digest, fetch)`` returns the cache file, fetching it once per node however many
    callers ask at once (single-flight), each caller waiting at most the limits' timeout.
    ``max_bytes``: files beyond it are evicted oldest first (a file still open stays readable:
    an unlinked inode lives on)."""

    def __init__(self, directory: str, limits: FetchLimits, max_bytes: int) -> None:
        self.dir = directory
        self.limits = limits
        self.max_bytes = max_bytes
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._flights: dict[str, Future] = {}
        self._verified: set[str] = set()
        self.fetches = 0  # files fetched from the store by this process (not from the cache)
        # bounded: a writer that falls behind (a busy host) drops the oldest, which an open
        # then writes itself, instead of spending ever more CPU on files nobody opened yet
        self._preloads: collections.deque[tuple[str, Callable[[], bytes], str]] = \
            collections.deque(maxlen=PRELOAD_QUEUE)
        self._preload_cv = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        # what earlier processes left here (by hex name): on the node, to be hashed at first
        # use; ``present`` answers from it and ``_verified`` without a system call
        self._on_disk: set[str] = set()
        self._total = 0
        for e in os.scandir(directory):
            if e.is_file() and not e.name.startswith("."):
                self._on_disk.add(e.name)
                self._total += e.stat().st_size

    def _file(self, digest: str) -> str:
        # one regular expression, not a generator over 64 characters: every open and every
        # predicted file asks
        m = DIGEST_RE.fullmatch(digest)
        if m is None:
            raise RuntimeShimError(f"bad content digest {digest!r} in a TOC")
        return os.path.join(self.dir, m[1])

    def verified(self) -> frozenset[str]:
        """The digests whose cache files this process verified (fetched, or hashed on first
        use) and has not evicted: what ``runtime_shim.lazyfs.metalayer`` may point at."""
        with self._lock:
            return frozenset(self._verified)

    def fetching(self) -> int:
        """How many files are being fetched right now (flights in progress)."""
        with self._lock:
            return len(self._flights)

    def present(self, digest: str) -> bool:
        """Whether ``digest``'s cache file is here: verified by this process, or left by an
        earlier one (to be hashed at its first use). Two set lookups, no system call: the
        guesses ask it of every candidate (a ``stat`` each cost the cold_start workload
        0.5 s of daemon CPU)."""
        return digest in self._verified or (   # DIGEST_RE's one form
            digest.startswith("sha256:") and digest[7:] in self._on_disk)

    def cached(self, digest: str) -> str | None:
        """The cache file of ``digest`` if present and verified (hashing it on first use)."""
        path = self._file(digest)
        if digest in self._verified:
            return path
        try:
            with open(path, "rb", buffering=0) as f:
                h = hashlib.sha256()
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except FileNotFoundError:
            self._on_disk.discard(os.path.basename(path))
            return None
        if "sha256:" + h.hexdigest() != digest:
            log.warning("file cache %s does not match its digest: removed", path)
            _unlink(path)
            self._on_disk.discard(os.path.basename(path))
            return None
        with self._lock:
            self._verified.add(digest)
        return path

    def path(self, digest: str, fetch: Callable[[], bytes | Iterable[bytes]], what: str, *,
             inline: bool = False) -> str:
        """The verified cache file of ``digest``; ``fetch()`` (returning the verified contents,
        or an iterator of its pieces in order that raises if they do not verify: written as
        they come, put in place only once it finished) runs once for all concurrent callers.
        ``FetchTimeout`` after the limits' timeout.
        ``inline``: the caller knows ``fetch`` needs no store request (the bytes are in the
        chunk cache), so the first caller runs it itself instead of in the pool (no thread
        hop: a tree of small files read through readahead'd frames)."""
        if digest in self._verified:
            return self._file(digest)
        with self._lock:
            fut = self._flights.get(digest)
            mine = fut is None
            if mine:
                fut = self._flights[digest] = Future()
        assert fut is not None
        if mine:
            if inline:
                self._fly(digest, fetch, fut)
            else:
                self.limits.pool.submit(self._fly, digest, fetch, fut)
        return wait_for(fut, what, self.limits.settings.timeout)

    def preload(self, digest: str, fetch: Callable[[], bytes], what: str) -> None:
        """Write ``digest``'s cache file soon, in a background thread, when it is not there:
        ``fetch()`` must need no store request (the bytes are in the chunk cache), as after
        a window of frames arrived. A reader that opens the file first writes it itself
        (single-flight as ``path``); a failure is only logged."""
        with self._lock:
            if digest in self._verified or digest in self._flights:
                return
            self._preloads.append((digest, fetch, what))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_preloads, daemon=True,
                                                name="lazy-files-writer")
                self._writer.start()
            self._preload_cv.notify()

    def _write_preloads(self) -> None:
        while True:
            with self._lock:
                while not self._preloads:
                    self._preload_cv.wait()
                digest, fetch, what = self._preloads.popleft()
            if digest in self._verified:
                continue
            try:
                self.path(digest, fetch, what, inline=True)
            except Exception as e:  # noqa: BLE001 - a reader's open fetches it again
                log.debug("preload %s: %s", what, e)

    def _fly(self, digest: str, fetch: Callable[[], bytes | Iterable[bytes]],
             fut: Future) -> None:
        try:
            path = self.cached(digest)
            if path is None:
                got = fetch()
                path = self._file(digest)
                tmp = os.path.join(self.dir, f".{uuid.uuid4().hex}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400)
                size = 0
                try:
                    # bytes, or pieces in order (LazyLayer.stream): written as they come,
                    # renamed into place only once the iterator finished (verified)
                    for piece in ((got,) if isinstance(got, (bytes, bytearray, memoryview))
                                  else got):
                        view = memoryview(piece)
                        size += len(view)
                        while view:
                            view = view[os.write(fd, view):]
                except BaseException:
                    os.close(fd)
                    _unlink(tmp)
                    raise
                os.close(fd)
                os.rename(tmp, path)
                with self._lock:
                    self._verified.add(digest)
                    self.fetches += 1
                    self._total += size
                self._evict()
            fut.set_result(path)
        except BaseException as e:  # noqa: BLE001 - handed to every waiter
            fut.set_exception(e)
        finally:
            with self._lock:
                self._flights.pop(digest, None)

    def _evict(self) -> None:
        if self._total <= self.max_bytes:
            return
        files = []
        for e in os.scandir(self.dir):
            if e.is_file() and not e.name.startswith("."):
                st = e.stat()
                files.append((st.st_atime, st.st_size, e.path, e.name))
        files.sort()
        with self._lock:
            for _, size, path, name in files:
                if self._total <= self.max_bytes * 0.9:
                    break
                _unlink(path)
                self._verified.discard("sha256:" + name)
                self._on_disk.discard(name)
                self._total -= size


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


__all__ = ["BoundedRanges", "DEFAULT_FETCH_CONCURRENCY", "DEFAULT_FETCH_TIMEOUT",
           "FILE_CACHE_VERSION", "FetchLimits", "FetchSettings", "FetchTimeout", "FileCache"]
