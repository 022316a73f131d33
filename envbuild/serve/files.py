"""envd's HTTP endpoints: ``GET /files`` (download), ``POST /files`` (multipart upload, one or
many files; at most ``max_upload`` bytes a request) and ``GET /health``."""

from __future__ import annotations

import re

from aiohttp import web

from envbuild.errors import EnvbuildError
from envbuild.serve import users
from envbuild.serve.sandboxes import Entry

ENTRY = web.RequestKey("entry", Entry)
MAX_UPLOAD = web.AppKey("max_upload", int)
_CHUNK = 1 << 20
#: filename="quoted, with \\-escapes" or filename=token, of a Content-Disposition header
_FILENAME = re.compile(r'(?:^|;)\s*filename=(?:"((?:[^"\\]|\\.)*)"|([^;"]+))')


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"code": status, "message": message}, status=status)


async def _user(request: web.Request, entry: Entry) -> users.User:
    try:
        return await users.resolve(entry, request.query.get("username") or None)
    except users.UnknownUser as e:
        raise web.HTTPBadRequest(text=str(e)) from None


def _filename(part: object) -> str | None:
    """The part's file name as sent (aiohttp's ``filename`` drops a leading ``/``; E2B's SDK
    sends each file's absolute path there)."""
    header = getattr(part, "headers", {}).get("Content-Disposition", "")
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
        data = await entry.sandbox.read_file(path)
    except EnvbuildError as e:
        missing = "No such file" in e.message or "not found" in e.message.lower()
        return _error(404 if missing else 400, f"read {path}: {e.message}")
    return web.Response(body=data, content_type="application/octet-stream")


async def upload(request: web.Request) -> web.Response:
    entry = request[ENTRY]
    limit = request.app[MAX_UPLOAD]
    if request.content_length is not None and request.content_length > limit:
        return _error(413, f"upload of {request.content_length} bytes is over {limit}")
    user = await _user(request, entry)
    single = request.query.get("path")
    try:
        reader = await request.multipart()
    except (AssertionError, ValueError):
        return _error(400, "the upload must be multipart/form-data")
    written, total = [], 0
    while (part := await reader.next()) is not None:
        name = single or _filename(part)
        if not name:
            return _error(400, "a file part without a path")
        buf = bytearray()
        while chunk := await part.read_chunk(_CHUNK):  # type: ignore[union-attr]
            total += len(chunk)
            if total > limit:
                return _error(413, f"upload is over {limit} bytes")
            buf += chunk
        path = users.absolute(name, user)
        try:
            await entry.sandbox.write_file(path, bytes(buf))
            await _give(entry, path, user)
        except EnvbuildError as e:
            return _error(400, f"write {path}: {e.message}")
        written.append({"name": path.rsplit("/", 1)[-1], "type": "file", "path": path})
    return web.json_response(written)


async def _give(entry: Entry, path: str, user: users.User) -> None:
    """Make ``path`` the user's, as E2B's envd writes it (``write_file`` writes as root): a
    user's uploads are theirs to change. Directories the write created stay root's."""
    if user.spec.partition(":")[0] == "0":
        return
    r = await entry.sandbox.exec(["chown", user.spec, "--", path], user="0:0", timeout=30)
    if r.exit_code != 0:
        raise EnvbuildError(f"chown {user.spec} {path}: "
                            f"{r.stderr.decode(errors='replace').strip()[-200:]}")


async def health(request: web.Request) -> web.Response:
    return web.Response(status=204)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/files", download)
    app.router.add_post("/files", upload)
    app.router.add_get("/health", health)
