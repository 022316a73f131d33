"""Pack a directory into a layer file (atomically) or a store, for front ends and tests.

The store is anything with ``put(digest, file, size=)`` (``envbuild.store.Store``: verified and
idempotent); ``envbuild.layers`` never imports ``envbuild.store``, which stands on it.
"""

from __future__ import annotations

import os
from pathlib import Path

from envbuild.errors import LayerError
from envbuild.layers._toc import LayerInfo


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
    from envbuild.atomic import atomic_file
    from envbuild.layers._writer import pack_tree  # not imported for reading (CLI start-up)

    opened = False
    try:
        with atomic_file(dest, fsync=True) as out:
            opened = True
            info = pack_tree(src, out, **options)
    except OSError as e:
        raise LayerError(f"write layer {dest}: {e.strerror or e}", hint=None if opened
                         else "the directory must exist and be writable") from e
    return info


def pack_to_store(src: str | os.PathLike, store, **options) -> LayerInfo:
    """Pack ``src`` and put the blob into ``store`` (through a temporary file, since a layer
    can be larger than memory). Returns the writer's ``LayerInfo``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="envbuild-pack-") as tmp:
        info = pack_to_file(src, Path(tmp) / "layer", **options)
        put_packed(store, Path(tmp) / "layer", info)
    return info


def pack_layer(src: str | os.PathLike, *, output: str | os.PathLike | None = None, store=None,
               **options) -> LayerInfo:
    """Pack ``src`` into the file ``output``, the ``store``, or both (packed once)."""
    if output is None and store is None:
        raise TypeError("pack_layer needs output= or store=")
    if output is None:
        return pack_to_store(src, store, **options)
    info = pack_to_file(src, output, **options)
    if store is not None:
        put_packed(store, output, info)
    return info


def put_packed(store, path: str | os.PathLike, info: LayerInfo) -> None:
    """Put the layer file ``path`` that the writer described as ``info`` into ``store``: one
    read of the file, which the store verifies against ``info.digest`` (a file changed since it
    was written is refused with ``DigestMismatch``); a blob already stored is not sent again."""
    with open(path, "rb") as f:
        store.put(info.digest, f, size=info.size)
