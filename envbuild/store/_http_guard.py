"""Bounds for talking HTTP to a server that may be hostile (``RegistryStore``).

What a registry sends is untrusted input; these are the rules it cannot break (issue 34):

* **Every body is read with a limit** (``read_body``): a declared ``Content-Length`` over it is
  refused before a byte is read, and an undeclared body is cut off one byte past it.
* **Every request has an overall deadline** (``Watchdog``): one thread shuts down the socket of
  a request still running at its deadline, whatever it is blocked on (the connect, the
  headers, a body arriving one byte at a time), so no server holds a client forever.
* **Connections that leave the registry go to public addresses only** (``guarded_connect``):
  a redirect target or token realm is resolved, every address it resolves to is checked, and
  the connection is made to the checked address, never by name again (no DNS rebinding
  between check and connect). Loopback, private, CGNAT, link-local, ULA and unspecified
  addresses are refused unless the registry itself resolves to that address (a registry on
  127.0.0.1 may send a client to 127.0.0.1). The refusal happens before any connect.
"""

from __future__ import annotations

import heapq
import http.client
import ipaddress
import itertools
import socket
import threading
import time
from collections.abc import Callable, Collection

#: How much is read from the socket at once while a body is bounded.
READ_STEP = 64 << 10


class BodyTooLarge(Exception):
    """A response body over the caller's limit (``declared``: the Content-Length said so)."""

    def __init__(self, limit: int, declared: int | None) -> None:
        super().__init__(limit, declared)
        self.limit, self.declared = limit, declared


def read_body(raw: http.client.HTTPResponse, limit: int) -> bytes:
    """The whole body of ``raw``, at most ``limit`` bytes, else ``BodyTooLarge`` (the caller
    must then close the connection: the rest of the body is still on it)."""
    if raw.length is not None and raw.length > limit:
        raise BodyTooLarge(limit, raw.length)
    data = bytearray()
    while True:
        chunk = raw.read(min(READ_STEP, limit + 1 - len(data)))
        if not chunk:
            if raw.length:  # (what is left of a Content-Length): the body broke off
                raise http.client.IncompleteRead(bytes(data), raw.length)
            return bytes(data)
        data += chunk
        if len(data) > limit:
            raise BodyTooLarge(limit, None)


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def public(address: str) -> bool:
    """Whether ``address`` (an IP literal) is a public unicast address."""
    ip = _ip(address)
    return ip.is_global and not ip.is_multicast


def resolve(host: str, port: int) -> list[tuple[int, str]]:
    """``(family, address)`` of every address ``host`` resolves to (TCP)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [(family, str(sockaddr[0])) for family, _, _, _, sockaddr in infos]


class AddressRefused(OSError):
    """A connection to a non-public address the registry is not at."""


def guarded_connect(allowed: Collection[str]) -> Callable[..., socket.socket]:
    """A ``socket.create_connection`` that connects only to public addresses or to one of
    ``allowed`` (the registry's own addresses), checking every address before connecting."""
    allowed_ips = {_ip(a) for a in allowed}

    def connect(address: tuple[str, int], timeout: float | None = None,
                source_address: object = None) -> socket.socket:
        host, port = address
        addrs = resolve(host, port)
        bad = [a for _, a in addrs if not public(a) and _ip(a) not in allowed_ips]
        if bad or not addrs:
            raise AddressRefused(f"{host} resolves to {bad[0] if bad else 'nothing'}, "
                                 "a non-public address the registry is not at")
        last: OSError | None = None
        for family, addr in addrs:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect((addr, port))
                return sock
            except OSError as e:
                sock.close()
                last = e
        assert last is not None
        raise last

    return connect


class Watchdog:
    """Shuts down a connection's socket when its deadline passes; one daemon thread for every
    request of the process. ``arm`` returns a token for ``disarm``, which says whether the
    deadline was still ahead: once it returns, the socket is not touched again; when it says
    False the connection was shut down and must not be reused."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, http.client.HTTPConnection] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, conn: http.client.HTTPConnection) -> int:
        with self._cond:
            token = next(self._ids)
            self._live[token] = conn
            heapq.heappush(self._heap, (deadline, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="envbuild-http-deadline",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
            return token

    def disarm(self, token: int) -> bool:
        with self._cond:
            return self._live.pop(token, None) is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][1] not in self._live:
                        heapq.heappop(self._heap)
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                _, token = heapq.heappop(self._heap)
                sock = self._live.pop(token).sock
                if sock is not None:  # (under the lock: a disarm that returned is final)
                    try:  # the plain socket's shutdown, also under TLS: the SSL object is untouched
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)
                    except OSError:
                        pass


WATCHDOG = Watchdog()
