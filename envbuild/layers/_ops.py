"""What a front end does with an open layer — one member's entry or contents, unpack, verify —
with errors that say what to do (a did-you-mean for a missing path, ``add_hints`` for reader
errors, file-system errors as ``LayerError``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

from envbuild.errors import CorruptLayerError, LayerError
from envbuild.hints import suggest
from envbuild.layers._reader import LayerReader
from envbuild.layers._refs import add_hints, is_stored
from envbuild.layers._toc import Entry, LayerInfo


def member_entry(reader: LayerReader, path: str) -> Entry:
    """The TOC entry of ``path``; a missing path is a ``LayerError`` with a did-you-mean hint."""
    key = path.strip("/")
    try:
        return reader.stat(key)
    except CorruptLayerError:
        raise
    except LayerError as err:
        paths = [x.path for x in reader.entries()]
        err.hint = suggest(key, paths) or f"list the members with: envbuild layer ls {reader.name}"
        raise


def read_member(reader: LayerReader, path: str) -> bytes:
    """The contents of regular file ``path`` (only its frames are read, digest-checked); a
    missing path, a directory or another non-file is a ``LayerError`` with a hint."""
    return b"".join(iter_member(reader, path))


def iter_member(reader: LayerReader, path: str) -> Iterator[bytes]:
    """``read_member`` in pieces (``LayerReader.iter_read``: bounded memory whatever size the
    TOC declares; the digest is checked after the last piece)."""
    e = member_entry(reader, path)
    if e.type == "dir":
        raise LayerError(f"layer {reader.name}: {e.path} is a directory",
                         hint=f"list it with: envbuild layer ls {reader.name}")
    if e.type == "symlink":
        raise LayerError(f"layer {reader.name}: {e.path} is a symlink to {e.linkname!r}",
                         hint="cat the path it points to")
    if e.type not in ("file", "hardlink"):
        raise LayerError(f"layer {reader.name}: {e.path} is a {e.type}, not a regular file",
                         hint="only regular files have contents")
    with add_hints(reader):
        yield from reader.iter_read(e.path)


def unpack_into(reader: LayerReader, dest: str | os.PathLike, **options) -> None:
    """``reader.unpack(dest, **options)`` with file-system errors as ``LayerError``s. ``dest``
    is created if missing; an existing tree is stacked onto (see ``unpack_layer``)."""
    if os.path.lexists(dest) and not os.path.isdir(dest):
        raise LayerError(f"unpack {reader.name}: {dest} exists and is not a directory",
                         hint="give a new or existing directory")
    with add_hints(reader):
        try:
            reader.unpack(dest, **options)
        except OSError as e:
            raise LayerError(f"unpack {reader.name} into {dest}: {e.strerror or e}"
                             + (f": {e.filename}" if e.filename else ""),
                             hint="check DEST, its permissions and free space") from e


def verify_reader(reader: LayerReader) -> LayerInfo:
    """``verify_layer`` with hints on failure. A reader opened from a store is named by its
    digest (``LayerReader.from_store``), and the blob must hash to it; for a file the returned
    ``info.digest`` is simply the file's sha256."""
    from envbuild.layers._verify import verify_layer  # not imported for reading (CLI start-up)

    with add_hints(reader):
        return verify_layer(reader, expected_digest=reader.name if is_stored(reader) else None)
