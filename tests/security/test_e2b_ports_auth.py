"""``envbuild serve``'s ports (``get_host``) against the real server with real runc sandboxes
(issue 37 item 3): a port request needs that sandbox's token — another sandbox's token, no
token or a wrong one is refused, whichever way the request names the sandbox; an unknown or
killed sandbox is a clean not-found; a request body over the server's bound is refused."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.e2b_server import e2b_env, running_server
from tests.integration.conftest import build_busybox_env

pytestmark = pytest.mark.slow
TRAFFIC = "e2b-traffic-access-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2bportsec")
    store, node = build_busybox_env(root)
    with running_server(root, store.root, node, args=("--max-upload", "1MiB")) as srv, \
            e2b_env(srv):
        yield srv


def _serving(server):
    """A sandbox whose ``busybox httpd`` on 8080 serves its own id at ``/id``."""
    from e2b import Sandbox

    sb = Sandbox.create("busybox-shell", timeout=120)
    sb.files.write("/www/id", sb.sandbox_id, user="root")
    sb.commands.run("busybox httpd -f -p 8080 -h /www", background=True, user="root")
    deadline = time.monotonic() + 10
    while _get(server, sb, sb.traffic_access_token).status_code == 502:
        assert time.monotonic() < deadline, "httpd did not start"
        time.sleep(0.05)
    return sb


def _get(server, sb, token: str | None, *, header: str = TRAFFIC, host_form: bool = True,
         extra: dict[str, str] | None = None, timeout: float = 5) -> httpx.Response:
    headers = ({"Host": sb.get_host(8080)} if host_form else
               {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8080"})
    if token is not None:
        headers[header] = token
    return httpx.get(server.url + "/id", headers={**headers, **(extra or {})}, timeout=timeout)


@pytest.fixture(scope="module")
def two(server):
    a, b = _serving(server), _serving(server)
    yield a, b
    a.kill()
    b.kill()


def test_a_token_opens_its_own_sandbox_only(server, two):
    a, b = two
    assert a.traffic_access_token != b.traffic_access_token
    for host_form in (True, False):
        ok = _get(server, b, b.traffic_access_token, host_form=host_form)
        assert (ok.status_code, ok.text) == (200, b.sandbox_id)
        for token, header in ((a.traffic_access_token, TRAFFIC),
                              (a._envd_access_token, "X-Access-Token"),
                              (b.traffic_access_token, "X-Access-Token"),  # wrong header
                              (b._envd_access_token, TRAFFIC),
                              (None, TRAFFIC), ("", TRAFFIC),
                              (b.traffic_access_token + "x", TRAFFIC)):
            r = _get(server, b, token, header=header, host_form=host_form)
            assert r.status_code == 401, (token, header, host_form, r.text)
            assert b.sandbox_id not in r.text
    # the Host names the sandbox: a's id in the routing headers does not make a's token fit
    r = _get(server, b, a.traffic_access_token,
             extra={"E2b-Sandbox-Id": a.sandbox_id, "E2b-Sandbox-Port": "8080"})
    assert r.status_code == 401 and b.sandbox_id not in r.text


def test_unknown_and_killed_sandboxes_are_not_found(server):
    sb = _serving(server)
    token, host = sb.traffic_access_token, sb.get_host(8080)
    sb.kill()
    for headers in ({"Host": host, TRAFFIC: token},
                    {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8080", TRAFFIC: token},
                    {"Host": "8080-inosuchsandbox.localhost", TRAFFIC: token},
                    {"E2b-Sandbox-Port": "8080", TRAFFIC: token}):
        r = httpx.get(server.url + "/id", headers=headers)
        assert r.status_code == 502 and "was not found" in r.json()["message"], (headers, r.text)


def test_request_bodies_are_bounded(server, two):
    a, _ = two
    headers = {"Host": a.get_host(8080), TRAFFIC: a.traffic_access_token}
    r = httpx.post(server.url + "/id", headers=headers, content=b"x" * (2 << 20))
    assert r.status_code == 413, r.text

    def chunks():  # no Content-Length: counted as it streams
        for _ in range(40):
            yield b"y" * (64 << 10)

    # to a server that reads all it is sent and never answers
    a.commands.run("sleep 120 | busybox nc -l -p 8095 >/dev/null", background=True,
                   user="root")
    headers["Host"] = a.get_host(8095)
    deadline = time.monotonic() + 10
    while (r := httpx.post(server.url + "/", headers=headers, content=chunks(), timeout=30)
           ).status_code == 502 and time.monotonic() < deadline:
        time.sleep(0.05)  # nc is not listening yet
    assert r.status_code == 413, r.text


def test_bad_ports_are_refused(server, two):
    a, _ = two
    for port in ("0", "65536", "http", "-1"):
        r = httpx.get(server.url + "/id", headers={
            "E2b-Sandbox-Id": a.sandbox_id, "E2b-Sandbox-Port": port,
            TRAFFIC: a.traffic_access_token})
        assert r.status_code == 400, (port, r.text)


def test_connections_to_one_sandbox_are_bounded_and_freed_when_clients_leave(server, two):
    """``MAX_CONNECTIONS`` requests held open by a slow server in sandbox a: one more waits,
    then is a 504; sandbox b is not affected; clients that hang up free their connections."""
    from envbuild.serve.ports import CONNECT_TIMEOUT, MAX_CONNECTIONS

    a, b = two
    a.files.write("/www/cgi-bin/slow", "#!/bin/sh\nsleep 60\n", user="root")
    a.commands.run("chmod 755 /www/cgi-bin/slow", user="root")
    host, port = server.url.removeprefix("http://").split(":")
    request = (f"GET /cgi-bin/slow HTTP/1.1\r\nHost: {a.get_host(8080)}\r\n"
               f"{TRAFFIC}: {a.traffic_access_token}\r\n\r\n").encode()
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.create_connection((host, int(port)))
            s.sendall(request)
            held.append(s)
        time.sleep(1)
        started = time.monotonic()
        r = _get(server, a, a.traffic_access_token, timeout=CONNECT_TIMEOUT * 3)
        assert r.status_code == 504, r.text
        assert time.monotonic() - started >= CONNECT_TIMEOUT - 1
        ok = _get(server, b, b.traffic_access_token)
        assert (ok.status_code, ok.text) == (200, b.sandbox_id)
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while (r := _get(server, a, a.traffic_access_token)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.text == a.sandbox_id
