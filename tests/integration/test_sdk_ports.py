"""``Sandbox.connect_port``: inbound ports (issue 37 item 2). A socket made in the sandbox's
own network namespace reaches a server listening inside it, and only inside it: not the host's
loopback, not a port nothing listens on. Real runc sandboxes of the busybox env, which serve
with ``busybox httpd``."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from envbuild.errors import PortRefused, SandboxClosed
from runtime_shim import AsyncSandbox, Sandbox
from tests.integration.conftest import build_busybox_env

ENV = "busybox-shell"
PAGE = b"hello from inside the sandbox\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_busybox_env(tmp_path_factory.mktemp("sdkports"))


def serve_httpd(sb: Sandbox, port: int = 8080) -> None:
    """``busybox httpd`` in the foreground of a started process, serving ``/www``; returns
    once it accepts connections."""
    sb.write_file("/www/index.html", PAGE)
    sb.start(f"exec busybox httpd -f -p {port} -h /www")
    deadline = time.monotonic() + 10
    while True:
        try:
            sb.connect_port(port).close()
            return
        except PortRefused:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def http_get(sock: socket.socket, path: str = "/index.html") -> bytes:
    with sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_connect_port_reaches_a_server_in_the_sandbox(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node, network=False) as sb:
        serve_httpd(sb)
        reply = http_get(sb.connect_port(8080))
        assert reply.startswith(b"HTTP/1.") and b" 200 " in reply.split(b"\r\n")[0]
        assert reply.endswith(PAGE)
        # the socket lives in the sandbox: its peer is the sandbox's loopback, seen from there
        peers = sb.exec("cat /proc/net/tcp /proc/net/tcp6").stdout
        assert b":1F90" in peers  # 8080 in hex: the listener (and its connections)


def test_a_networked_sandbox_is_reached_in_its_own_namespace(built):
    """``network=True``: the sandbox's named namespace with slirp and its firewall; the
    connection is its loopback, which the firewall allows."""
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node, network=True) as sb:
        serve_httpd(sb, 8081)
        assert http_get(sb.connect_port(8081)).endswith(PAGE)


def test_a_port_nothing_listens_on_is_one_clear_error(built):
    store, node = built
    with Sandbox.create(ENV, store=store, node_dir=node) as sb:
        with pytest.raises(PortRefused, match=f"nothing listens on port 8081 in sandbox {sb.id}"
                           ) as err:
            sb.connect_port(8081)
        assert isinstance(err.value, ConnectionRefusedError) and err.value.hint
        with pytest.raises(Exception, match="not a TCP port"):
            sb.connect_port(70000)
    with pytest.raises(SandboxClosed):
        sb.connect_port(8080)


def test_the_hosts_loopback_is_not_reachable(built):
    """A server on the host's 127.0.0.1 is not the sandbox's: connect_port refuses."""
    store, node = built
    with socket.socket() as host_server:
        host_server.bind(("127.0.0.1", 0))
        host_server.listen()
        port = host_server.getsockname()[1]
        with Sandbox.create(ENV, store=store, node_dir=node) as sb:
            with pytest.raises(PortRefused):
                sb.connect_port(port)


def test_async_connect_port(built):
    store, node = built

    async def main() -> bytes:
        sb = await AsyncSandbox.create(ENV, store=store, node_dir=node)
        try:
            await asyncio.get_running_loop().run_in_executor(None, serve_httpd, sb.sync)
            reader, writer = await asyncio.open_connection(sock=await sb.connect_port(8080))
            writer.write(b"GET /index.html HTTP/1.0\r\n\r\n")
            reply = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            with pytest.raises(PortRefused):
                await sb.connect_port(9)
            return reply
        finally:
            await sb.close()

    assert asyncio.run(main()).endswith(PAGE)
