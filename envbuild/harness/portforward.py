"""A loopback port forward into a sandbox: ``LoopbackForward``.

A client on this host that can only speak TCP to ``HOST:PORT`` (SWE-ReX's ``RemoteRuntime``, a
browser, ``curl``) reaches a server listening inside a sandbox through it: the forward listens
on ``127.0.0.1`` (never another address) on a port the kernel picks, and relays each connection
it accepts to a new socket made by ``connect`` — ``Sandbox.connect_port(port)``, which connects
in the sandbox's own network namespace, so the sandbox needs no network and nothing in it
changes.

Who may connect: any local user of a host can connect to a loopback port, so the forward
relays only connections whose client socket belongs to a user of ``allow_uids`` (default: this
process's uid; the owner is read from ``/proc/net/tcp``, the kernel's table of this network
namespace's sockets); another user's connection is closed before anything is read from it or
sent on. What the forward carries should still authenticate its clients (SWE-ReX's
``X-API-Key`` token, random per deployment): every process of the allowed user can connect.

Bounds: at most ``max_connections`` relayed at once (a connection past them is closed at once,
unread); ``close`` stops accepting, closes every relayed connection and returns when the relay
threads are gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Collection

#: How many connections a forward relays at once by default.
MAX_CONNECTIONS = 64
#: Bytes read from one side before they are written to the other.
CHUNK = 64 << 10
#: Seconds ``close`` waits for each relay thread.
JOIN_TIMEOUT = 5.0

log = logging.getLogger(__name__)


class LoopbackForward:
    """``127.0.0.1:port`` on this host, relayed to ``connect()`` (module docstring).

    ``connect`` makes the far side's socket for each accepted connection (blocking; an
    exception drops that one connection); ``allow_uids``: the users whose connections it
    relays (default: this process's). Start with ``LoopbackForward(connect)``; the listening
    port is ``.port``; ``close`` (or the ``with`` block's end) ends it."""

    def __init__(self, connect: Callable[[], socket.socket], *,
                 max_connections: int = MAX_CONNECTIONS, name: str = "forward",
                 allow_uids: Collection[int] | None = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        self._connect = connect
        self._max = max_connections
        self._uids = frozenset({os.getuid()} if allow_uids is None else allow_uids)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind(("127.0.0.1", 0))
            self._listener.listen(min(max_connections, 128))
        except BaseException:
            self._listener.close()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"{name}-accept-{self.port}")
        self._acceptor.start()

    @property
    def address(self) -> tuple[str, int]:
        """``("127.0.0.1", port)``: where clients connect."""
        return "127.0.0.1", self.port

    @property
    def active(self) -> int:
        """How many connections are being relayed now."""
        with self._lock:
            return sum(1 for t in self._threads if t.is_alive())

    @property
    def closed(self) -> bool:
        return self._closed

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # the listener was closed
            if peer_uid(client) not in self._uids:
                log.warning("forward %d: refused a connection of another user", self.port)
                client.close()
                continue
            with self._lock:
                full = self._closed or sum(1 for t in self._threads if t.is_alive()) >= self._max
                if not full:
                    self._threads = {t for t in self._threads if t.is_alive()}
                    self._open.add(client)
                    relay = threading.Thread(target=self._relay, args=(client,), daemon=True,
                                             name=f"forward-relay-{self.port}")
                    self._threads.add(relay)
            if full:
                client.close()
                continue
            relay.start()

    def _relay(self, client: socket.socket) -> None:
        """Connect the far side, then copy both ways until both are done."""
        far: socket.socket | None = None
        try:
            far = self._connect()
            far.settimeout(None)
            with self._lock:
                if self._closed:
                    return
                self._open.add(far)
            back = threading.Thread(target=_pump, args=(far, client), daemon=True,
                                    name=f"forward-back-{self.port}")
            back.start()
            _pump(client, far)
            back.join()
        except Exception as e:  # noqa: BLE001 - one connection fails, the forward goes on
            log.debug("forward %d: connection dropped: %s", self.port, e)
        finally:
            with self._lock:
                self._open.discard(client)
                if far is not None:
                    self._open.discard(far)
            client.close()
            if far is not None:
                far.close()

    def close(self) -> None:
        """Stop accepting, end every relayed connection, wait for the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets, threads = list(self._open), list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(JOIN_TIMEOUT)
        for thread in threads:
            thread.join(JOIN_TIMEOUT)

    def __enter__(self) -> LoopbackForward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the client end of ``sock``, a TCP connection accepted on an IPv4
    loopback address (``/proc/net/tcp``: the entry whose local address is the client's and
    remote address ours); None when it is not there (the client is already gone)."""
    try:
        client, ours = sock.getpeername()[:2], sock.getsockname()[:2]
    except OSError:
        return None
    local, remote = _proc_address(*client), _proc_address(*ours)
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            # a TIME_WAIT entry of an earlier connection (st 06) is listed with uid 0
            if fields[1] == local and fields[2] == remote and fields[3] != "06":
                return int(fields[7])
    return None


def _proc_address(ip: str, port: int) -> str:
    """``ip:port`` as ``/proc/net/tcp`` writes it: the address as a host-order hex word."""
    word = int.from_bytes(socket.inet_aton(ip), "little")
    return f"{word:08X}:{port:04X}"


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends (EOF or an error), then half-close ``dst``
    so its reader sees the end too."""
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


__all__ = ["LoopbackForward", "MAX_CONNECTIONS", "peer_uid"]
