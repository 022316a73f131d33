"""Parse a tar stream delivered as a sequence of decompressed frames (no copies of file data)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from envbuild.layers._tar import (
    BLOCK,
    MAX_PAX_HEADER,
    ZERO_BLOCK,
    TarFormatError,
    make_entry,
    parse_pax,
    parse_ustar,
)
from envbuild.layers._toc import Entry


class TarStream:
    """Sequential reader over frames; ``offset`` is the tar offset of the next unread byte."""

    def __init__(self, frames: Iterable[bytes | memoryview]) -> None:
        self._it = iter(frames)
        self._buf = memoryview(b"")
        self._pos = 0
        self.offset = 0

    def _fill(self) -> bool:
        nxt = next(self._it, None)
        if nxt is None:
            return False
        self._buf = memoryview(nxt)
        self._pos = 0
        return True

    def read(self, n: int) -> bytes | memoryview:
        """Exactly ``n`` bytes (fewer only at the end of the stream)."""
        buf, pos = self._buf, self._pos
        if pos + n <= len(buf):
            self._pos = pos + n
            self.offset += n
            return buf[pos:pos + n]
        parts = []
        for piece in self.pieces(n):
            parts.append(bytes(piece))
        return b"".join(parts)

    def pieces(self, n: int) -> Iterator[memoryview]:
        """Up to ``n`` bytes as views into the frames (stops early at the end of the stream)."""
        while n:
            avail = len(self._buf) - self._pos
            if not avail:
                if not self._fill():
                    return
                continue
            k = min(avail, n)
            piece = self._buf[self._pos:self._pos + k]
            self._pos += k
            self.offset += k
            n -= k
            yield piece

    def skip(self, n: int) -> int:
        done = 0
        for piece in self.pieces(n):
            done += len(piece)
        return done

    def rest(self) -> Iterator[memoryview]:
        """Everything left in the stream."""
        while True:
            if self._pos < len(self._buf):
                piece = self._buf[self._pos:]
                self.offset += len(piece)
                self._pos = len(self._buf)
                yield piece
            if not self._fill():
                return


class Truncated(TarFormatError):
    pass


def skip_pad(stream: TarStream, size: int) -> None:
    """Skip the padding after ``size`` bytes of member data (to the next 512-byte block)."""
    pad = -size % BLOCK
    if pad and stream.skip(pad) != pad:
        raise Truncated("tar stream ends inside member padding")


def read_pax_header(stream: TarStream, size: int) -> dict:
    """The records of a PAX ``x`` header whose data (``size`` bytes, padded) comes next; an
    oversized one is refused before it is read."""
    if size > MAX_PAX_HEADER:
        raise TarFormatError("extended header too large")
    data = bytes(stream.read(size + (-size % BLOCK)))
    if len(data) < size:
        raise Truncated("tar stream ends inside an extended header")
    return parse_pax(data[:size])


def iter_members(stream: TarStream) -> Iterator[tuple[Entry, int]]:
    """Yield ``(entry, data_offset)`` per member. The consumer must read exactly ``entry.size``
    bytes of data from ``stream`` before asking for the next member; padding is skipped here.
    Stops after the first zero block (the end-of-archive marker)."""
    pax = None
    while True:
        hdr = stream.read(BLOCK)
        if len(hdr) < BLOCK:
            raise Truncated("tar stream ends without an end-of-archive marker")
        if hdr == ZERO_BLOCK:
            if pax is not None:
                raise TarFormatError("extended header without a member")
            return
        flag, fields = parse_ustar(bytes(hdr))
        if flag == b"x":
            pax = read_pax_header(stream, fields["size"])
            continue
        if flag in (b"g", b"L", b"K"):
            raise TarFormatError(f"unsupported tar member type {flag!r} (not a v1 layer)")
        entry = make_entry(flag, fields, pax)
        pax = None
        if entry.type in ("char", "block", "fifo") and fields["size"]:
            # a device header's size field must be zero; anything else is not a v1 tar
            raise TarFormatError(f"{entry.type} member {entry.path!r} has data")
        start = stream.offset
        yield entry, start
        size = entry.size
        if stream.offset != start + size:
            raise Truncated("tar stream ends inside member data")
        pad = -size % BLOCK
        if pad and stream.skip(pad) != pad:
            raise Truncated("tar stream ends inside member data")
