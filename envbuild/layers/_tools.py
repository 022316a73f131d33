"""Layer tools for front ends: name a layer by a path or a store digest, pack a tree into a file
or a store, read one member with helpful errors, and describe a layer as plain data.

A *layer reference* (``LAYER`` on the command line) is, in this order:

* ``sha256:<hex>`` — a blob in the store; ``<hex>`` is 64 digits or a unique prefix of at least
  ``MIN_PREFIX`` digits;
* an existing path — a layer file (a directory is refused: pack it first);
* bare hex of at least ``MIN_PREFIX`` digits — a digest (prefix) in the store.

Every failure is an ``EnvbuildError`` with a hint (``LayerError``, ``CorruptLayerError``,
``BlobNotFound``, ``StoreError`` with reference ``invalid-digest`` / ``ambiguous-digest``);
``add_hints`` gives reader errors, which carry none, a default one for their class.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from envbuild.errors import (
    BlobNotFound,
    CorruptLayerError,
    EnvbuildError,
    LayerError,
    StoreError,
    UnsafeLayerError,
    UnsupportedFormatError,
)
from envbuild.layers._reader import LayerReader
from envbuild.layers._toc import Entry, LayerInfo

#: Fewest hex digits accepted as a digest prefix (12, as for docker image ids).
MIN_PREFIX = 12
_HEX = re.compile(r"[0-9a-fA-F]+")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_TYPE_BITS = {"file": stat.S_IFREG, "hardlink": stat.S_IFREG, "dir": stat.S_IFDIR,
              "symlink": stat.S_IFLNK, "char": stat.S_IFCHR, "block": stat.S_IFBLK,
              "fifo": stat.S_IFIFO}
_REF_HINT = ("LAYER is a layer file or a digest in the store: sha256:<hex>, or at least "
             f"{MIN_PREFIX} hex digits of it")


# -- naming and opening ---------------------------------------------------------------------


def resolve_digest(store, text: str) -> str:
    """The full digest of the stored blob that ``text`` (``sha256:<hex>`` or bare hex, 64 digits
    or a unique prefix of at least ``MIN_PREFIX``) names. A full digest is returned unchecked
    (opening it raises ``BlobNotFound``); a prefix is matched against ``store.list()``."""
    hexpart = text.removeprefix("sha256:")
    if not _HEX.fullmatch(hexpart) or len(hexpart) > 64:
        raise StoreError(f"invalid digest {text!r}", reference="invalid-digest", hint=_REF_HINT)
    hexpart = hexpart.lower()
    if len(hexpart) == 64:
        return "sha256:" + hexpart
    if len(hexpart) < MIN_PREFIX:
        raise StoreError(f"digest prefix {text!r} is too short ({len(hexpart)} hex digits)",
                         reference="invalid-digest",
                         hint=f"give at least {MIN_PREFIX} hex digits, or the full digest")
    matches = sorted(d for d in store.list() if d[7:].startswith(hexpart))
    if not matches:
        raise BlobNotFound(f"no blob in the store {_where(store)} starts with {text}",
                           hint="check the digest and --store / ENVBUILD_STORE")
    if len(matches) > 1:
        shown = ", ".join(matches[:3]) + (", ..." if len(matches) > 3 else "")
        raise StoreError(f"digest prefix {text} is ambiguous: {len(matches)} blobs match "
                         f"({shown})", reference="ambiguous-digest",
                         hint="give more hex digits")
    return matches[0]


def locate_layer(ref: str, get_store: Callable[[], Any]) -> tuple[Any, str]:
    """Where ``ref`` lives: ``(store, digest)`` for a stored blob, ``(None, path)`` for a file.
    ``get_store`` is called only for digests (naming a file must not create a store)."""
    if not ref:
        raise LayerError("empty layer reference", hint=_REF_HINT)
    if not ref.startswith("sha256:"):
        if os.path.lexists(ref):
            if os.path.isdir(ref):
                raise LayerError(f"{ref} is a directory, not a layer blob",
                                 hint=f"pack it first: envbuild layer pack {ref}")
            if not os.path.isfile(ref):  # a FIFO would block, a dangling link has no bytes
                raise LayerError(f"{ref} is not a regular file", hint=_REF_HINT)
            return None, ref
        if not _HEX.fullmatch(ref):
            raise LayerError(f"no such layer file: {ref}", hint=_REF_HINT)
        if len(ref) < MIN_PREFIX:
            raise LayerError(f"no such layer file: {ref} (and {len(ref)} hex digits are too "
                             "few for a digest prefix)", hint=_REF_HINT)
    store = get_store()
    return store, resolve_digest(store, ref)


def open_layer(ref: str, get_store: Callable[[], Any]) -> LayerReader:
    """A ``LayerReader`` for ``ref`` (see the module docstring); close it when done. Only the
    footer and TOC are read and verified here."""
    store, where = locate_layer(ref, get_store)
    with add_hints(stored=store is not None):
        if store is not None:
            return LayerReader.from_store(store, where)
        try:
            return LayerReader.open_file(where)
        except OSError as e:
            raise LayerError(f"open layer {where}: {e.strerror or e}") from e


@contextlib.contextmanager
def add_hints(reader: LayerReader | None = None, *, stored: bool | None = None
              ) -> Iterator[None]:
    """Give errors that have no hint the default one for their class. ``stored``: the layer
    is a store blob (default: whether ``reader`` is named by a digest, as ``from_store``
    names it)."""
    if stored is None:
        stored = reader is not None and bool(_DIGEST.fullmatch(reader.name))
    try:
        yield
    except EnvbuildError as e:
        if e.hint is None:
            e.hint = default_hint(e, stored=stored)
        raise


def default_hint(err: EnvbuildError, *, stored: bool = False) -> str | None:
    """What to do about a reader error (they are raised without a hint)."""
    if isinstance(err, UnsupportedFormatError):
        return "it was written by a newer envbuild; upgrade envbuild to read it"
    if isinstance(err, CorruptLayerError):
        if stored:
            return "the stored blob is damaged: delete it and rebuild or pull it again"
        return ("the file is damaged or not an envbuild layer (format v1, docs/layer-format.md);"
                " re-create it with envbuild layer pack")
    if isinstance(err, UnsafeLayerError):
        return "the layer is refused for safety; inspect it with envbuild layer ls"
    return None


def _where(store) -> str:
    from envbuild.store.base import Locatable

    return store.location().url if isinstance(store, Locatable) else type(store).__name__


# -- packing --------------------------------------------------------------------------------


def pack_to_file(src: str | os.PathLike, dest: str | os.PathLike, **options) -> LayerInfo:
    """Pack ``src`` into the file ``dest`` atomically: a temporary file next to it, fsync,
    rename. On any error nothing is left at ``dest`` (an existing file stays as it was).
    ``options`` go to ``pack_tree``."""
    dest = Path(dest)
    if not os.path.isdir(src):
        what = "not a directory" if os.path.lexists(src) else "no such directory"
        raise LayerError(f"pack {src}: {what}", hint="envbuild layer pack takes a directory")
    if dest.is_dir():
        raise LayerError(f"write layer {dest}: it is a directory", hint="give a file name")
    import secrets  # packing only: reading a layer does not pay for it (CLI start-up)

    tmp = dest.parent / f".{dest.name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise LayerError(f"write layer {dest}: {e.strerror or e}",
                         hint="the directory must exist and be writable") from e
    from envbuild.layers._writer import pack_tree  # not imported for reading (CLI start-up)

    try:
        with open(fd, "wb") as out:
            info = pack_tree(src, out, **options)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise LayerError(f"write layer {dest}: {e.strerror or e}") from e
        raise
    return info


def pack_to_store(src: str | os.PathLike, store, **options) -> LayerInfo:
    """Pack ``src`` and put the blob into ``store`` (through a temporary file, since a layer
    can be larger than memory). Returns the writer's ``LayerInfo``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="envbuild-pack-") as tmp:
        info = pack_to_file(src, Path(tmp) / "layer", **options)
        _put(store, Path(tmp) / "layer", info, src)
    return info


def pack(src: str | os.PathLike, *, output: str | os.PathLike | None = None, store=None,
         **options) -> LayerInfo:
    """Pack ``src`` into the file ``output``, the ``store``, or both (packed once)."""
    if output is None and store is None:
        raise TypeError("pack needs output= or store=")
    if output is None:
        return pack_to_store(src, store, **options)
    info = pack_to_file(src, output, **options)
    if store is not None:
        _put(store, output, info, src)
    return info


def _put(store, path: str | os.PathLike, info: LayerInfo, src) -> None:
    from envbuild.store import put_file

    stored = put_file(store, path)
    if stored.digest != info.digest:
        raise LayerError(f"pack {src}: the stored blob hashes to {stored.digest}, the writer "
                         f"reported {info.digest}", hint="did the output file change meanwhile?")


# -- reading and describing -----------------------------------------------------------------


def member_entry(reader: LayerReader, path: str) -> Entry:
    """The TOC entry of ``path``; a missing path is a ``LayerError`` with a did-you-mean hint."""
    key = path.strip("/")
    try:
        return reader.stat(key)
    except CorruptLayerError:
        raise
    except LayerError as err:
        from envbuild.defs.hints import suggest

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


def unpack(reader: LayerReader, dest: str | os.PathLike, **options) -> None:
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


def verify(reader: LayerReader) -> LayerInfo:
    """``verify_layer`` with hints on failure. A reader opened from a store is named by its
    digest (``LayerReader.from_store``), and the blob must hash to it; for a file the returned
    ``info.digest`` is simply the file's sha256."""
    from envbuild.layers._verify import verify_layer

    stored = reader.name if _DIGEST.fullmatch(reader.name) else None
    with add_hints(reader):
        return verify_layer(reader, expected_digest=stored)


def summary(reader: LayerReader) -> dict[str, Any]:
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


def human_size(n: int) -> str:
    """``1.2 MB``-style size (decimal units), exact bytes below 1 kB."""
    if n < 1000:
        return f"{n} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def info_json(info: LayerInfo) -> dict[str, Any]:
    """``LayerInfo`` as a JSON object."""
    return dataclasses.asdict(info)
