"""``envbuild.store._http.RangeClient`` against a real HTTP server on 127.0.0.1 that misbehaves
on purpose: keep-alive reuse, retries with bounded backoff, and response sizes bounded by the
range asked for (a server that ignores ``Range`` or sends more than asked)."""

from __future__ import annotations

import http.server
import threading
import time

import pytest

from envbuild.store._http import Backoff, RangeClient

OBJECT = bytes(range(256)) * 4096  # 1 MiB


class Server:
    """Serves ``OBJECT`` with a behaviour chosen per test; counts connections and requests."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.fail_first = 0
        self.requests = 0
        self.connections = 0
        self.sent = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests += 1
                if outer.fail_first > 0:
                    outer.fail_first -= 1
                    self._send(503, b"slow down")
                    return
                start, _, end = self.headers["Range"].removeprefix("bytes=").partition("-")
                a, b = int(start), int(end)
                if outer.mode == "ignore-range":
                    self._send(200, OBJECT)
                elif outer.mode == "too-long":  # claims a 206 but sends the whole object
                    self._send(206, OBJECT)
                elif outer.mode == "too-long-chunked":
                    self.send_response(206)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(0, len(OBJECT), 65536):
                        piece = OBJECT[i:i + 65536]
                        try:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        except OSError:
                            return
                        outer.sent += len(piece)
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self._send(206, OBJECT[a:b + 1])
                if outer.mode == "close-idle":  # as a server whose keep-alive timeout passed
                    self.close_connection = True

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    return
                outer.sent += len(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.handle_error = lambda *a: None  # type: ignore[method-assign]  # clients hang up on purpose
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/blob?sig=x"
        # a short poll: shutdown() waits for it (the default 0.5 s, each test)
        threading.Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def test_ranges_reuse_one_connection(server):
    client = RangeClient()
    for off in range(0, 40_000, 4000):
        got = client.get(server.url, off, 4000)
        assert got.status == 206 and got.body == OBJECT[off:off + 4000]
    assert server.requests == 10 and server.connections == 1


def test_threads_share_the_idle_connections(server):
    """A connection serves one request at a time but any thread: threads asking one after
    another share one connection, threads asking at once open one each, kept for later."""
    from concurrent.futures import ThreadPoolExecutor

    client = RangeClient()
    for i in range(6):   # a new thread each time, as a pool per call made them
        t = threading.Thread(target=client.get, args=(server.url, i * 100, 100))
        t.start()
        t.join()
    assert server.requests == 6 and server.connections == 1 and client.connects == 1
    barrier = threading.Barrier(4)

    def at_once(off):
        barrier.wait(5)
        return client.get(server.url, off, 1000)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(at_once, range(0, 4000, 1000)))
    assert [g.body for g in got] == [OBJECT[o:o + 1000] for o in range(0, 4000, 1000)]
    assert 2 <= server.connections <= 4
    opened = server.connections
    with ThreadPoolExecutor(opened) as pool:   # no more at once than kept: none new
        list(pool.map(lambda off: client.get(server.url, off, 10), range(0, 80, 10)))
    assert server.connections == opened and client.connects == opened
    client.close()


def test_transient_errors_are_retried_with_bounded_backoff(server):
    server.fail_first = 2
    client = RangeClient(attempts=3, backoff=Backoff(0.01, 0.02))
    got = client.get(server.url, 10, 5)
    assert got.body == OBJECT[10:15] and server.requests == 3
    server.fail_first = 10
    t = time.monotonic()
    got = client.get(server.url, 10, 5)
    assert got.status == 0 and "HTTP 503" in got.error and "3 attempts" in got.error
    assert time.monotonic() - t < 1.0


def test_unreachable_server_gives_up_after_its_attempts():
    client = RangeClient(attempts=2, connect_timeout=1.0, backoff=Backoff(0.01, 0.02))
    got = client.get("http://127.0.0.1:9/blob", 0, 10)  # discard port: refused
    assert got.status == 0 and "ConnectionRefused" in got.error


def test_a_server_that_ignores_range_is_read_only_up_to_the_range(server):
    server.mode = "ignore-range"
    client = RangeClient()
    got = client.get(server.url, 1000, 100)
    assert got.status == 200 and got.body == OBJECT[1000:1100]
    # the rest of the object was not read: the connection is dropped, the next one is new
    assert client.get(server.url, 0, 10).body == OBJECT[:10]
    assert server.connections == 2


@pytest.mark.parametrize("mode", ["too-long", "too-long-chunked"])
def test_a_206_longer_than_the_range_is_refused(server, mode):
    server.mode = mode
    client = RangeClient(attempts=3)
    got = client.get(server.url, 0, 100)
    assert not got.ok and got.body == b"" and "100-byte range" in got.error
    assert server.requests == 1  # final, not retried


def test_bad_ranges_are_a_programming_error():
    with pytest.raises(ValueError):
        RangeClient().get("http://127.0.0.1:9/", 0, 0)
    with pytest.raises(ValueError):
        RangeClient(attempts=0)


def test_http_ranges_read_over_the_url_and_fall_back_to_the_store(server):
    """The lazy filler's reader uses the shared client: ranges come over the URL while it
    answers, and go to the full store (opened only then) when it does not."""
    from envbuild.store import MemoryStore, put_bytes
    from envbuild.store.lazy import HttpRanges

    store = MemoryStore()
    digest = put_bytes(store, OBJECT)
    opened = []

    def fallback():
        opened.append(1)
        return store

    ranges = HttpRanges(digest, server.url, fallback, attempts=2)
    ranges.client.backoff = Backoff(0.01, 0.02)
    assert ranges.get_range(digest, 100, 10) == OBJECT[100:110] and opened == []
    assert store.calls["get_range"] == 0
    server.mode = "too-long"  # a hostile answer is not used: the store answers instead
    assert ranges.get_range(digest, 200, 10) == OBJECT[200:210] and opened == [1]
    assert store.calls["get_range"] == 1


class _NoSleep(Backoff):
    """A backoff that records the retries it was asked to wait for."""

    def __init__(self) -> None:
        super().__init__(5.0, 5.0)
        object.__setattr__(self, "asked", [])

    def delay(self, attempt: int) -> float:
        self.asked.append(attempt)  # type: ignore[attr-defined]
        return 0.0


def test_a_kept_alive_connection_the_server_closed_is_retried_at_once(server):
    server.mode = "close-idle"   # every connection is closed after one answer, silently
    backoff = _NoSleep()
    client = RangeClient(attempts=2, backoff=backoff)
    for off in (0, 100, 200):
        got = client.get(server.url, off, 10)
        assert got.status == 206 and got.body == OBJECT[off:off + 10]
    # each stale connection cost one immediate retry on a new one: no backoff, no attempt
    assert backoff.asked == [] and server.connections == 3 and server.requests == 3


def test_idle_connections_gone_stale_together_cost_no_backoff(server):
    """Several kept-alive connections idle at once (a create's parallel reads) go stale
    together when the server closes idle ones: the first stale one drops the others, and
    the read is retried at once on a new connection (it was a backoff sleep per stale
    sibling: 4.3 s of a native create after 5 s of quiet)."""
    import urllib.parse

    server.mode = "close-idle"
    backoff = _NoSleep()
    client = RangeClient(attempts=4, backoff=backoff)
    parts = urllib.parse.urlsplit(server.url)
    held = []
    for off in (0, 100, 200):   # three connections out at once, each answered then closed
        conn = client._take(parts.scheme, parts.netloc)
        conn.connect()
        conn.request("GET", parts.path, headers={"Range": f"bytes={off}-{off + 9}"})
        conn.getresponse().read()
        held.append(conn)
    for conn in held:
        client._give_back(parts.scheme, parts.netloc, conn)
    got = client.get(server.url, 300, 10)
    assert got.status == 206 and got.body == OBJECT[300:310]
    assert backoff.asked == [] and server.connections == 4
