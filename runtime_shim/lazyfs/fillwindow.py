"""Which files the native filler fills with the one a reader opened: those that follow it in
the layer's blob (tar order: a package's modules, a library's neighbours), within the FUSE
mode's miss window (``frames.MISS_WINDOW`` compressed bytes, files up to
``frames.WINDOW_MAX_FILE``; one copy of those figures).

The order comes from the layer's tree (``tree_of``), the one decode of its TOC the filler
makes: the same tree serves the predictions (``fillhints``); no ``Entry`` is decoded for a
file until it is filled."""

from __future__ import annotations

import stat
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from envbuild.oci import is_hex64
from runtime_shim.lazyfs.frames import MISS_WINDOW, WINDOW_MAX_FILE

#: Files one window fills at most besides the opened one: each is an object to write, sync
#: and unmark (~0.3 ms here), and the window's readers wait for all of its sync. A 1 MiB
#: window of 1 KiB files was ~1,700 of them: 0.5 s before the opened file's neighbours
#: could be read (a cat of 50 files 0.22 s against 0.09 s in the FUSE mode).
MAX_WINDOW_FILES = 128


class FileRef(NamedTuple):
    """A regular file of a layer to fill: its TOC path, its object, its size, and where its
    frames lie in the blob (``start``: the first's offset, ``end``: past the last's)."""

    path: str
    hexd: str
    size: int
    start: int = 0
    end: int = 0


class LayerOrder:
    """The regular files of a layer in blob order (pure): from its tree's nodes
    (``tree_of``; a hardlinked file once) and the TOC's frames (``Toc.frames``: ``(csize,
    usize)`` of each, in blob order)."""

    def __init__(self, nodes: Iterable[Any], frames: Sequence[tuple[int, int]]) -> None:
        ends: dict[int, int] = {}
        offset = 0
        for csize, _usize in frames:
            ends[offset] = offset = offset + csize
        seen: set[int] = set()
        files = []
        for n in nodes:
            if not n.frames or not stat.S_ISREG(n.mode) or id(n) in seen \
                    or not n.digest.startswith("sha256:") or not is_hex64(n.digest[7:]):
                continue
            seen.add(id(n))
            end = ends.get(n.frames[-1])
            if end is not None:
                files.append(FileRef(n.read_path, n.digest[7:], n.size, n.frames[0], end))
        files.sort(key=lambda f: f.start)
        self.files: Sequence[FileRef] = files
        self.index = {f.path: i for i, f in enumerate(files)}

    def after(self, path: str, window: int = MISS_WINDOW, max_file: int = WINDOW_MAX_FILE,
              max_files: int = MAX_WINDOW_FILES) -> list[FileRef]:
        """The files after ``path`` whose frames end within ``window`` compressed bytes of
        its first frame's start, at most ``max_files``; the first file over ``max_file``
        bytes ends the window."""
        i = self.index.get(path)
        if i is None:
            return []
        start = self.files[i].start
        out: list[FileRef] = []
        for f in self.files[i + 1:]:
            if f.end - start > window or f.size > max_file or len(out) >= max_files:
                break
            out.append(f)
        return out


__all__ = ["MAX_WINDOW_FILES", "MISS_WINDOW", "WINDOW_MAX_FILE", "FileRef", "LayerOrder"]
