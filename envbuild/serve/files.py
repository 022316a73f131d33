"""envd's HTTP endpoints: ``GET /files`` (download), ``POST /files`` (upload: multipart, one or
many files, or envd 0.5.7's ``application/octet-stream``, one file named by ``path``, which
may be ``Content-Encoding: gzip``; at most ``max_upload`` bytes a request, counted as
written) and ``GET /health``.

Both stream (``runtime_shim``'s ``read_stream`` / ``write_stream``): a download is sent from
the sandbox's file with ``sendfile``, an upload goes to the sandbox as it arrives (multipart
parts cut by ``formdata``, no copy of the bulk on the way), in pieces of about ``_CHUNK``,
into a new file published whole once its part ended, owned by the requesting user from the
start. The server holds at most about two pieces of a file — or, for an upload of at most
16 MiB over an existing file, the whole of it while ``HOLD`` (64 MiB for all uploads) has
room, gathered in a reused buffer and written straight into the file at the end instead of
twice through a hidden one —
and nothing of a part refused half-way (over ``max_upload``, a broken body) is ever seen
at its path.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web
from aiohttp.helpers import parse_mimetype

from envbuild.errors import EnvbuildError
from envbuild.serve import users
from envbuild.serve.formdata import BrokenBody, FormData
from envbuild.serve.sandboxes import Entry

ENTRY = web.RequestKey("entry", Entry)
MAX_UPLOAD = web.AppKey("max_upload", int)
_MIB = 1 << 20
_CHUNK = _MIB


class HoldBudget:
    """Bytes all uploads together may hold in memory (``write_stream``'s ``hold``: an
    existing file's new bytes written straight into it at the end, not twice through a
    hidden file): an upload of at most ``one`` bytes takes its length while ``total`` has
    room; otherwise 0 (it streams through a hidden file as before). On the event loop only.

    What is held is gathered in a ``buffer`` that goes back to the budget after the upload
    and is reused while the idle ones stay within ``2 * one``: fresh memory for 10 MiB
    costs ~2,560 page faults and their freeing on every upload, ~5-7 ms of the server's CPU
    (``docs/e2b-files-profile.md``). So at most ``total`` is held, and ``2 * one`` idle."""

    def __init__(self, total: int = 64 << 20, one: int = 16 << 20) -> None:
        self.total, self.one, self.free = total, one, total
        self.idle: list[bytearray] = []  # newest last

    def take(self, length: int | None) -> int:
        if length is None or not 0 < length <= min(self.one, self.free):
            return 0
        self.free -= length
        return length

    def give(self, length: int) -> None:
        self.free += length

    def buffer(self, length: int) -> bytearray:
        """A buffer of at least ``length`` bytes (a share ``take`` gave): the smallest idle
        one that fits, else a new one of whole MiB."""
        fits = [i for i, b in enumerate(self.idle) if len(b) >= length]
        if not fits:
            return bytearray(-(-length // _MIB) * _MIB)
        return self.idle.pop(min(fits, key=lambda i: len(self.idle[i])))

    def keep(self, buf: bytearray) -> None:
        """``buf`` idle for the next upload; the oldest idle ones are freed past
        ``2 * one``."""
        self.idle.append(buf)
        while sum(map(len, self.idle)) > 2 * self.one:
            del self.idle[0]


HOLD = HoldBudget()


class Writer(Protocol):
    """What ``_store`` needs of ``write_stream``'s writer (``runtime_shim``'s
    ``AsyncWriter``, ``envbuild.serve.fleet.FleetWriter``)."""

    @property
    def holding(self) -> bool: ...

    async def write(self, data: bytes | bytearray | memoryview, *, lent: bool = False
                    ) -> None: ...

#: filename="quoted, with \\-escapes" or filename=token, of a Content-Disposition header
_FILENAME = re.compile(r'(?:^|;)\s*filename=(?:"((?:[^"\\]|\\.)*)"|([^;"]+))')


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


async def _user(request: web.Request, entry: Entry) -> users.User:
    try:
        return await users.resolve(entry, request.query.get("username") or None)
    except users.UnknownUser as e:
        raise web.HTTPBadRequest(text=str(e)) from None


def _filename(header: str) -> str | None:
    """The file name of a part's ``Content-Disposition`` as sent (E2B's SDK sends each file's
    absolute path there)."""
    m = _FILENAME.search(header)
    if m is None:
        return None
    return re.sub(r"\\(.)", r"\1", m[1]) if m[1] is not None else m[2].strip()


async def download(request: web.Request) -> web.StreamResponse:
    entry = request[ENTRY]
    path = request.query.get("path")
    if not path:
        return _error(400, "path is required")
    path = users.absolute(path, await _user(request, entry))
    try:
        f = await entry.sandbox.read_stream(path)
    except EnvbuildError as e:
        missing = "No such file" in e.message or "not found" in e.message.lower()
        return _error(404 if missing else 400, f"read {path}: {e.message}")
    with f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = size
        await response.prepare(request)
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the client went away")
        # an empty file has nothing to send (sendfile refuses a count of 0)
        sent = await asyncio.get_running_loop().sendfile(transport, f, 0, size) if size else 0
        if sent < size:  # it shrank while sent: the client must not take it as whole
            transport.close()
        await response.write_eof()
    return response


class _Refused(Exception):
    """An upload refused half-way (nothing of it written): its status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


async def upload(request: web.Request) -> web.Response:
    limit = request.app[MAX_UPLOAD]
    if request.content_length is not None and request.content_length > limit:
        return _error(413, f"upload of {request.content_length} bytes is over {limit}")
    hold = HOLD.take(request.content_length)
    try:
        return await _upload(request, limit, hold)
    finally:
        HOLD.give(hold)


async def _upload(request: web.Request, limit: int, hold: int) -> web.Response:
    entry = request[ENTRY]
    user = await _user(request, entry)
    single = request.query.get("path")
    if request.content_type == "application/octet-stream":
        return await _upload_raw(request, entry, single, user, (limit, hold))
    boundary = parse_mimetype(request.headers.get("Content-Type", "")).parameters.get(
        "boundary", "")
    if request.content_type != "multipart/form-data" or not boundary:
        return _error(400, "the upload must be multipart/form-data")
    form = FormData(request.content, boundary)
    written, total = [], 0
    try:
        while (headers := await form.next_part()) is not None:
            name = single or _filename(headers.get("content-disposition", ""))
            if not name:
                return _error(400, "a file part without a path")
            path = users.absolute(name, user)
            try:
                total = await _store(form.read, entry, path, user, total, (limit, hold))
            except EnvbuildError as e:
                return _error(400, f"write {path}: {e.message}")
            written.append({"name": path.rsplit("/", 1)[-1], "type": "file", "path": path})
    except _Refused as e:
        return _error(e.status, e.message)
    except (BrokenBody, web.RequestPayloadError) as e:
        return _error(400, f"the upload's body is broken: {str(e).strip()[:200]}")
    return web.json_response(written)


async def _upload_raw(request: web.Request, entry: Entry, name: str | None, user: users.User,
                      bounds: tuple[int, int]) -> web.Response:
    """The body is the file (aiohttp has undone a gzip ``Content-Encoding`` on the way)."""
    if not name:
        return _error(400, "an octet-stream upload needs ?path=")
    path = users.absolute(name, user)
    try:
        await _store(request.content.readany, entry, path, user, 0, bounds)
    except _Refused as e:
        return _error(e.status, e.message)
    except EnvbuildError as e:
        return _error(400, f"write {path}: {e.message}")
    return web.json_response([{"name": path.rsplit("/", 1)[-1], "type": "file", "path": path}])


async def _store(read: Callable[[], Awaitable[bytes | memoryview]], entry: Entry, path: str,
                 user: users.User, total: int, bounds: tuple[int, int]) -> int:
    """The pieces of ``read`` (empty at the end) into ``path`` as ``user`` (E2B's envd writes
    as the user: a user's uploads are theirs to change; directories the write made are
    root's); the request's byte count after it. Over ``limit`` or a broken body (a bad gzip
    stream, a malformed part): ``_Refused``, nothing written. An existing file's new bytes,
    held (``bounds``' second, the ``HoldBudget`` share), are gathered in a buffer of the
    budget; others streamed."""
    limit, hold = bounds
    writer = await entry.sandbox.write_stream(path, user=user.spec, hold=hold)
    buf = HOLD.buffer(hold) if hold and writer.holding else None
    try:
        async with writer:  # committed when the part ends; aborted on any error
            if buf is None:
                return await _stream(read, writer, total, limit)
            return await _gather(read, writer, buf, total, limit)
    except asyncio.CancelledError:  # its commit may still be writing from buf, in the executor
        buf = None  # so it is never handed to another upload
        raise
    finally:  # else the commit or abort has returned: the writer is done with the lent buffer
        if buf is not None:
            HOLD.keep(buf)


async def _gather(read: Callable[[], Awaitable[bytes | memoryview]], writer: Writer,
                  buf: bytearray, total: int, limit: int) -> int:
    """The part copied into ``buf`` as it comes and lent to ``writer`` whole at its end,
    which writes it straight into the file at the commit: one copy into warm memory, one
    executor hop. Past ``buf`` (a gzip body larger than its Content-Length): what came so
    far is written (copied) and the rest streamed."""
    view, n = memoryview(buf), 0
    while chunk := await _read(read):
        total = _count(total, len(chunk), limit)
        if n + len(chunk) > len(buf):
            await writer.write(view[:n])
            return await _stream(read, writer, total, limit, chunk)
        view[n:n + len(chunk)] = chunk
        n += len(chunk)
    await writer.write(view[:n], lent=True)
    return total


async def _stream(read: Callable[[], Awaitable[bytes | memoryview]], writer: Writer,
                  total: int, limit: int, first: bytes | memoryview = b"") -> int:
    """``first`` and the pieces of ``read`` gathered up to ``_CHUNK`` and written while the
    next ones are received (so at most two such are held)."""
    writing: asyncio.Future[None] | None = None
    try:
        pieces: list[bytes | memoryview] = [first] if first else []
        held = len(first)
        while chunk := await _read(read):
            total = _count(total, len(chunk), limit)
            pieces.append(chunk)
            held += len(chunk)
            if held >= _CHUNK:
                if writing is not None:
                    await writing
                writing = asyncio.ensure_future(writer.write(b"".join(pieces)))
                pieces, held = [], 0
        if writing is not None:
            await writing
        if pieces:
            await writer.write(b"".join(pieces))
    finally:  # never abort (close the file) while a piece is being written to it
        if writing is not None and not writing.done():
            await asyncio.wait([writing])
    return total


def _count(total: int, more: int, limit: int) -> int:
    if total + more > limit:
        raise _Refused(413, f"upload is over {limit} bytes")
    return total + more


async def _read(read: Callable[[], Awaitable[bytes | memoryview]]) -> bytes | memoryview:
    try:
        return await read()
    except (web.RequestPayloadError, ValueError) as e:  # BrokenBody is a ValueError
        raise _Refused(400, f"the upload's body is broken: {str(e).strip()[:200]}") from None


async def health(request: web.Request) -> web.Response:
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/files", download, allow_head=False)  # sendfile has no HEAD form
    app.router.add_post("/files", upload)
    app.router.add_get("/health", health)
