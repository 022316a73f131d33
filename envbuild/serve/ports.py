"""Ports: ``sandbox.get_host(port)`` — HTTP and WebSocket through the server to a port that a
process listens on inside a sandbox (``AsyncSandbox.connect_port``: the connection is made in
the sandbox's own network namespace, nothing in the sandbox changes).

A request is a port request when its ``Host`` is ``PORT-SANDBOXID.DOMAIN`` (what
``get_host(port)`` returns: the create response's ``domain`` is ``localhost:SERVERPORT``), or
when it carries ``E2b-Sandbox-Id`` and an ``E2b-Sandbox-Port`` other than envd's 49983 (the
headers E2B's own proxy routes by). It must carry the sandbox's ``trafficAccessToken`` in
``e2b-traffic-access-token`` (or its ``envdAccessToken`` in ``X-Access-Token``); both headers
are removed before the request goes on, with every hop-by-hop header.

Bounds: ``MAX_CONNECTIONS`` open connections per sandbox (a request past them waits up to
``CONNECT_TIMEOUT``, then 504), request bodies at most the server's upload limit, responses
and WebSocket messages streamed (a message at most ``MAX_WS_MESSAGE``), ``IDLE_TIMEOUT`` of
silence ends an exchange. Cookies are never kept between requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from yarl import URL

from envbuild.errors import RuntimeShimError
from envbuild.serve.auth import same_token
from envbuild.serve.sandboxes import Entry
from runtime_shim import PortRefused

#: envd's port: requests naming it are envd's, never proxied.
ENVD_PORT = 49983
MAX_CONNECTIONS = 64
CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 300.0
MAX_WS_MESSAGE = 4 << 20
TRAFFIC_HEADER = "e2b-traffic-access-token"
#: Seconds between checks that the client of a waiting request is still there.
_GONE_POLL = 0.5
_T = TypeVar("_T")
_HOST = re.compile(r"^(\d{1,5})-([A-Za-z0-9]{1,64})\.", re.ASCII)
_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Proxy-Connection"))
_OURS = frozenset(h.lower() for h in (
    TRAFFIC_HEADER, "X-Access-Token", "X-API-KEY", "E2b-Sandbox-Id", "E2b-Sandbox-Port"))
_WS = frozenset(h.lower() for h in (
    "Sec-WebSocket-Key", "Sec-WebSocket-Version", "Sec-WebSocket-Protocol",
    "Sec-WebSocket-Extensions"))


def target(request: web.Request) -> tuple[str, str] | None:
    """``(sandbox id, port)`` of a port request (the port unchecked), None for another."""
    m = _HOST.match(request.host or "")
    if m is not None and m[1] != str(ENVD_PORT):
        return m[2], m[1]
    port = request.headers.get("E2b-Sandbox-Port")
    if port is not None and port.strip() != str(ENVD_PORT):
        return request.headers.get("E2b-Sandbox-Id", ""), port.strip()
    return None


def domain(request: web.Request) -> str:
    """The ``domain`` a create returns: ``localhost:PORT`` of the port this request came to,
    so ``get_host(p)`` is ``p-ID.localhost:PORT`` (curl and browsers resolve ``*.localhost``
    to the loopback themselves)."""
    host = request.host or ""
    port = host.rpartition(":")[2] if not host.endswith("]") else ""
    return f"localhost:{port}" if port.isdigit() else "localhost"


def authorized(request: web.Request, entry: Entry) -> bool:
    traffic = same_token(request.headers.get(TRAFFIC_HEADER), entry.traffic_token)
    envd = same_token(request.headers.get("X-Access-Token"), entry.token)
    return traffic or envd


def _error(status: int, message: str, sandbox_id: str) -> web.Response:
    return web.json_response({"code": status, "message": message, "sandboxId": sandbox_id},
                             status=status)


class _SandboxConnector(aiohttp.BaseConnector):
    """aiohttp's client connections, each a socket made by ``connect_port`` (the URL's port
    inside the sandbox) instead of a TCP connect on the host."""

    def __init__(self, sandbox: Any) -> None:
        super().__init__(force_close=True, limit=MAX_CONNECTIONS)
        self._sandbox = sandbox

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        try:
            sock = await self._sandbox.connect_port(req.url.port, CONNECT_TIMEOUT)
        except OSError as e:  # PortRefused, or a sandbox without ports (serve.fleet)
            raise aiohttp.ClientConnectorError(req.connection_key, e) from e
        try:
            _, proto = await self._loop.create_connection(self._factory, sock=sock)
        except BaseException:
            sock.close()
            raise
        return proto


def _session(entry: Entry) -> aiohttp.ClientSession:
    if entry.port_session is None:
        entry.port_session = aiohttp.ClientSession(
            connector=_SandboxConnector(entry.sandbox), cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT,
                                          sock_read=IDLE_TIMEOUT),
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept",
                                                      "Accept-Encoding", "Content-Type"))
    return entry.port_session


def _headers(request: web.Request, drop: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    skip = _HOP | _OURS | drop
    return [(k, v) for k, v in request.headers.items() if k.lower() not in skip]


async def handle(request: web.Request, entry: Entry, port_text: str, max_body: int
                 ) -> web.StreamResponse:
    """Serve a port request for ``entry`` (found and authorized by the caller)."""
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        return _error(400, f"port {port_text[:16]!r} is not a TCP port", entry.id)
    port = int(port_text)
    if not request.raw_path.startswith("/"):
        return _error(400, "the request target must be a path (origin form)", entry.id)
    # the path and query as sent, byte for byte (``%2F`` stays ``%2F``)
    url = URL(f"http://127.0.0.1:{port}{request.raw_path}", encoded=True)
    try:
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await _websocket(request, entry, url)
        return await _http(request, entry, url, max_body)
    except aiohttp.ClientConnectorError as e:
        if isinstance(e.os_error, PortRefused):
            return _error(502, f"The sandbox is running but port {port} is not open", entry.id)
        return _error(502, f"connect to port {port}: {e.os_error}", entry.id)
    except RuntimeShimError as e:
        return _error(502, f"connect to port {port}: {e.message}", entry.id)
    except (aiohttp.ServerTimeoutError, TimeoutError):
        return _error(504, f"port {port} did not answer in time", entry.id)
    except aiohttp.ClientError as e:  # the sandbox's server hung up mid-request
        return _error(502, f"port {port}: {e}", entry.id)


async def _body(request: web.Request, limit: int, over: list[bool]) -> AsyncIterator[bytes]:
    total = 0
    async for chunk in request.content.iter_any():
        total += len(chunk)
        if total > limit:
            over.append(True)
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=total)
        yield chunk


async def _http(request: web.Request, entry: Entry, url: URL, max_body: int
                ) -> web.StreamResponse:
    if request.content_length is not None and request.content_length > max_body:
        return _error(413, f"request body of {request.content_length} bytes is over "
                           f"{max_body}", entry.id)
    over: list[bool] = []
    data = _body(request, max_body, over) if request.body_exists else None
    try:
        upstream = await _while_connected(request, _session(entry).request(
            request.method, url, headers=_headers(request), data=data, allow_redirects=False))
    except aiohttp.ClientError:
        if over:
            return _error(413, f"request body is over {max_body} bytes", entry.id)
        raise
    async with upstream:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in _HOP:
                response.headers.add(k, v)
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (aiohttp.ClientError, TimeoutError):
            # the sandbox's server broke off or went silent: so does this answer
            if request.transport is not None:
                request.transport.abort()
            return response
        await response.write_eof()
        return response


async def _while_connected(request: web.Request, work: Awaitable[_T]) -> _T:
    """``work``, cancelled when the client hangs up (aiohttp does not cancel a handler then):
    a client that walks away does not hold one of the sandbox's connections."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(_GONE_POLL)

    watch = asyncio.create_task(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise web.HTTPBadRequest(text="the client hung up")  # nobody reads it
    return task.result()


async def _websocket(request: web.Request, entry: Entry, url: URL) -> web.StreamResponse:
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")
               if p.strip()]
    try:
        upstream = await _session(entry).ws_connect(
            url, headers=_headers(request, _WS), protocols=offered, autoping=True,
            heartbeat=IDLE_TIMEOUT / 10, max_msg_size=MAX_WS_MESSAGE)
    except aiohttp.WSServerHandshakeError as e:
        return _error(502, f"port {url.port} refused the WebSocket ({e.status})", entry.id)
    async with upstream:
        ws = web.WebSocketResponse(protocols=(upstream.protocol,) if upstream.protocol else (),
                                   max_msg_size=MAX_WS_MESSAGE, heartbeat=IDLE_TIMEOUT / 10)
        await ws.prepare(request)
        await _relay(ws, upstream)
        return ws


async def _relay(a: Any, b: Any) -> None:
    """Messages both ways until either side closes or nothing moved for ``IDLE_TIMEOUT``."""
    last = [time.monotonic()]

    async def pump(src: Any, dst: Any) -> None:
        async for msg in src:
            last[0] = time.monotonic()
            if msg.type is aiohttp.WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type is aiohttp.WSMsgType.BINARY:
                await dst.send_bytes(msg.data)

    async def idle() -> None:
        while (left := last[0] + IDLE_TIMEOUT - time.monotonic()) > 0:
            await asyncio.sleep(left)

    tasks = [asyncio.create_task(c) for c in (pump(a, b), pump(b, a), idle())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for side in (a, b):
            with contextlib.suppress(Exception):
                await side.close()
