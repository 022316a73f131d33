"""Run an ASGI application (connectrpc's generated envd services) inside an aiohttp handler.

Only what Connect's unary and server-streaming calls over HTTP/1.1 use: one ``http`` scope,
the request body read in chunks (bounded by the caller's ``max_body``), response start and
body messages. No trailers (gRPC), no websockets, no lifespan.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from aiohttp import web

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
AsgiApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]

_CHUNK = 64 << 10


def _scope(request: web.Request) -> Scope:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path,
        "raw_path": request.raw_path.encode(), "root_path": "",
        "query_string": request.query_string.encode(),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                    for k, v in request.headers.items()],
        "client": tuple(peer[:2]) if isinstance(peer, tuple) else None,
        "server": None, "extensions": {},
    }


async def call_asgi(app: AsgiApp, request: web.Request, max_body: int) -> web.StreamResponse:
    """Serve ``request`` with ``app``; a body over ``max_body`` bytes is 413 before ``app``
    sees the end of it."""
    done = asyncio.Event()
    body_read = 0
    response: web.StreamResponse | None = None

    async def receive() -> Message:
        nonlocal body_read
        if request.content.at_eof() and body_read >= 0:
            body_read = -1
            return {"type": "http.request", "body": b"", "more_body": False}
        if body_read < 0:  # the body is over: wait until the exchange ends
            await done.wait()
            return {"type": "http.disconnect"}
        chunk = await request.content.read(_CHUNK)
        body_read += len(chunk)
        if body_read > max_body:
            raise web.HTTPRequestEntityTooLarge(max_size=max_body, actual_size=body_read)
        more = not request.content.at_eof()
        if not more:
            body_read = -1
        return {"type": "http.request", "body": chunk, "more_body": more}

    async def send(message: Message) -> None:
        nonlocal response
        if message["type"] == "http.response.start":
            response = web.StreamResponse(status=message["status"])
            for k, v in message.get("headers", ()):
                response.headers.add(k.decode("latin-1"), v.decode("latin-1"))
            await response.prepare(request)
        elif message["type"] == "http.response.body":
            assert response is not None, "body before start (an ASGI app bug)"
            if message.get("body"):
                await response.write(message["body"])
            if not message.get("more_body", False):
                await response.write_eof()

    try:
        await app(_scope(request), receive, send)
    except ConnectionResetError:  # the client left mid-stream (e.g. a dropped command handle)
        pass  # and its sandbox then killed: there is no one to answer, and nothing went wrong
    finally:
        done.set()
    if response is None:
        raise web.HTTPInternalServerError(text="no response")
    return response
