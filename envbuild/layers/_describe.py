"""A layer described as plain data and text: the summary its footer and TOC give, TOC entries as
JSON, ``tar -tv``-style lines, human-readable sizes (``envbuild layer ls|stat|verify``)."""

from __future__ import annotations

import collections
import datetime
import stat
from typing import Any

from envbuild.layers._reader import LayerReader
from envbuild.layers._refs import add_hints
from envbuild.layers._toc import Entry
from envbuild.sizes import human_size  # noqa: F401  (envbuild.layers re-exports it)

_TYPE_BITS = {"file": stat.S_IFREG, "hardlink": stat.S_IFREG, "dir": stat.S_IFDIR,
              "symlink": stat.S_IFLNK, "char": stat.S_IFCHR, "block": stat.S_IFBLK,
              "fifo": stat.S_IFIFO}


def layer_summary(reader: LayerReader) -> dict[str, Any]:
    """What the footer and TOC say about the whole layer (no frame is read)."""
    toc, footer = reader.toc, reader.footer
    with add_hints(reader):
        entries = reader.entries()
    types = collections.Counter(e.type for e in entries)
    return {
        "layer": reader.name, "format_version": footer.version, "framing": toc.framing,
        "size": reader.size, "uncompressed_size": toc.tar_size, "diff_id": toc.diff_id,
        "toc_digest": reader.toc_digest, "toc_size": footer.toc_csize,
        "toc_uncompressed_size": footer.toc_usize, "frames": len(toc.frames),
        "entries": len(entries), "types": dict(sorted(types.items())),
    }


def entry_json(entry: Entry, *, chunks: bool = True) -> dict[str, Any]:
    """A TOC entry as JSON (the TOC's own encoding; ``chunks`` dropped when not wanted)."""
    doc = entry.to_json()
    if not chunks:
        del doc["chunks"]
    return doc


def mode_string(entry: Entry) -> str:
    """``-rwxr-xr-x``-style type and permissions, as ``tar -tv`` prints them (``h`` for a
    hardlink)."""
    text = stat.filemode(_TYPE_BITS.get(entry.type, 0) | entry.mode)
    return "h" + text[1:] if entry.type == "hardlink" else text


def long_line(entry: Entry) -> str:
    """One ``tar -tv``-style line: mode, uid/gid, size (major,minor for devices), mtime (UTC),
    path (``/`` after directories) and link target."""
    if entry.type in ("char", "block"):
        size = f"{entry.devmajor},{entry.devminor}"
    else:
        size = str(entry.size)
    try:
        when = datetime.datetime.fromtimestamp(entry.mtime, datetime.UTC)
        mtime = when.strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):
        mtime = str(entry.mtime)
    line = (f"{mode_string(entry)} {entry.uid}/{entry.gid} {size:>10} {mtime} "
            f"{display_path(entry)}")
    if entry.type == "symlink":
        line += f" -> {entry.linkname}"
    elif entry.type == "hardlink":
        line += f" link to {entry.linkname}"
    return line


def display_path(entry: Entry) -> str:
    """The path as ``tar -t`` lists it: directories end in ``/``."""
    return entry.path + "/" if entry.type == "dir" else entry.path


