"""Read and write files inside a sandbox's root from the host, without escaping it.

A sandbox controls its own tree: ``/etc/passwd`` in it may be a symlink to ``/etc/shadow`` of
the host, or ``..`` chains. Paths are therefore resolved with ``openat2(RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS)`` (Linux >= 5.6): the kernel treats the sandbox root as ``/`` for every
component, symlinks included, so no path can leave it.
Only regular files are read or written: the path is resolved to an ``O_PATH`` fd, checked,
and that inode reopened, so a FIFO the sandbox made never blocks the host and a device node is
never opened (issue 11, item 10).
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


def _open_regular(root_fd: int, path: str, flags: int) -> int:
    """``path`` in the root reopened with ``flags``, only if it is a regular file.

    The path is resolved to an ``O_PATH`` fd first, which opens nothing: a FIFO would block
    ``open`` until a writer comes, a device would run its driver's ``open``. Only after
    ``fstat`` says regular file is that same inode (not the path again: the sandbox may swap
    it) reopened through ``/proc/self/fd``."""
    fd = open_in_root(root_fd, path, os.O_PATH)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _NotRegular(path)
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC | os.O_NOCTTY)
    finally:
        os.close(fd)


class _NotRegular(Exception):
    pass


def _refuse(verb: str, path: str) -> RuntimeShimError:
    return RuntimeShimError(f"{verb} {path} in sandbox: not a regular file",
                            hint="FIFOs, devices, sockets and directories are refused; "
                                 "exec a command to use them")


def read_file(root: str, path: str, *, max_bytes: int = 256 << 20) -> bytes:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = _open_regular(root_fd, path, os.O_RDONLY)
    except _NotRegular:
        raise _refuse("read", path) from None
    except OSError as e:
        raise RuntimeShimError(f"read {path} in sandbox: {e.strerror}") from None
    finally:
        os.close(root_fd)
    try:
        st = os.fstat(fd)
        if st.st_size > max_bytes:
            raise RuntimeShimError(f"read {path} in sandbox: {st.st_size} bytes is over the "
                                   f"{max_bytes}-byte limit", hint="exec a command to stream it")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _open_for_write(root_fd: int, path: str, mode: int) -> int:
    """An existing regular file truncated, or a new one: never an existing non-file (an
    ``O_CREAT`` open without ``O_EXCL`` would open a FIFO or device that is already there)."""
    for _ in range(3):  # the sandbox may create or delete the name between the two opens
        try:
            return _open_regular(root_fd, path, os.O_WRONLY | os.O_TRUNC)
        except FileNotFoundError:
            pass
        try:
            return open_in_root(root_fd, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            continue  # made meanwhile, or a symlink to nowhere (O_EXCL never follows)
    raise OSError(errno.EEXIST, "exists but cannot be opened (a dangling symlink?)")


def write_file(root: str, path: str, data: bytes, *, mode: int = 0o644, uid: int = 0,
               gid: int = 0, make_parents: bool = True) -> None:
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if make_parents and "/" in path.strip("/"):
            _mkdirs_in_root(root_fd, "/" + path.strip("/").rsplit("/", 1)[0])
        fd = _open_for_write(root_fd, path, mode)
    except _NotRegular:
        raise _refuse("write", path) from None
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
