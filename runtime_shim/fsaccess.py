"""Read and write files inside a sandbox's root from the host, without escaping it.

A sandbox controls its own tree: ``/etc/passwd`` in it may be a symlink to ``/etc/shadow`` of
the host, or ``..`` chains. Paths are therefore resolved with ``openat2(RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS)`` (Linux >= 5.6): the kernel treats the sandbox root as ``/`` for every
component, symlinks included, so no path can leave it.
"""

from __future__ import annotations

import errno
import os
import stat

from envbuild.errors import RuntimeShimError
from envbuild.safefs import open_in_root


def _mkdirs_in_root(root_fd: int, parent: str) -> None:
    parts = [p for p in parent.split("/") if p]
    current = ""
    for p in parts:
        current += "/" + p
        try:
            fd = open_in_root(root_fd, current, os.O_RDONLY | os.O_DIRECTORY)
            os.close(fd)
        except FileNotFoundError:
            up = open_in_root(root_fd, current.rsplit("/", 1)[0] or "/",
                              os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.mkdir(p, 0o755, dir_fd=up)
            except FileExistsError:
                pass
            finally:
                os.close(up)


def read_file(root: str, path: str, *, max_bytes: int = 256 << 20) -> bytes:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_in_root(root_fd, path, os.O_RDONLY)
    except OSError as e:
        raise RuntimeShimError(f"read {path} in sandbox: {e.strerror}") from None
    finally:
        os.close(root_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RuntimeShimError(f"read {path} in sandbox: not a regular file")
        if st.st_size > max_bytes:
            raise RuntimeShimError(f"read {path} in sandbox: {st.st_size} bytes is over the "
                                   f"{max_bytes}-byte limit", hint="exec a command to stream it")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_file(root: str, path: str, data: bytes, *, mode: int = 0o644, uid: int = 0,
               gid: int = 0, make_parents: bool = True) -> None:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if make_parents and "/" in path.strip("/"):
            _mkdirs_in_root(root_fd, "/" + path.strip("/").rsplit("/", 1)[0])
        fd = open_in_root(root_fd, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    except OSError as e:
        hint = "the path must be inside the sandbox" if e.errno == errno.EXDEV else None
        raise RuntimeShimError(f"write {path} in sandbox: {e.strerror}", hint=hint) from None
    finally:
        os.close(root_fd)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fchmod(fd, mode)
        os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
