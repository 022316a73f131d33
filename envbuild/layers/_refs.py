"""Name a layer by a path or a store digest, open it, and give reader errors a hint.

A *layer reference* (``LAYER`` on the command line) is, in this order:

* ``sha256:<hex>`` — a blob in the store; ``<hex>`` is 64 digits or a unique prefix of at least
  ``MIN_DIGEST_PREFIX`` digits;
* an existing path — a layer file (a directory is refused: pack it first);
* bare hex of at least ``MIN_DIGEST_PREFIX`` digits — a digest (prefix) in the store.

The store is anything with the ``Store`` methods used here (``list``, ``stat``, ``get_range``;
``envbuild.store.Store`` has them): ``envbuild.layers`` is the foundation ``envbuild.store``
stands on, so it takes a store as an argument and never imports that package.

Every failure is an ``EnvbuildError`` with a hint (``LayerError``, ``CorruptLayerError``,
``BlobNotFound``, ``StoreError`` with reference ``invalid-digest`` / ``ambiguous-digest``);
``add_hints`` gives reader errors, which carry none, a default one for their class.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
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
from envbuild.oci import is_digest

#: Fewest hex digits accepted as a digest prefix (12, as for docker image ids).
MIN_DIGEST_PREFIX = 12
_HEX = re.compile(r"[0-9a-fA-F]+")
REF_HELP = ("LAYER is a layer file, or a digest in the store: sha256:<hex> or a unique prefix "
            f"of at least {MIN_DIGEST_PREFIX} hex digits.")
_REF_HINT = ("LAYER is a layer file or a digest in the store: sha256:<hex>, or at least "
             f"{MIN_DIGEST_PREFIX} hex digits of it")


def resolve_digest(store, text: str, *, where: str | None = None) -> str:
    """The full digest of the stored blob that ``text`` (``sha256:<hex>`` or bare hex, 64 digits
    or a unique prefix of at least ``MIN_DIGEST_PREFIX``) names. A full digest is returned
    unchecked (opening it raises ``BlobNotFound``); a prefix is matched against
    ``store.list()``. ``where`` names the store in messages (its URL; default its repr)."""
    hexpart = text.removeprefix("sha256:")
    if not _HEX.fullmatch(hexpart) or len(hexpart) > 64:
        raise StoreError(f"invalid digest {text!r}", reference="invalid-digest", hint=_REF_HINT)
    hexpart = hexpart.lower()
    if len(hexpart) == 64:
        return "sha256:" + hexpart
    if len(hexpart) < MIN_DIGEST_PREFIX:
        raise StoreError(f"digest prefix {text!r} is too short ({len(hexpart)} hex digits)",
                         reference="invalid-digest",
                         hint=f"give at least {MIN_DIGEST_PREFIX} hex digits, or the full digest")
    matches = sorted(d for d in store.list() if d[7:].startswith(hexpart))
    if not matches:
        raise BlobNotFound(f"no blob in the store {where or repr(store)} starts with {text}",
                           hint="check the digest and --store / ENVBUILD_STORE")
    if len(matches) > 1:
        shown = ", ".join(matches[:3]) + (", ..." if len(matches) > 3 else "")
        raise StoreError(f"digest prefix {text} is ambiguous: {len(matches)} blobs match "
                         f"({shown})", reference="ambiguous-digest",
                         hint="give more hex digits")
    return matches[0]


def locate_layer(ref: str, get_store: Callable[[], Any], *, where: str | None = None
                 ) -> tuple[Any, str]:
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
        if len(ref) < MIN_DIGEST_PREFIX:
            raise LayerError(f"no such layer file: {ref} (and {len(ref)} hex digits are too "
                             "few for a digest prefix)", hint=_REF_HINT)
    store = get_store()
    return store, resolve_digest(store, ref, where=where)


def open_layer(ref: str, get_store: Callable[[], Any], *, where: str | None = None
               ) -> LayerReader:
    """A ``LayerReader`` for ``ref`` (see the module docstring); close it when done. Only the
    footer and TOC are read and verified here."""
    store, found = locate_layer(ref, get_store, where=where)
    with add_hints(stored=store is not None):
        if store is not None:
            return LayerReader.from_store(store, found)
        try:
            return LayerReader.open_file(found)
        except OSError as e:
            raise LayerError(f"open layer {found}: {e.strerror or e}") from e


def is_stored(reader: LayerReader) -> bool:
    """Whether ``reader`` reads a store blob (``LayerReader.from_store`` names it by digest)."""
    return is_digest(reader.name)


@contextlib.contextmanager
def add_hints(reader: LayerReader | None = None, *, stored: bool | None = None
              ) -> Iterator[None]:
    """Give errors that have no hint the default one for their class. ``stored``: the layer
    is a store blob (default: whether ``reader`` is named by a digest, as ``from_store``
    names it)."""
    if stored is None:
        stored = reader is not None and is_stored(reader)
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
