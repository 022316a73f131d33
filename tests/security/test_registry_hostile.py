"""Issue 34 item 7, a hostile registry: ``RegistryStore`` against a real HTTP server on
127.0.0.1 that answers the way an attacker's registry would -- endless or huge bodies, endless
``tags/list`` pages, one byte every half second, redirects to other hosts.

Each operation runs in a thread the test waits for with a timeout: a client held forever fails
the test instead of hanging it. No test sends a packet anywhere but 127.0.0.1: a redirect to a
non-public address must be refused before any connect (the one test with a private address
names it as a configured blob host, so the old client -- which had no such setting -- could not
connect to it either).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

import pytest

from envbuild.errors import StoreError, StoreUnavailable
from envbuild.store.registry import MAX_RESPONSE, MAX_TAG_PAGES, RegistryStore

MiB = 1 << 20
DIGEST = "sha256:" + "ab" * 32


class HostileServer:
    """HTTP/1.1 on a free 127.0.0.1 port; ``answer(conn, method, path, headers)`` writes the
    raw response for each request but ``GET /v2/`` (a 200, so the store opens). Counts
    requests and the bytes it managed to send, and records every request's headers."""

    def __init__(self, answer: Callable[..., None]) -> None:
        self.answer = answer
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.sent = 0
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            f = conn.makefile("rb")
            while not self.stopped:
                line = f.readline().decode()
                if not line:
                    return
                method, path, _ = line.split(" ", 2)
                headers = {}
                while (h := f.readline().decode().strip()):
                    k, _, v = h.partition(":")
                    headers[k.strip().lower()] = v.strip()
                if int(headers.get("content-length", 0)):
                    f.read(int(headers["content-length"]))
                self.requests.append((method, path, headers))
                if path == "/v2/":
                    self.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                else:
                    self.answer(self, conn, method, path, headers)

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def stream(self, conn: socket.socket, total: int) -> None:
        """``total`` zero bytes, until the client hangs up."""
        block = bytes(256 << 10)
        while total > 0 and not self.stopped:
            self.send(conn, block[:total])
            total -= len(block)

    def stop(self) -> None:
        self.stopped = True
        self.sock.close()


@pytest.fixture
def serve():
    servers: list[HostileServer] = []

    def start(answer: Callable[..., None]) -> HostileServer:
        servers.append(HostileServer(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _within(seconds: float, op: Callable[[], object]) -> BaseException | object:
    """Run ``op`` in a thread; its exception or result, or fail if it is still running."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(op())
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the client was still held after {seconds} s"
    return out[0]


def _one_line(err: object, *words: str) -> None:
    assert isinstance(err, StoreError), err
    text = str(err)
    assert "\n" not in err.message and all(w in text for w in words), text


def _store(server: HostileServer, **kw) -> RegistryStore:
    return RegistryStore(f"docker://{server.host}/team/envs", attempts=1, **kw)


def test_a_huge_declared_manifest_is_refused_before_it_is_read(serve):
    def answer(srv, conn, method, path, headers):
        srv.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest"
                       b".v1+json\r\nContent-Length: 629145600\r\n\r\n")
        srv.stream(conn, 64 * MiB)  # of the 600 MB declared

    srv = serve(answer)
    err = _within(60, lambda: _store(srv).get_ref("env/app"))
    _one_line(err, "629145600 bytes", f"at most {MAX_RESPONSE}")
    assert srv.sent < 16 * MiB  # the socket buffers, not the body


def test_an_endless_body_is_cut_off_at_the_limit(serve):
    def answer(srv, conn, method, path, headers):  # no length: the body ends at the close
        srv.send(conn, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        srv.stream(conn, 64 * MiB)  # "endless": the old client read it all

    srv = serve(answer)
    err = _within(60, lambda: _store(srv).list_refs())  # tags/list
    _one_line(err, "list tags of", f"at most {MAX_RESPONSE}")
    assert srv.sent < 16 * MiB


def test_endless_tag_pages_are_refused(serve):
    def answer(srv, conn, method, path, headers):
        n = len(srv.requests)
        body = b'{"name":"team/envs","tags":["t%d"]}' % n
        srv.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nLink: "
                       b'</v2/team/envs/tags/list?n=1000&last=t%d>; rel="next"\r\n\r\n%s'
                 % (len(body), n, body))

    srv = serve(answer)
    err = _within(60, lambda: _store(srv).list_refs())
    _one_line(err, "more than", "pages")
    assert len(srv.requests) <= MAX_TAG_PAGES + 1


def test_a_server_sending_one_byte_at_a_time_is_given_up_on(serve):
    def answer(srv, conn, method, path, headers):
        srv.send(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(1000):  # well within the socket timeout each time
            time.sleep(0.5)
            srv.send(conn, b"{")

    srv = serve(answer)
    t0 = time.monotonic()
    err = _within(30, lambda: _store(srv, timeout=2.0, deadline=3.0).get_ref("env/app"))
    assert isinstance(err, StoreUnavailable), err
    _one_line(err, "did not answer within the request deadline")
    assert time.monotonic() - t0 < 10


def test_a_redirect_off_the_registry_is_refused_before_connecting(serve):
    elsewhere = serve(lambda srv, conn, *a: srv.send(
        conn, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"))
    targets = [f"http://{elsewhere.host}/stolen",  # another loopback port
               f"http://localhost:{elsewhere.port}/stolen",  # another host name
               "file:///etc/passwd"]

    order = iter(targets)

    def answer(srv, conn, method, path, headers):
        location = next(order)
        srv.send(conn, f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {location}\r\n"
                       "Content-Length: 0\r\n\r\n".encode())

    srv = serve(answer)
    store = _store(srv, credentials=("user", "pw"))
    for _ in targets:
        err = _within(30, lambda: store.get_range(DIGEST, 0, 10))
        _one_line(err, "redirected to", "neither the registry nor a blob host")
    assert elsewhere.requests == []  # nothing connected there


def test_a_blob_host_at_a_private_address_is_refused_before_connecting(serve):
    # 10.255.255.1 is configured as a blob host but is not where the registry is: the client
    # must refuse it after resolving it, without a connect (nothing is listening there)
    def answer(srv, conn, method, path, headers):
        srv.send(conn, b"HTTP/1.1 307 Temporary Redirect\r\nLocation: "
                       b"http://10.255.255.1:9/blob\r\nContent-Length: 0\r\n\r\n")

    srv = serve(answer)
    store = _store(srv, blob_hosts=["10.255.255.1:9"], insecure=["10.255.255.1"])
    t0 = time.monotonic()
    err = _within(30, lambda: store.get_range(DIGEST, 0, 10))
    _one_line(err, "refusing to connect to 10.255.255.1:9", "non-public address")
    assert time.monotonic() - t0 < 2  # no connect attempt was waited for


def test_a_configured_blob_host_gets_the_read_but_never_the_credentials(serve):
    blobs = serve(lambda srv, conn, *a: srv.send(
        conn, b"HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\n\r\n0123456789"))

    def answer(srv, conn, method, path, headers):
        if "authorization" not in headers:
            srv.send(conn, b'HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm="r"'
                           b"\r\nContent-Length: 0\r\n\r\n")
            return
        srv.send(conn, f"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://{blobs.host}"
                       "/blob\r\nContent-Length: 0\r\n\r\n".encode())

    srv = serve(answer)
    store = _store(srv, credentials=("user", "pw"), blob_hosts=[blobs.host])
    assert _within(30, lambda: store.get_range(DIGEST, 0, 10)) == b"0123456789"
    assert any("authorization" in h for _, _, h in srv.requests)  # the registry got them
    assert [h.get("authorization") for _, _, h in blobs.requests] == [None]
