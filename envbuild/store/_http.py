"""Ranged GETs over keep-alive HTTP: the one client of ``S3Store.get_range`` and the lazy filler.

Lazy layer reads are many small ranged GETs, so the per-request cost of the client decides
their speed: boto3 spends ~2.4 ms of CPU per request, plain ``http.client`` ~0.5 ms
(MACHINE-NOTES). ``S3Store`` therefore sends its ranged reads to a presigned URL of the object
(the signature covers the host, not the ``Range`` header, so one URL serves every range of a
blob), and the lazy layer daemon reads with the presigned URL its client handed it
(``envbuild.store.lazy.HttpRanges``) without loading boto3 at all. Both go through
``RangeClient``.

What ``RangeClient.get(url, offset, length)`` does:

* **Connections**: keep-alive HTTP/1.1 connections per ``(scheme, host:port)``, each used by
  one request at a time (``http.client`` connections are not thread-safe; a thread per
  in-flight request is how callers parallelise): a request takes the most recently used idle
  one or opens a new one, and gives it back when its answer was read to the end (at most
  ``MAX_IDLE`` kept). So the client opens about as many connections as it has requests in
  flight at once, not one per thread that ever asked (the removed FUSE daemon's many pools: 104
  connects for 257 requests of one workload when they were per thread). A connection is
  closed after any error, after a response that says ``Connection: close``, and after a body
  it did not read to the end.
* **Timeouts**: ``connect_timeout`` for the TCP (and TLS) handshake, then ``read_timeout`` for
  every socket read.
* **Retries**: connection errors, timeouts and the transient statuses ``RETRY_STATUSES`` (429,
  500, 502, 503, 504) are retried, at most ``attempts`` tries in all, sleeping
  ``Backoff.delay(n)`` before try *n* (full jitter, exponential, capped): an unreachable server
  costs a bounded time. Every other status is final and returned at once.
* **Bounded responses**: a ``206`` may carry at most ``length`` bytes (a longer body, or a
  ``Content-Length`` saying so, is refused without being read); a ``200`` (a server that
  ignores ``Range`` sends the whole object) is read only up to ``offset + length`` bytes and
  then dropped with its connection; an error body is read up to ``ERROR_BODY_LIMIT`` bytes.
  No response makes the client allocate more than the range it asked for.

The result is a ``RangeResponse``: ``status`` 206 or 200 with ``body`` exactly the bytes of the
range (short only where the object ends), another HTTP status with the start of the error
body, or ``status == 0`` when every try failed, with ``error`` saying why. Mapping statuses to
store errors (404 → ``BlobNotFound``, 403 → ``StoreUnavailable``) is the caller's: the S3
store raises, the lazy filler hands the read to the full store instead.
"""

from __future__ import annotations

import dataclasses
import http.client
import random
import socket
import threading
import time
import urllib.parse
from typing import Final, cast

#: Statuses worth another try: throttling and the server-side transients S3 documents.
RETRY_STATUSES: Final = frozenset({429, 500, 502, 503, 504})
#: How much of a non-2xx body is kept (for the error message).
ERROR_BODY_LIMIT: Final = 4096


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Sleep before retry ``n`` (1, 2, ...): uniform in ``[0, min(cap, base * 2**n)]``."""

    base: float = 0.25
    cap: float = 10.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap, self.base * 2 ** attempt))


@dataclasses.dataclass(frozen=True)
class RangeResponse:
    """The answer to a ranged GET (see the module docstring)."""

    status: int     # 206, 200, another HTTP status, or 0: no answer after every try
    body: bytes     # 2xx: the range's bytes; otherwise the start of the error body
    error: str = ""  # status 0: why the last try failed

    @property
    def ok(self) -> bool:
        return self.status in (200, 206)


#: What a request on a kept-alive connection the server has closed fails with.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class _TooLong(Exception):
    """A response body longer than the range asked for (a broken or hostile server)."""


#: Idle keep-alive connections a ``RangeClient`` keeps per ``(scheme, host:port)``.
MAX_IDLE = 32


class RangeClient:
    """Ranged GETs with shared keep-alive connections, bounded retries and bounded bodies.

    Thread-safe: a connection serves one request at a time (module docstring). ``close()``
    closes the idle connections; those in use close when their request ends.
    """

    def __init__(self, *, attempts: int = 4, connect_timeout: float = 3.0,
                 read_timeout: float = 30.0, backoff: Backoff = Backoff()) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.attempts = attempts
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.backoff = backoff
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
        self._idle_lock = threading.Lock()
        #: new connections opened (for tests and benchmarks)
        self.connects = 0
        #: GETs sent (every try counts): for tests and benchmarks.
        self.requests = 0
        self._count_lock = threading.Lock()

    def _take(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        """An idle connection to ``netloc`` (the most recently used: the likeliest to be
        still open), or a new, unconnected one."""
        with self._idle_lock:
            idle = self._idle.get((scheme, netloc))
            if idle:
                return idle.pop()
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        return cls(netloc, timeout=self.connect_timeout)

    def _give_back(self, scheme: str, netloc: str, conn: http.client.HTTPConnection) -> None:
        if conn.sock is None:
            return
        with self._idle_lock:
            idle = self._idle.setdefault((scheme, netloc), [])
            if len(idle) < MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def _drop_idle(self, scheme: str, netloc: str) -> None:
        """Close the idle connections to ``netloc``."""
        with self._idle_lock:
            conns = self._idle.pop((scheme, netloc), [])
        for conn in conns:
            conn.close()

    def close(self) -> None:
        """Close the idle connections."""
        with self._idle_lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()

    def get(self, url: str, offset: int, length: int) -> RangeResponse:
        """GET bytes ``[offset, offset + length)`` of ``url`` (``length`` > 0)."""
        if offset < 0 or length <= 0:
            raise ValueError(f"bad range: offset {offset}, length {length}")
        parts = urllib.parse.urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        last = ""
        attempt = 0
        stale_retried = again = False
        while attempt < self.attempts:
            if attempt and not again:
                time.sleep(self.backoff.delay(attempt))
            again = False
            conn = self._take(parts.scheme, parts.netloc)
            reused = conn.sock is not None
            with self._count_lock:
                self.requests += 1
                self.connects += not reused
            try:
                if not reused:
                    conn.connect()
                    cast(socket.socket, conn.sock).settimeout(self.read_timeout)
                conn.request("GET", target, headers=headers)
                resp = conn.getresponse()
                status, body, reusable = self._read(resp, offset, length)
            except _TooLong as e:
                conn.close()
                return RangeResponse(502, b"", error=str(e))  # final: retrying gets the same
            except (TimeoutError, OSError, http.client.HTTPException) as e:
                conn.close()
                last = f"{type(e).__name__}: {e}"
                if reused and not stale_retried and isinstance(e, _STALE):
                    # a keep-alive connection the server closed while it was idle (servers
                    # do after a few seconds): once more at once on a new one, not a try;
                    # its idle siblings went stale with it (each was a backoff sleep: 4.3 s
                    # of a create after 5 s of quiet, with five reads' connections idle)
                    self._drop_idle(parts.scheme, parts.netloc)
                    stale_retried = again = True
                    continue
                attempt += 1
                continue
            except BaseException:   # taken from the idle list: never handed back half-used
                conn.close()
                raise
            if not reusable or (resp.getheader("Connection") or "").lower() == "close":
                conn.close()
            else:
                self._give_back(parts.scheme, parts.netloc, conn)
            if status in RETRY_STATUSES:
                last = f"HTTP {status}"
                attempt += 1
                continue
            return RangeResponse(status, body)
        return RangeResponse(0, b"", error=f"{last} (after {self.attempts} attempts)")

    @staticmethod
    def _read(resp: http.client.HTTPResponse, offset: int,
              length: int) -> tuple[int, bytes, bool]:
        """``(status, body, connection reusable)``, reading no more than the range allows."""
        declared = resp.getheader("Content-Length")
        size = int(declared) if declared and declared.isdigit() else None
        if resp.status == 206:
            if size is not None and size > length:
                raise _TooLong(f"the server answered a {length}-byte range with {size} bytes")
            body = resp.read(length + 1)
            if len(body) > length:
                raise _TooLong(f"the server answered a {length}-byte range with more bytes")
            return 206, body, resp.isclosed()
        if resp.status == 200:  # Range ignored: the object from its start; keep what we need
            want = offset + length
            body = resp.read(want)
            done = resp.isclosed() or (size is not None and size <= want)
            return 200, body[offset:], done
        body = resp.read(ERROR_BODY_LIMIT)
        return resp.status, body, resp.isclosed()


def put_bytes(url: str, data: bytes, *, attempts: int = 3, timeout: float = 10.0,
              backoff: Backoff = Backoff()) -> RangeResponse:
    """A plain ``PUT`` of ``data`` to ``url`` (a presigned record URL: ``Presigner``), on a
    connection of its own, retried on connection errors and ``RETRY_STATUSES`` at most
    ``attempts`` times; ``status`` 0 and ``error`` when no answer came. The answer's body is
    read up to 64 KiB (an error document) and dropped."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return RangeResponse(0, b"", error=f"not an http(s) URL: {url[:60]!r}")
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    last = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(backoff.delay(attempt))
        conn = cls(parts.netloc, timeout=timeout)
        try:
            conn.request("PUT", target, body=data,
                         headers={"Content-Length": str(len(data))})
            resp = conn.getresponse()
            resp.read(64 << 10)
            status = resp.status
        except (TimeoutError, OSError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}"
            continue
        finally:
            conn.close()
        if status in RETRY_STATUSES:
            last = f"HTTP {status}"
            continue
        return RangeResponse(status, b"")
    return RangeResponse(0, b"", error=f"{last} (after {attempts} attempts)")
