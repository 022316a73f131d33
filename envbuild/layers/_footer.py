"""The fixed-size footer and the skippable frames that carry the TOC and the footer.

Footer = the last ``FOOTER_SIZE`` (80) bytes of every layer blob, a zstd skippable frame::

    offset size  field (little-endian)
         0    4  skippable frame magic 0x184D2A5E
         4    4  payload length = 72
         8    8  footer magic b"EBLAYER\\0"
        16    4  format version (1)
        20    4  flags (0; readers reject other values in v1)
        24    8  toc_offset: blob offset of the TOC skippable frame (its 8-byte header)
        32    8  toc_csize: length of the compressed TOC (the TOC frame's payload)
        40    8  toc_usize: length of the uncompressed TOC JSON
        48   32  toc_sha256: sha256 of the compressed TOC bytes (the payload)

The TOC frame is ``magic 0x184D2A5E, u32 toc_csize, zstd(TOC JSON)`` and ends exactly where
the footer starts. Future versions keep the footer's size and the position of magic and version,
so any reader can name the version it does not understand.
"""

from __future__ import annotations

import dataclasses
import struct

SKIPPABLE_MAGIC = 0x184D2A5E
FOOTER_MAGIC = b"EBLAYER\0"
FORMAT_VERSION = 1
FOOTER_SIZE = 80
_SKIP = struct.Struct("<II")
_FOOTER = struct.Struct("<II8sIIQQQ32s")
assert _FOOTER.size == FOOTER_SIZE


class FooterError(ValueError):
    """Bad footer bytes; ``unsupported`` is set when only the version is unknown."""

    def __init__(self, message: str, unsupported: bool = False) -> None:
        super().__init__(message)
        self.unsupported = unsupported


@dataclasses.dataclass(frozen=True)
class Footer:
    toc_offset: int
    toc_csize: int
    toc_usize: int
    toc_sha256: bytes
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        return _FOOTER.pack(SKIPPABLE_MAGIC, FOOTER_SIZE - 8, FOOTER_MAGIC, self.version, 0,
                            self.toc_offset, self.toc_csize, self.toc_usize, self.toc_sha256)

    @classmethod
    def decode(cls, data: bytes) -> Footer:
        if len(data) != FOOTER_SIZE:
            raise FooterError(f"footer is {len(data)} bytes, expected {FOOTER_SIZE} "
                              "(truncated blob?)")
        skip, length, magic, version, flags, off, csize, usize, sha = _FOOTER.unpack(data)
        if skip != SKIPPABLE_MAGIC or length != FOOTER_SIZE - 8 or magic != FOOTER_MAGIC:
            raise FooterError("no envbuild layer footer at the end of the blob "
                              "(wrong magic: truncated, or not an envbuild layer)")
        if version != FORMAT_VERSION:
            raise FooterError(f"unsupported layer format version {version} "
                              f"(this reader knows {FORMAT_VERSION})", unsupported=True)
        if flags != 0:
            raise FooterError(f"unknown footer flags {flags:#x}")
        return cls(toc_offset=off, toc_csize=csize, toc_usize=usize, toc_sha256=sha,
                   version=version)

    @property
    def blob_size(self) -> int:
        return self.toc_offset + 8 + self.toc_csize + FOOTER_SIZE


def skippable_header(length: int) -> bytes:
    return _SKIP.pack(SKIPPABLE_MAGIC, length)


def parse_skippable_header(data: bytes) -> tuple[int, int]:
    return _SKIP.unpack(data)
