"""Which files the native filler fills with the one a reader opened: those that follow it in
the layer's blob (tar order: a package's modules, a library's neighbours), within a miss
window (``MISS_WINDOW`` compressed bytes, files up to ``WINDOW_MAX_FILE``).

A window follows only the open of a Python file (``.py``, ``.pyc``: ``window_before``, the
window claimed before the opened file is read) or of a script (its first bytes ``#!``:
``window_after``). Measured on ``benchmarks/cold_start.py``'s cold run (objects a sandbox
closed after reading them, by inotify): windows filled 2,446 objects (47 MB) of which 418
(12 MB) were read; those after the opens of ELF files (their libraries are predicted:
``elfdeps``) and data files (locales, terminfo, zoneinfo, ``entry_points.txt``) filled 607
and 19 of them were read, while a Python file's or a script's window (a package's next
modules; ``bin/py.test``: 121 of its 125) holds the reads. Even so, after ``.pyc`` opens
windows filled 1,153 objects and 212 were read: tar order runs on from the package's
``__pycache__`` into its stubs, data files and subpackages, so a module's window takes only
its package directory's modules and subpackages' ``__init__`` (``_home``; the imports a
pyc runs are ``pydeps``' predictions): objects filled a cold run ~2,770 -> ~1,660, 57.7 ->
50.3 MB on the link, ~15 more opens waiting for a fill (docs/lazy-loading.md, Measured).
Each object filled costs the filler ~0.1 ms of CPU and its bytes' decompression, hashing
and write.

The order comes from the layer's tree (``tree_of``), the one decode of its TOC the filler
makes: the same tree serves the predictions (``fillhints``); no ``Entry`` is decoded for a
file until it is filled."""

from __future__ import annotations

import re
import stat
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from envbuild.oci import DIGEST_PATTERN, is_hex64

#: Compressed bytes a window spans: the opened file plus the files that follow it in tar
#: order. About one bandwidth-delay product of a busy cell's link (1 Gbit/s x 10 ms =
#: 1.25 MB): the extra bytes cost about one more round trip's time, and a program that opens
#: the neighbours next (an import, a test run, ``grep -r``) finds them without a request.
MISS_WINDOW = 1 << 20
#: Files larger than this end a window (they are filled when opened).
WINDOW_MAX_FILE = 1 << 20
#: Files one window fills at most besides the opened one: each is an object to write, sync
#: and unmark (~0.3 ms here), and the window's readers wait for all of its sync. A 1 MiB
#: window of 1 KiB files was ~1,700 of them: 0.5 s before the opened file's neighbours
#: could be read (a cat of 50 files took 0.22 s against 0.09 s over FUSE).
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
    usize)`` of each, in blob order). A file whose digest is no object's name
    (``sha256:<64 hex>``) is left out: the digests are checked all at once (one match over
    them joined, ``_ALL_OBJECTS``), each alone only when that fails (a hostile TOC)."""

    def __init__(self, nodes: Iterable[Any], frames: Sequence[tuple[int, int]]) -> None:
        ends: dict[int, int] = {}
        offset = 0
        for csize, _usize in frames:
            ends[offset] = offset = offset + csize
        seen: set[int] = set()
        rows: list[Any] = []
        ifmt, ifreg = stat.S_IFMT, stat.S_IFREG
        for n in nodes:
            if not n.frames or ifmt(n.mode) != ifreg or id(n) in seen:
                continue
            seen.add(id(n))
            rows.append(n)
        if rows and _ALL_OBJECTS.fullmatch("\n".join([n.digest for n in rows])) is None:
            rows = [n for n in rows if n.digest.startswith("sha256:") and is_hex64(n.digest[7:])]
        get_end = ends.get
        placed = [(n.frames[0], end, n) for n in rows
                  if (end := get_end(n.frames[-1])) is not None]
        placed.sort(key=_first)
        self._rows = placed
        # a window's ``FileRef``s are made when first returned (most files are in none)
        self._refs: list[FileRef | None] = [None] * len(placed)
        self.index = {n.read_path: i for i, (_s, _e, n) in enumerate(placed)}

    @property
    def files(self) -> list[FileRef]:
        """Every file, in blob order."""
        return [self._ref(k) for k in range(len(self._rows))]

    def _ref(self, k: int) -> FileRef:
        got = self._refs[k]
        if got is None:
            start, end, n = self._rows[k]
            got = self._refs[k] = FileRef(n.read_path, n.digest[7:], n.size, start, end)
        return got

    def after(self, path: str, window: int = MISS_WINDOW, max_file: int = WINDOW_MAX_FILE,
              max_files: int = MAX_WINDOW_FILES) -> list[FileRef]:
        """The files after ``path`` whose frames end within ``window`` compressed bytes of
        its first frame's start, at most ``max_files``; the first file over ``max_file``
        bytes ends the window."""
        i = self.index.get(path)
        if i is None:
            return []
        rows, refs = self._rows, self._refs
        start, home = rows[i][0], _home(path)
        out: list[FileRef] = []
        for k in range(i + 1, len(rows)):
            _first_frame, end, n = rows[k]
            if end - start > window or len(out) >= max_files:
                break
            if home is not None and not _module_of(home, n.read_path):
                if not n.read_path.startswith(home):
                    break   # past the package's directory
                continue    # a subpackage's or a data file: read mostly never
            if n.size > max_file:
                break
            out.append(refs[k] or self._ref(k))
        return out


def window_before(path: str) -> bool:
    """Whether an open of ``path`` (a TOC path) is followed by its window, claimed before
    the opened file is read: a Python module's (its package's next modules)."""
    return path.endswith((".py", ".pyc"))


def window_after(data: bytes) -> bool:
    """Whether an open of a file whose bytes are ``data`` (not a Python module) is
    followed by its window: a script's (``#!``: a console script, its package after it)."""
    return data.startswith(b"#!")


def _home(path: str) -> str | None:
    """The directory whose modules a window after ``path`` takes: a Python module's
    package directory (``pkg/`` for ``pkg/x.py`` and ``pkg/__pycache__/x.TAG.pyc``); None
    (every file) after a script."""
    if not path.endswith((".py", ".pyc")):
        return None
    head = path.rpartition("/")[0].removesuffix("__pycache__").removesuffix("/")
    return head + "/" if head else ""


def _module_of(home: str, path: str) -> bool:
    """Whether ``path`` is a module of the package directory ``home`` (its ``.py``, its
    ``__pycache__`` pycs, its extension modules) or a subpackage's ``__init__`` (imported
    lazily, inside functions: ``pydeps`` misses them), not a subpackage's module or data."""
    if not path.startswith(home) or not path.endswith((".py", ".pyc", ".so")):
        return False
    _sub, _, rest = path[len(home):].removeprefix("__pycache__/").partition("/")
    rest = rest.removeprefix("__pycache__/")
    return not rest or rest.startswith("__init__.") and "/" not in rest


#: Digests joined by newlines, each an object's name.
_ALL_OBJECTS = re.compile(f"{DIGEST_PATTERN}(?:\\n{DIGEST_PATTERN})*")


def _first(row: tuple[int, int, Any]) -> int:
    return row[0]


__all__ = ["MAX_WINDOW_FILES", "MISS_WINDOW", "WINDOW_MAX_FILE", "FileRef", "LayerOrder",
           "window_after", "window_before"]
