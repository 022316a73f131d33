"""The one atomic write: a file's new content appears whole, or the old one stays.

``write_atomic(path, data)`` and ``atomic_file(path)`` (for content that is streamed) write a
temporary file in ``path``'s directory, then rename it over ``path``; on any failure (an
exception in the ``with`` body included) the temporary file is removed and ``path`` is
untouched. What differs between callers is a parameter, not a second copy:

- ``fsync``: flush the file to disk before the rename (a crash then leaves the old content or
  the new, never a truncated file); ``fsync_dir``: also flush the directory after it, so the
  rename itself survives a crash (the store's contract);
- ``mode``: the new file's permission bits, masked by the umask as ``open`` does (``0o600``
  for a private cache);
- ``tmp_prefix``: the temporary file's name is ``<prefix><random>`` (the store's ``.tmp-``,
  which its garbage collector recognises); else ``.<name>.<random>.tmp``.

The temporary file is created with ``O_EXCL | O_NOFOLLOW`` (never through a link someone
planted), and a symlink at ``path`` is replaced by the rename, never written through.

This is the one copy (``tests/unit/test_one_copy.py``). Not for: a create that must fail if
the file exists (``O_EXCL`` or ``link``, e.g. the store's ``create_if_absent``), a blob whose
name is its digest known only once written (the store's ``put``, export's blobs, the lazy file
cache: they verify then rename), a file a tool writes (``mkfs``, ``gcc``), a directory.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "fsync_directory", "write_atomic"]


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, mode: int = 0o666, fsync: bool = False,
                fsync_dir: bool = False, tmp_prefix: str | None = None) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content to; renamed over ``path`` when the
    ``with`` body ends without an exception, removed otherwise."""
    path = Path(path)
    name = (f"{tmp_prefix}{secrets.token_hex(8)}" if tmp_prefix is not None
            else f".{path.name}.{secrets.token_hex(6)}.tmp")
    tmp = path.parent / name
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with open(fd, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync_dir:
        fsync_directory(path.parent)


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o666,
                 fsync: bool = False, fsync_dir: bool = False,
                 tmp_prefix: str | None = None) -> None:
    """Replace ``path``'s content with ``data`` (a ``str`` is written as UTF-8)."""
    with atomic_file(path, mode=mode, fsync=fsync, fsync_dir=fsync_dir,
                     tmp_prefix=tmp_prefix) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Flush ``directory``'s entries (a rename or create in it) to disk."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

