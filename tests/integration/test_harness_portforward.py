"""``envbuild.harness.portforward.LoopbackForward`` against an in-process echo server on
127.0.0.1 (the far side ``connect`` reaches; in a deployment it is ``Sandbox.connect_port``):
both directions with half-close, the connection bound, ``close`` ending live connections, a
failing ``connect`` dropping only its own connection. Integration tier: unit tests open no
socket."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest

from envbuild.harness.portforward import LoopbackForward
from tests.conftest import require_root
from tests.waiting import wait_for

#: A client run as another user: connects, sends one byte, prints what it reads back (the
#: system's python: the venv's may be under a directory that user cannot enter).
CLIENT = """\
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
try:
    s.sendall(b"z")
    print(repr(s.recv(1)))
except ConnectionResetError:  # closed unread after what it sent: a reset
    print("reset")
"""
NOBODY = 65534


def client_as(uid: int, port: int) -> str:
    out = subprocess.run(["/usr/bin/python3", "-I", "-c", CLIENT, str(port)], user=uid,
                         group=uid, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip()


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """An echo server on 127.0.0.1 (upper-cases what it reads, then half-closes at EOF)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data.upper())
            conn.shutdown(socket.SHUT_WR)

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    yield server.getsockname()
    stop.set()
    server.close()


def test_relays_both_ways_on_the_loopback(echo):
    with LoopbackForward(lambda: socket.create_connection(echo)) as fwd:
        assert fwd.address[0] == "127.0.0.1"
        with socket.create_connection(fwd.address, timeout=5) as c:
            c.sendall(b"hello " * 50_000)
            c.shutdown(socket.SHUT_WR)  # the server sees EOF through the forward
            got = b""
            while data := c.recv(65536):
                got += data
        assert got == b"HELLO " * 50_000
        wait_for(lambda: fwd.active == 0)


def test_connections_past_the_bound_are_closed_unread(echo):
    with LoopbackForward(lambda: socket.create_connection(echo), max_connections=2) as fwd:
        held = [socket.create_connection(fwd.address, timeout=5) for _ in range(2)]
        wait_for(lambda: fwd.active == 2)
        with socket.create_connection(fwd.address, timeout=5) as extra:
            assert extra.recv(1) == b""
        held.pop().close()
        wait_for(lambda: fwd.active == 1)
        with socket.create_connection(fwd.address, timeout=5) as again:
            again.sendall(b"x")
            assert again.recv(1) == b"X"
        held[0].close()


def test_close_ends_live_connections_and_the_listener(echo):
    fwd = LoopbackForward(lambda: socket.create_connection(echo))
    live = socket.create_connection(fwd.address, timeout=5)
    live.sendall(b"a")
    assert live.recv(1) == b"A"
    fwd.close()
    assert fwd.closed and fwd.active == 0
    assert live.recv(1) == b""
    live.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(fwd.address, timeout=5)
    fwd.close()  # idempotent


def test_a_failing_connect_drops_only_its_connection(echo):
    calls = []

    def connect() -> socket.socket:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionRefusedError("nothing listens")
        return socket.create_connection(echo)

    with LoopbackForward(connect) as fwd:
        with socket.create_connection(fwd.address, timeout=5) as first:
            assert first.recv(1) == b""
        with socket.create_connection(fwd.address, timeout=5) as second:
            second.sendall(b"b")
            assert second.recv(1) == b"B"


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        LoopbackForward(lambda: socket.socket(), max_connections=0)


def test_only_the_allowed_users_connections_are_relayed(echo):
    require_root()
    with LoopbackForward(lambda: socket.create_connection(echo)) as fwd:  # root's only
        assert client_as(NOBODY, fwd.port) in ("b''", "reset")  # closed, nothing relayed
        with socket.create_connection(fwd.address, timeout=5) as mine:
            mine.sendall(b"m")
            assert mine.recv(1) == b"M"
    with LoopbackForward(lambda: socket.create_connection(echo), allow_uids={NOBODY}) as fwd:
        assert client_as(NOBODY, fwd.port) == "b'Z'"
        with socket.create_connection(fwd.address, timeout=5) as mine:
            assert mine.recv(1) == b""  # root is not in this forward's list
