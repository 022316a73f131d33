"""Conformance, ports: the unmodified ``e2b`` SDK's ``get_host(port)`` names a port a process
listens on inside the sandbox, and a plain HTTP or WebSocket client reaches it through
``envbuild serve`` (``Host: PORT-ID.localhost:SERVERPORT``, or the ``E2b-Sandbox-Id`` /
``E2b-Sandbox-Port`` headers on the server's URL) with the sandbox's traffic access token.
Real server process on 127.0.0.1, real runc sandboxes of the busybox env (``busybox httpd``,
a WebSocket echo written in busybox sh)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import pytest

from tests.conftest import require_tool

pytestmark = pytest.mark.slow
TEMPLATE = "busybox-shell"
PAGE = "served from inside the sandbox\n"
TRAFFIC = "e2b-traffic-access-token"
#: A CGI script of busybox httpd: the query, what the request says of our tokens, the body.
CGI = """#!/bin/sh
echo "Content-Type: text/plain"
echo
echo "query=$QUERY_STRING"
echo "tokens=${HTTP_X_ACCESS_TOKEN}${HTTP_E2B_TRAFFIC_ACCESS_TOKEN}${HTTP_E2B_SANDBOX_ID}"
echo "host=$HTTP_HOST"
head -c "${CONTENT_LENGTH:-0}"
"""
#: A WebSocket echo in busybox sh (``nc -ll -e``, one process a connection): the handshake
#: (sha1sum, xxd, base64), then each masked client frame (payload under 126 bytes) unmasked
#: and sent back unmasked, until a close frame.
WS_ECHO = r"""#!/bin/sh
key=
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\r')
  [ -z "$line" ] && break
  case "$line" in [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(echo "${line#*:}" | tr -d ' ');; esac
done
accept=$(printf '%s' "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -d' ' -f1 \
         | xxd -r -p | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n'
printf 'Sec-WebSocket-Accept: %s\r\n\r\n' "$accept"
while :; do
  set -- $(dd bs=1 count=2 2>/dev/null | od -An -tu1)
  [ $# -eq 2 ] || exit 0
  op=$(( $1 & 15 )); len=$(( $2 & 127 ))
  set -- $(dd bs=1 count=4 2>/dev/null | od -An -tu1)
  m0=$1 m1=$2 m2=$3 m3=$4
  out= i=0
  for b in $(dd bs=1 count=$len 2>/dev/null | od -An -tu1 -v); do
    case $(( i % 4 )) in 0) m=$m0;; 1) m=$m1;; 2) m=$m2;; *) m=$m3;; esac
    out="$out\\$(printf '%03o' $(( b ^ m )))"; i=$(( i + 1 ))
  done
  if [ $op -eq 8 ]; then printf '\210\000'; exit 0; fi
  printf "\\$(printf '%03o' $(( 128 | op )))\\$(printf '%03o' $len)$out"
done
"""


@pytest.fixture(scope="module")
def server(e2b_server):
    return e2b_server


@pytest.fixture(scope="module")
def served(server):
    """A sandbox serving ``/www`` with ``busybox httpd`` on 8080 (and a CGI script)."""
    from e2b import Sandbox

    sb = Sandbox.create(TEMPLATE, timeout=300)
    sb.files.write("/www/index.html", PAGE, user="root")
    sb.files.write("/www/cgi-bin/echo", CGI, user="root")
    sb.files.write("/www/ws.sh", WS_ECHO, user="root")
    sb.commands.run("chmod 755 /www/cgi-bin/echo /www/ws.sh", user="root")
    sb.commands.run("busybox nc -ll -p 8090 -e /www/ws.sh", background=True, user="root")
    sb.commands.run("busybox httpd -f -p 8080 -h /www", background=True, user="root")
    wait_listening(server.url, sb, 8080)
    wait_listening(server.url, sb, 8090)
    yield sb
    sb.kill()


def wait_listening(url: str, sb, port: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            r = httpx.get(url + "/", headers=port_headers(sb, port))
        except httpx.RemoteProtocolError:  # the WebSocket echo answers 101 to anything
            return
        if r.status_code != 502 or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def port_headers(sb, port: int) -> dict[str, str]:
    """The header form: E2B's proxy headers on the server's own URL."""
    return {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": str(port),
            TRAFFIC: sb.traffic_access_token}


def test_get_host_names_the_port_and_an_http_get_reaches_it(server, served):
    host = served.get_host(8080)
    assert host == f"{8080}-{served.sandbox_id}.localhost:{server.url.rsplit(':', 1)[1]}"
    assert served.traffic_access_token and served.traffic_access_token != \
        served._envd_access_token
    # the Host form: what get_host returned, sent to the server's address
    r = httpx.get(server.url + "/index.html",
                  headers={"Host": host, TRAFFIC: served.traffic_access_token})
    assert (r.status_code, r.text) == (200, PAGE)
    # the header form
    r = httpx.get(server.url + "/index.html", headers=port_headers(served, 8080))
    assert (r.status_code, r.text) == (200, PAGE)
    r = httpx.get(server.url + "/missing.html", headers=port_headers(served, 8080))
    assert r.status_code == 404  # the sandbox's server's answer, passed on


def test_query_and_body_go_through_and_our_tokens_do_not(server, served):
    body = b"x" * 300_000 + b"end"
    r = httpx.post(server.url + "/cgi-bin/echo?a=1%2F2&b=two+x",
                   headers={"Host": served.get_host(8080), TRAFFIC: served.traffic_access_token,
                            "X-Access-Token": "not-forwarded"}, content=body, timeout=30)
    assert r.status_code == 200, r.text
    lines = r.content.split(b"\n", 3)
    assert lines[0] == b"query=a=1%2F2&b=two+x"  # as sent, not decoded and encoded again
    assert lines[1] == b"tokens="  # neither token nor our routing headers reach the sandbox
    assert lines[2] == f"host={served.get_host(8080)}".encode()
    assert lines[3] == body


def test_a_port_nothing_listens_on_is_a_502(server, served):
    r = httpx.get(server.url + "/", headers=port_headers(served, 8081))
    assert r.status_code == 502 and "port 8081 is not open" in r.json()["message"]


def test_the_envd_token_opens_the_port_too(server, served):
    r = httpx.get(server.url + "/index.html",
                  headers={"Host": served.get_host(8080),
                           "X-Access-Token": served._envd_access_token})
    assert (r.status_code, r.text) == (200, PAGE)


def test_a_websocket_through_get_host(server, served):
    import aiohttp

    async def scenario() -> list[str]:
        got = []
        async with aiohttp.ClientSession() as client:
            async with client.ws_connect(server.url + "/", headers={
                    "Host": served.get_host(8090), TRAFFIC: served.traffic_access_token},
                    timeout=aiohttp.ClientWSTimeout(ws_receive=10)) as ws:
                for text in ("hello ws", "second message"):
                    await ws.send_str(text)
                    msg = await ws.receive()
                    got.append(msg.data)
        return got

    assert asyncio.run(scenario()) == ["hello ws", "second message"]


def test_curl_reaches_get_host_as_a_url(server, served):
    """curl resolves ``*.localhost`` to the loopback itself: ``get_host`` is a URL for it."""
    require_tool("curl")
    done = subprocess.run(["curl", "-sS", "--max-time", "20", "-H",
                           f"{TRAFFIC}: {served.traffic_access_token}",
                           f"http://{served.get_host(8080)}/index.html"],
                          capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (0, PAGE), done.stderr


def test_killing_the_sandbox_ends_its_open_websocket(server):
    import aiohttp
    from e2b import Sandbox

    sb = Sandbox.create(TEMPLATE, timeout=120)
    sb.files.write("/www/ws.sh", WS_ECHO, user="root")
    sb.commands.run("chmod 755 /www/ws.sh", user="root")
    sb.commands.run("busybox nc -ll -p 8090 -e /www/ws.sh", background=True, user="root")
    wait_listening(server.url, sb, 8090)

    async def scenario() -> aiohttp.WSMsgType:
        async with aiohttp.ClientSession() as client:
            async with client.ws_connect(server.url + "/", headers=port_headers(sb, 8090)) as ws:
                await ws.send_str("up")
                assert (await ws.receive(timeout=10)).data == "up"
                await asyncio.get_running_loop().run_in_executor(None, sb.kill)
                return (await ws.receive(timeout=20)).type

    assert asyncio.run(scenario()) in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                                       aiohttp.WSMsgType.CLOSING)


def test_the_async_sdk_names_the_same_host(server, served):
    from e2b import AsyncSandbox

    async def scenario():
        sb = await AsyncSandbox.connect(served.sandbox_id)
        return sb.get_host(8080), sb.traffic_access_token

    host, token = asyncio.run(scenario())
    assert host == served.get_host(8080)
    r = httpx.get(server.url + "/index.html", headers={"Host": host, TRAFFIC: token})
    assert (r.status_code, r.text) == (200, PAGE)
