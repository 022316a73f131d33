"""What an executable or shared library will open next: its ELF interpreter and the libraries
it needs, found in the stack's lazy layers and fetched before the dynamic loader asks.

A first command is a chain of misses: ``execve`` opens the program, the kernel then its
interpreter (``PT_INTERP``), which opens ``/etc/ld.so.cache`` and each ``DT_NEEDED`` library
one after the other — every open a round trip to the store on a cold node. Those names are in the
bytes the filler has just filled, so once a program's (or library's) file is filled, the
filler looks them up in the stack the layer was mounted with (top layer first, symlinks
followed within the stack, the loader's default directories) and fills them in the
background (``fillhints``): the loader's opens then find them filled or in flight. Nothing is fetched that
the loader would not open (no guessing beyond its own search of the default directories), so
the bytes are those of the misses it replaces.

Hostile input: the ELF bytes come from a verified layer but may be anything; ``parse`` reads
at most ``MAX_PHDRS`` program headers, ``MAX_DYN`` dynamic entries and ``MAX_NAMES`` names of
at most 255 bytes, never outside the buffer, and returns nothing for anything that is not a
64-bit little-endian ELF. Lookups follow at most ``MAX_HOPS`` symlinks and walk at most
``MAX_STEPS`` path components, and never leave the stack's trees (paths are table keys,
never opened).
"""

from __future__ import annotations

import posixpath
import stat
import struct
from collections.abc import Sequence
from typing import Any

MAX_PHDRS = 64
MAX_DYN = 2048
MAX_NAMES = 64
MAX_HOPS = 16
MAX_STEPS = 4096   # path components walked per lookup, over all hops (a hostile long target)
#: Where the loader looks for a needed library without a cache entry or run path (x86_64,
#: Debian multiarch first): a name is looked up in these, in order.
LIBRARY_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64",
                "lib", "usr/lib")
#: The dynamic loader's cache of library locations: it opens it to find needed libraries.
LOADER_CACHE = "etc/ld.so.cache"
_PT_LOAD, _PT_DYNAMIC, _PT_INTERP = 1, 2, 3
_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_RPATH, _DT_RUNPATH = 0, 1, 5, 15, 29
#: Directories of one run path (``DT_RUNPATH``/``DT_RPATH``) searched at most.
MAX_RUN_DIRS = 16
_PHDR = struct.Struct("<IIQQQQQQ")
_DYN = struct.Struct("<qQ")


def parse(data: bytes | bytearray) -> tuple[str, list[str]]:
    """``(interpreter, needed libraries)`` of a 64-bit little-endian ELF file (``""`` and
    ``[]`` when it has none, or is no such ELF, or is malformed). Bounded (module docstring)."""
    interp, needed, _run = parse_dynamic(data)
    return interp, needed


def parse_dynamic(data: bytes | bytearray) -> tuple[str, list[str], list[str]]:
    """``parse`` and the file's run path: the directories of its ``DT_RUNPATH`` (else its
    ``DT_RPATH``), as written (``$ORIGIN`` unexpanded), at most ``MAX_RUN_DIRS``."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return "", [], []
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    if phentsize != _PHDR.size or phnum > MAX_PHDRS or phoff + phnum * phentsize > len(data):
        return "", [], []
    interp, dynamic, loads = "", None, []
    for i in range(phnum):
        p_type, _, off, vaddr, _, filesz, _, _ = _PHDR.unpack_from(data, phoff + i * phentsize)
        if p_type == _PT_INTERP and 0 < filesz <= 256 and off + filesz <= len(data):
            interp = _cstr(data, off, off + filesz)
        elif p_type == _PT_DYNAMIC:
            dynamic = (off, min(filesz, MAX_DYN * _DYN.size))
        elif p_type == _PT_LOAD:
            loads.append((vaddr, off, filesz))
    if dynamic is None:
        return interp, [], []
    off, size = dynamic
    strtab: int | None = None
    needed: list[int] = []
    run: dict[int, int] = {}   # tag -> string offset
    for k in range(size // _DYN.size):
        pos = off + k * _DYN.size
        if pos + _DYN.size > len(data):
            break
        tag, val = _DYN.unpack_from(data, pos)
        if tag == _DT_NULL:
            break
        if tag == _DT_STRTAB:
            strtab = val
        elif tag == _DT_NEEDED and len(needed) < MAX_NAMES:
            needed.append(val)
        elif tag in (_DT_RPATH, _DT_RUNPATH):
            run[tag] = val
    base = next((o + strtab - v for v, o, n in loads if strtab is not None
                 and v <= strtab < v + n), None)
    if base is None:
        return interp, [], []
    names = [_cstr(data, base + n, base + n + 256) for n in needed if base + n < len(data)]
    where = run.get(_DT_RUNPATH, run.get(_DT_RPATH))   # RUNPATH set: RPATH is ignored
    dirs = _cstr(data, base + where, base + where + 1024).split(":") \
        if where is not None and base + where < len(data) else []
    return interp, [n for n in names if n and "/" not in n], [d for d in dirs if d][:MAX_RUN_DIRS]


def _cstr(data: bytes | bytearray, start: int, end: int) -> str:
    raw = data[start:end]
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


#: Directory depth ``Stack._dir`` resolves parent by parent (recursively); deeper ones walk.
MAX_DIR_DEPTH = 200


class Stack:
    """The trees of one stack's lazy mounts, top layer first (``ops`` exposing
    ``lazy_nodes``): path lookups as the sandbox's overlay would see them, approximately
    (the topmost layer holding a name wins; a whiteout hides it; opaque directories are not
    consulted — a lookup that finds a lower file where an opaque upper dir hides it costs at
    most one needless fetch)."""

    #: Prefixes whose topmost entry is remembered (a lookup walks every prefix of its path,
    #: and an import closure looks up thousands of paths under the same few directories).
    TOPS_MAX = 500_000

    def __init__(self, layers: Sequence[Any]) -> None:
        self.layers = list(layers)
        self._tops: dict[str, tuple[Any, Any] | None] = {}   # the trees never change
        self._dirs: dict[str, str | None] = {}

    def _top(self, path: str) -> tuple[Any, Any] | None:
        try:
            return self._tops[path]
        except KeyError:
            pass
        hit = None
        for ops in self.layers:
            node = ops.lazy_nodes.get(path)
            if node is not None:
                if not (stat.S_ISCHR(node.mode) and node.rdev == 0):   # else a whiteout
                    hit = (ops, node)
                break
        if len(self._tops) >= self.TOPS_MAX:
            self._tops.clear()
        self._tops[path] = hit
        return hit

    def names(self, path: str, per_layer: int) -> list[str]:
        """The names in directory ``path`` of any of the stack's layers (no symlinks followed;
        at most ``per_layer`` taken from each layer), each once, in first-seen order: a
        ``lookup`` of each then decides which layer's, whiteouts included."""
        out: dict[str, None] = {}
        for ops in self.layers:
            node = ops.lazy_nodes.get(path)
            if node is not None and node.children is not None:
                out.update(dict.fromkeys(list(node.children)[:per_layer]))
        return list(out)

    def lookup(self, path: str) -> tuple[Any, Any] | None:
        """``(ops, node)`` of the regular file at ``path`` (absolute or relative to the root),
        symlinks followed (at most ``MAX_HOPS``), or None. A plain relative path (no empty,
        ``.`` or ``..`` part) resolves its directory once (``_dir``, remembered) and then looks
        up one name: an import closure asks for ~16,000 paths in a few hundred directories."""
        parts = path.split("/")
        if len(parts) > 1 and "" not in parts and "." not in parts and ".." not in parts:
            where = self._dir("/".join(parts[:-1]))
            if where is None:
                return None
            hit = self._top(f"{where}/{parts[-1]}" if where else parts[-1])
            if hit is None or stat.S_ISREG(hit[1].mode):
                return hit
            if not stat.S_ISLNK(hit[1].mode):
                return None
        got = self._walk(parts)
        return got[1] if got is not None and stat.S_ISREG(got[1][1].mode) else None

    def _dir(self, path: str) -> str | None:
        """The path of directory ``path`` with its symlinks resolved (``""``: the root), or
        None when it is not a directory of the stack. Remembered; resolved from its parent's
        (itself remembered), so each directory costs one name lookup."""
        try:
            return self._dirs[path]
        except KeyError:
            pass
        head, _, leaf = path.rpartition("/")
        where: str | None = None
        if not head or leaf in ("", ".", "..") or path.count("/") > MAX_DIR_DEPTH:
            # a top-level name, a path to normalise, or one too deep to resolve recursively
            where = self._walked_dir(path)
        else:
            up = self._dir(head)
            hit = None if up is None else self._top(f"{up}/{leaf}" if up else leaf)
            if hit is not None and stat.S_ISDIR(hit[1].mode):
                where = f"{up}/{leaf}" if up else leaf
            elif hit is not None and stat.S_ISLNK(hit[1].mode):
                where = self._walked_dir(path)
        if len(self._dirs) >= self.TOPS_MAX:
            self._dirs.clear()
        self._dirs[path] = where
        return where

    def _walked_dir(self, path: str) -> str | None:
        got = self._walk(path.split("/"))
        return got[0] if got is not None and stat.S_ISDIR(got[1][1].mode) else None

    def _walk(self, parts: list[str]) -> tuple[str, tuple[Any, Any]] | None:
        """``(resolved path, (ops, node))`` of the entry at ``parts``, symlinks followed (at
        most ``MAX_HOPS``, ``MAX_STEPS`` components in all), or None."""
        steps = 0
        for _ in range(MAX_HOPS):
            cur: list[str] = []
            redirected = False
            for i, part in enumerate(parts):
                steps += 1
                if steps > MAX_STEPS:
                    return None
                if part in ("", "."):
                    continue
                if part == "..":
                    if cur:
                        cur.pop()
                    continue
                cur.append(part)
                hit = self._top("/".join(cur))
                if hit is None:
                    return None
                node = hit[1]
                if stat.S_ISLNK(node.mode):
                    target = node.link.split("/")
                    base = [] if node.link.startswith("/") else cur[:-1]
                    parts = base + target + parts[i + 1:]
                    redirected = True
                    break
                if node.children is None and i < len(parts) - 1:
                    return None   # not a directory: nothing below it (an upper file hides)
            if not redirected:
                where = "/".join(cur)   # "": the root (a directory)
                hit = self._top(where)
                return (where, hit) if hit is not None else None
        return None

    def dependencies(self, data: bytes, path: str = "") -> list[tuple[Any, Any]]:
        """The files the dynamic loader opens for the ELF ``data`` (the whole file, or a prefix:
        what it holds): its interpreter, its cache (``LOADER_CACHE``, read before any needed
        library is searched) and each needed library found in its run path (``path``, the
        file's own path in the stack, gives ``$ORIGIN``; without it such directories are
        skipped), then in ``LIBRARY_DIRS``, as ``(ops, node)``."""
        interp, needed, run = parse_dynamic(data)
        dirs = [d for d in (_run_dir(r, path) for r in run) if d is not None]
        dirs += LIBRARY_DIRS
        out = []
        # a program's loader opens its cache before searching for any library: known from
        # the interpreter alone (the first bytes of a large program being streamed)
        for path in ([interp] if interp else []) + ([LOADER_CACHE] if needed or interp else []):
            hit = self.lookup(path)
            if hit is not None:
                out.append(hit)
        for name in needed:
            for d in dirs:
                hit = self.lookup(f"{d}/{name}")
                if hit is not None:
                    out.append(hit)
                    break
        return out


def _run_dir(entry: str, path: str) -> str | None:
    """A run path directory as a stack path (no leading ``/``; ``""``: the root, which
    ``..`` never leaves): ``$ORIGIN`` (or ``${ORIGIN}``) is the directory of ``path``; None
    for one that cannot be resolved (``$ORIGIN`` without ``path``, another ``$`` token, a
    relative one)."""
    entry = entry.replace("${ORIGIN}", "$ORIGIN")
    if "$" in entry.replace("$ORIGIN", ""):
        return None
    if "$ORIGIN" in entry:
        if not path:
            return None
        entry = entry.replace("$ORIGIN", "/" + posixpath.dirname(path.strip("/")))
    if not entry.startswith("/"):
        return None   # relative to the process's cwd: the loader's business, not ours
    return posixpath.normpath(entry).lstrip("/")
