"""A ``multipart/form-data`` body read part by part as it arrives, each part's bytes handed
on in the pieces the connection delivered (slices of them, not copies).

aiohttp's own ``BodyPartReader.read_chunk`` copies every byte three to four times on the
way (joining the stream's buffers, joining each piece with the one before to look for the
boundary, cutting it apart again); for a 10 MiB upload that was a third of the server's CPU.
Here the boundary is looked for in each piece where it lies, and only the few bytes a
boundary could straddle between two pieces are ever joined.
"""

from __future__ import annotations

from typing import Protocol

#: the most bytes before the first part, or of one part's header block
MAX_HEAD = 16 << 10


class BrokenBody(ValueError):
    """The body is not well-formed multipart (or ends before its last boundary)."""


class Source(Protocol):
    async def readany(self) -> bytes: ...


class FormData:
    """The parts of a ``multipart/form-data`` body: ``await next_part()`` gives a part's
    headers (lower-case names; None after the last part), then ``await read()`` its bytes in
    pieces until it returns an empty one."""

    def __init__(self, source: Source, boundary: str) -> None:
        if not boundary or len(boundary) > 200:
            raise BrokenBody("no usable boundary in the Content-Type")
        self._source = source
        # every delimiter follows a CRLF; the first may start the body: begin with one
        self._delim = b"\r\n--" + boundary.encode("latin-1")
        self._buf, self._pos = b"\r\n", 0
        self._in_part = False
        self._done = False

    async def _more(self) -> None:
        """The unread bytes with the connection's next piece after them."""
        chunk = await self._source.readany()
        if not chunk:
            raise BrokenBody("the body ended before its closing boundary")
        self._buf, self._pos = self._buf[self._pos:] + chunk, 0

    async def _find(self, needle: bytes, within: int) -> int:
        """The index in the buffer of ``needle`` (read on until it comes, at most
        ``within`` bytes after the read position)."""
        while (i := self._buf.find(needle, self._pos)) < 0:
            if len(self._buf) - self._pos > within:
                raise BrokenBody(f"no {needle!r} within {within} bytes")
            await self._more()
        if i - self._pos > within:
            raise BrokenBody(f"no {needle!r} within {within} bytes")
        return i

    async def next_part(self) -> dict[str, str] | None:
        """The next part's headers, past what is left of the current part; None at the end."""
        if self._done:
            return None
        while self._in_part:
            await self.read()
        self._pos = await self._find(self._delim, MAX_HEAD) + len(self._delim)
        while len(self._buf) - self._pos < 2:
            await self._more()
        if self._buf[self._pos:self._pos + 2] == b"--":
            self._done = True
            return None
        end = await self._find(b"\r\n\r\n", MAX_HEAD)
        block = self._buf[self._pos:end].decode("utf-8", "replace")
        self._pos = end + 4
        headers: dict[str, str] = {}
        for line in block.split("\r\n")[1:]:  # the first is the delimiter line's rest
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        self._in_part = True
        return headers

    async def read(self) -> bytes | memoryview:
        """The current part's next piece (a slice of what arrived); empty at its end."""
        if not self._in_part:
            return b""
        keep = len(self._delim) - 1  # a delimiter's head may end the buffer
        while True:
            i = self._buf.find(self._delim, self._pos)
            if i >= 0:
                piece, self._pos = memoryview(self._buf)[self._pos:i], i
                self._in_part = bool(piece)
                return piece if piece else b""
            safe = len(self._buf) - keep
            if safe > self._pos:
                piece, self._pos = memoryview(self._buf)[self._pos:safe], safe
                return piece
            if rest := await self._next_piece(keep):
                return rest

    async def _next_piece(self, keep: int) -> bytes:
        """The connection's next piece in the buffer; the bytes left before it (fewer than
        ``keep``) if no delimiter starts in them (they are the part's), else b"" and they
        stay, joined with it (at a part's end only: no copy of the bulk)."""
        rest = self._buf[self._pos:]
        chunk = await self._source.readany()
        if not chunk:
            raise BrokenBody("the body ended before its closing boundary")
        if len(chunk) < keep or 0 <= (rest + chunk[:keep]).find(self._delim) < len(rest):
            self._buf, self._pos = rest + chunk, 0
            return b""
        self._buf, self._pos = chunk, 0
        return rest
