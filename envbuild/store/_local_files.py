"""The file operations ``LocalStore`` is made of: every write atomic (a temp file next to the
target, fsync, rename or link, fsync the directory), the temp-file naming ``list_partials``
recognises, and the non-blocking lock probe that tells a live writer's temp file from a
crashed one's."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envbuild import atomic
from envbuild.atomic import fsync_directory as fsync_dir
from envbuild.canonical import read_json_file
from envbuild.errors import StoreUnavailable

#: Temp files of writes in progress start with this (``list_partials`` finds them by it).
TMP_PREFIX = ".tmp-"


def tmp_name(directory: Path) -> Path:
    return directory / f"{TMP_PREFIX}{secrets.token_hex(8)}"


def write_tmp(directory: Path, data: bytes) -> Path:
    tmp = tmp_name(directory)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file, fsync, rename, fsync the directory."""
    atomic.write_atomic(path, data, mode=0o644, fsync=True, fsync_dir=True,
                        tmp_prefix=TMP_PREFIX)


def create_if_absent(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data`` unless it exists; safe when several processes race."""
    if path.exists():
        return
    tmp = write_tmp(path.parent, data)
    try:
        os.link(tmp, path)  # unlike rename, link never replaces what a faster process wrote
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


@contextlib.contextmanager
def unlocked(path: Path) -> Iterator[None]:
    """Hold ``path``'s flock, or raise ``BlockingIOError`` if a writer holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def read_json(path: Path) -> Any:
    try:
        return read_json_file(path)
    except ValueError as e:
        raise StoreUnavailable(f"parse {path}: {e}",
                               hint="the store is damaged; repair or delete that file") from e
