"""Bounded zstd decompression: a frame never produces more bytes than its reader expects.

Every frame envbuild decompresses (layer data frames, the TOC, lazy reads) has a size the
caller already knows from a verified record (the TOC's ``usize``, the footer's ``toc_usize``).
A hostile blob can pair that with a frame that inflates far beyond it (3 GiB of zeros in a
100 KB frame), or with a frame header whose content size lies. ``decompress_frame`` never
allocates or produces more than ``usize`` bytes:

- the frame header's content size, when present, must equal ``usize`` (checked before any
  output buffer exists: python-zstandard sizes its buffer from the header and *ignores*
  ``max_output_size`` when the header has one);
- without a content size, the output buffer is ``usize`` bytes and a frame that does not end
  within it is refused ("did not decompress full frame").

``frame_size`` finds where the first frame ends from its block headers (RFC 8878 §3.1.1), so a
caller can check a frame ends exactly where its record says without decompressing it twice or
through an unbounded streaming decompressor.
"""

from __future__ import annotations

import zstandard

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class FrameError(ValueError):
    """A frame that does not decompress to what its record says (message names the cause,
    without the layer or the offset: the caller adds them)."""


def decompress_frame(dctx: zstandard.ZstdDecompressor, frame, usize: int,
                     record: str = "the TOC") -> bytes:
    """The first zstd frame of ``frame``, which must decompress to exactly ``usize`` bytes (as
    ``record`` says); never more than ``usize`` bytes of output are allocated. Raises
    ``FrameError``."""
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise FrameError(f"not a zstd frame ({e})") from None
    if declared != -1 and declared != usize:
        raise FrameError(f"its header declares {declared} bytes, {record} says {usize}")
    try:
        # max(…, 1): 0 means "no limit" to python-zstandard
        out = dctx.decompress(frame, max_output_size=max(usize, 1))
    except zstandard.ZstdError as e:
        if "did not decompress full frame" in str(e):
            raise FrameError(f"it inflates to more than the {usize} bytes {record} says") \
                from None
        raise FrameError(f"it does not decompress ({e})") from None
    if len(out) != usize:
        raise FrameError(f"it decompresses to {len(out)} bytes, {record} says {usize}")
    return out


def frame_size(buf) -> int:
    """Length of the zstd frame at the start of ``buf``, read from its header and block
    headers (no decompression). Raises ``FrameError`` if ``buf`` is not a frame or ends
    inside it."""
    view = memoryview(buf)
    if bytes(view[:4]) != _ZSTD_MAGIC:
        raise FrameError("not a zstd frame (bad magic)")
    try:
        pos = zstandard.frame_header_size(view)
    except zstandard.ZstdError as e:
        raise FrameError(f"bad frame header ({e})") from None
    n = len(view)
    checksum = view[4] & 0x04
    while True:
        if pos + 3 > n:
            raise FrameError("it ends inside a block header (truncated frame)")
        header = view[pos] | view[pos + 1] << 8 | view[pos + 2] << 16
        kind = (header >> 1) & 3
        if kind == 3:
            raise FrameError("a block of the reserved type")
        pos += 3 + (1 if kind == 1 else header >> 3)  # an RLE block stores one byte
        if header & 1:  # last block
            break
    if checksum:
        pos += 4
    if pos > n:
        raise FrameError("it ends past its buffer (truncated frame)")
    return pos
