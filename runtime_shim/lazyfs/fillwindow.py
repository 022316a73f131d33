"""Which files the native filler fills with the one a reader opened: those that follow it in
the layer's blob (tar order: a package's modules, a library's neighbours), within the FUSE
mode's miss window (``frames.MISS_WINDOW`` compressed bytes, files up to
``frames.WINDOW_MAX_FILE``; one copy of those figures)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from envbuild.oci import is_hex64
from runtime_shim.lazyfs.frames import MISS_WINDOW, WINDOW_MAX_FILE

#: Files one window fills at most besides the opened one: each is an object to write, sync
#: and unmark (~0.3 ms here), and the window's readers wait for all of its sync. A 1 MiB
#: window of 1 KiB files was ~1,700 of them: 0.5 s before the opened file's neighbours
#: could be read (a cat of 50 files 0.22 s against 0.09 s in the FUSE mode).
MAX_WINDOW_FILES = 128


class LayerOrder:
    """The regular files of a layer (TOC ``Entry``s) in blob order (pure)."""

    def __init__(self, entries: Iterable[Any]) -> None:
        files = [e for e in entries if e.type == "file" and e.chunks and e.digest
                 and e.digest.startswith("sha256:") and is_hex64(e.digest[7:])]
        files.sort(key=lambda e: e.chunks[0].offset)
        self.files: Sequence[Any] = files
        self.index = {e.path: i for i, e in enumerate(files)}

    def after(self, path: str, window: int = MISS_WINDOW, max_file: int = WINDOW_MAX_FILE,
              max_files: int = MAX_WINDOW_FILES) -> list[Any]:
        """The files after ``path`` whose frames end within ``window`` compressed bytes of
        its first frame's start, at most ``max_files``; the first file over ``max_file``
        bytes ends the window."""
        i = self.index.get(path)
        if i is None:
            return []
        start = self.files[i].chunks[0].offset
        out: list[Any] = []
        for e in self.files[i + 1:]:
            last = e.chunks[-1]
            if last.offset + last.csize - start > window or e.size > max_file \
                    or len(out) >= max_files:
                break
            out.append(e)
        return out


__all__ = ["MAX_WINDOW_FILES", "MISS_WINDOW", "WINDOW_MAX_FILE", "LayerOrder"]
