"""Frame planning: where the tar stream is cut into independent zstd frames. Pure.

The writer feeds a ``FramePlanner`` each member's header length and data length just before
writing it and gets back the tar offsets at which a new frame starts. ``plan_frames`` runs the
same rules over a whole list, for tests and for reasoning about a layout.

``lazy`` (default): a regular file of at least ``small_file`` bytes gets frames of its own: a cut
at the first byte of its contents, every ``max_frame`` bytes inside them and at their end.
Everything else (tar headers, padding, smaller files) goes into shared frames, which are cut
before a member's header once they hold ``shared_frame`` bytes. Reading a big file therefore
decompresses exactly its own bytes; reading a small one at most one shared frame.

``compact``: cut before a member's header once the frame holds ``max_frame`` bytes, and inside
a file's contents whenever the frame reaches ``max_frame``: ~4 MiB frames that start at file
boundaries where they can.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from envbuild.layers._tar import BLOCK

MiB = 1 << 20
KiB = 1 << 10


@dataclasses.dataclass(frozen=True)
class Framing:
    """Tunable parameters of a framing; recorded only as ``framing`` (its name) in the TOC."""

    name: str = "lazy"
    small_file: int = 16 * KiB
    shared_frame: int = 256 * KiB
    max_frame: int = 4 * MiB

    @classmethod
    def named(cls, name: str) -> Framing:
        if name == "lazy":
            return cls()
        if name == "compact":
            return cls(name="compact")
        raise ValueError(f"unknown framing {name!r} (expected 'lazy' or 'compact')")


class FramePlanner:
    def __init__(self, framing: Framing) -> None:
        self.f = framing
        self.pos = 0          # tar offset of the next byte
        self.frame_start = 0  # tar offset where the current frame began

    def _cut(self, at: int, cuts: list[int]) -> None:
        if at > self.frame_start:
            cuts.append(at)
            self.frame_start = at

    def member(self, header_len: int, data_len: int, is_file: bool) -> list[int]:
        """Cut offsets (ascending, absolute tar offsets) for the next member's bytes."""
        f = self.f
        cuts: list[int] = []
        limit = f.max_frame if f.name == "compact" else f.shared_frame
        if self.pos - self.frame_start >= limit:
            self._cut(self.pos, cuts)
        self.pos += header_len
        if f.name == "lazy" and is_file and data_len >= f.small_file:
            self._cut(self.pos, cuts)
            end = self.pos + data_len
            while end - self.frame_start > f.max_frame:
                self._cut(self.frame_start + f.max_frame, cuts)
            self._cut(end, cuts)
        elif data_len:
            end = self.pos + data_len
            while end - self.frame_start > f.max_frame:
                self._cut(self.frame_start + f.max_frame, cuts)
        self.pos += data_len + (-data_len % BLOCK)
        return cuts

    def end(self, trailer_len: int) -> list[int]:
        """Cuts for the end-of-archive blocks, then the final boundary (the tar's length)."""
        self.pos += trailer_len
        cuts: list[int] = []
        self._cut(self.pos, cuts)
        return cuts


def plan_frames(members: Iterable[tuple[int, int, bool]], framing: Framing,
                trailer_len: int = 2 * BLOCK) -> list[tuple[int, int]]:
    """Frames as ``(uoffset, usize)`` for members given as ``(header_len, data_len, is_file)``."""
    p = FramePlanner(framing)
    cuts: list[int] = []
    for h, d, is_file in members:
        cuts.extend(p.member(h, d, is_file))
    cuts.extend(p.end(trailer_len))
    starts = [0, *cuts[:-1]]
    return [(s, e - s) for s, e in zip(starts, cuts)]
