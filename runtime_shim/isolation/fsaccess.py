"""Read and write files inside a sandbox's root from the host, without escaping it.

A sandbox controls its own tree: ``/etc/passwd`` in it may be a symlink to ``/etc/shadow`` of
the host, or ``..`` chains. Paths are therefore resolved with ``openat2(RESOLVE_IN_ROOT |
RESOLVE_NO_MAGICLINKS)`` (Linux >= 5.6): the kernel treats the sandbox root as ``/`` for every
component, symlinks included, so no path can leave it.
Only regular files are read or written: the path is resolved to an ``O_PATH`` fd, checked,
and that inode reopened, so a FIFO the sandbox made never blocks the host and a device node is
never opened (issue 11, item 10).

Streams (bounded memory, for files of any size): ``open_read`` gives the fd of a regular file;
a ``FileWriter`` writes a file in pieces. Every file it makes is made ``O_EXCL`` by one name in
the target's directory (resolved inside the root), with its owner and mode from the start. A
new target is written under its own name (as E2B's envd does: a watcher sees it created,
then written), and ``abort`` (or any error) removes it again. An existing one (a regular file,
or a symlink to one, resolved inside the root) keeps its bytes until ``commit``: the new ones
go to a hidden file beside it (``.NAME.envbuild-XXXXXXXX``) and are copied into it in place
at ``commit`` (same inode, as ``write_file``; a page-cache copy, not a clone), ``abort``
drops them. So nothing of a refused write is left at the path; a directory, FIFO, device or
socket is refused.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Self

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


def open_read(root: str, path: str) -> int:
    """A read-only fd of regular file ``path`` inside ``root`` (the caller closes it)."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _open_regular(root_fd, path, os.O_RDONLY)
    except _NotRegular:
        raise _refuse("read", path) from None
    except OSError as e:
        raise RuntimeShimError(f"read {path} in sandbox: {e.strerror}") from None
    finally:
        os.close(root_fd)


def read_file(root: str, path: str, *, max_bytes: int = 256 << 20) -> bytes:
    fd = open_read(root, path)
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


def _open_for_write(root_fd: int, path: str, mode: int, *, truncate: bool = True) -> int:
    """An existing regular file (truncated unless ``truncate`` is false), or a new one: never
    an existing non-file (an ``O_CREAT`` open without ``O_EXCL`` would open a FIFO or device
    that is already there)."""
    for _ in range(3):  # the sandbox may create or delete the name between the two opens
        try:
            return _open_regular(root_fd, path, os.O_WRONLY | (os.O_TRUNC if truncate else 0))
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
        _write_all(fd, data)
        os.fchmod(fd, mode)
        os.fchown(fd, uid, gid)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _split(path: str) -> tuple[str, str]:
    """``path``'s parent (absolute) and last component; a path naming no file is refused."""
    parent, _, name = ("/" + path.strip("/")).rpartition("/")
    if name in ("", ".", ".."):
        raise RuntimeShimError(f"write {path} in sandbox: not a file name",
                               hint="give the path of a file, e.g. /tmp/out.txt")
    return parent or "/", name


class CommitOnExit:
    """A writer as a context manager: ``commit`` when the block ends normally, ``abort`` when
    it raises. The writer defines both."""

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class FileWriter(CommitOnExit):
    """Regular file ``path`` inside ``root`` written in pieces (``write``) and published whole
    (``commit``), owned by ``uid:gid`` with ``mode`` (see the module docstring). As a context
    manager: committed when the block ends, aborted when it raises.

    ``hold``: the new bytes of an existing target are kept in memory up to this many (the
    caller's bound) and written straight into it at ``commit``; a hidden file is made only
    if they grow past it. Saves writing them twice (10 MiB on a btrfs pool: ~7 ms).
    ``holding`` says whether this writer holds them; ``write(data, lent=True)`` holds ``data``
    itself, not a copy (its owner leaves it unchanged until the write ends)."""

    def __init__(self, root: str, path: str, *, mode: int = 0o644, uid: int = 0, gid: int = 0,
                 make_parents: bool = True, hold: int = 0) -> None:
        self.root, self.path, self.mode, self.uid, self.gid = root, path, mode, uid, gid
        self.written, self._fd, self._dir = 0, -1, -1
        self._hold, self._ended = hold, False
        # held bytes of an existing target
        self._held: list[bytes | bytearray | memoryview] | None = None
        parent, self._name = _split(path)
        self._tmp = f".{self._name[:200]}.envbuild-{secrets.token_hex(4)}"
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if make_parents:
                _mkdirs_in_root(root_fd, parent)
            self._dir = open_in_root(root_fd, parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise RuntimeShimError(f"write {path} in sandbox: {e.strerror}") from None
        finally:
            os.close(root_fd)
        # one component in a directory resolved inside the root: O_EXCL follows nothing
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._direct = False  # writing a new target itself (nothing had its name)
        try:
            try:
                self._fd = os.open(self._name, flags, 0o600, dir_fd=self._dir)
                self._direct = True
            except FileExistsError:  # a file (or any name, a symlink too) is there
                if hold > 0:
                    self._held = []
                    return
                self._open_hidden()
            os.fchown(self._fd, uid, gid)
            os.fchmod(self._fd, mode)  # after the chown, which may clear set-id bits
        except OSError as e:
            self.abort()
            raise RuntimeShimError(f"write {path} in sandbox: {e.strerror}") from None

    def _open_hidden(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self._fd = os.open(self._tmp, flags, 0o600, dir_fd=self._dir)
        os.fchown(self._fd, self.uid, self.gid)
        os.fchmod(self._fd, self.mode)

    @property
    def holding(self) -> bool:
        """Whether what is written now waits in memory for ``commit`` (an existing file,
        within ``hold``), rather than going to a file at once."""
        return self._held is not None

    def write(self, data: bytes | bytearray | memoryview, *, lent: bool = False) -> None:
        """``data`` appended; ``lent``: its owner leaves it unchanged until the write ends,
        so held bytes are kept as they are (else only ``bytes`` are, others are copied)."""
        if self._ended:
            raise RuntimeShimError(f"write {self.path} in sandbox: the write has ended")
        if self._held is not None:
            if self.written + len(data) <= self._hold:
                self._held.append(data if lent else bytes(data))
                self.written += len(data)
                return
            self._spill()
        try:
            _write_all(self._fd, data)
            self.written += len(data)
        except OSError as e:
            self.abort()
            raise RuntimeShimError(f"write {self.path} in sandbox: {e.strerror}") from None

    def _spill(self) -> None:
        """Past ``hold``: the held bytes into a hidden file, written on from there."""
        held, self._held = self._held or [], None
        try:
            self._open_hidden()
            for piece in held:
                _write_all(self._fd, piece)
        except OSError as e:
            self.abort()
            raise RuntimeShimError(f"write {self.path} in sandbox: {e.strerror}") from None

    def commit(self) -> None:
        """Finish the file at the path (then nothing more may be written)."""
        if self._ended:
            raise RuntimeShimError(f"write {self.path} in sandbox: the write was aborted")
        if self._direct:
            self._close(unlink=False)
            return
        try:
            try:
                st = os.stat(self._name, dir_fd=self._dir, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is None and self._held is None:
                os.rename(self._tmp, self._name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
            elif st is None:  # held, and the sandbox removed the target meanwhile
                self._copy_into_existing()
            elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                self._copy_into_existing()
            else:
                raise _NotRegular(self.path)
        except _NotRegular:
            self.abort()
            raise _refuse("write", self.path) from None
        except OSError as e:
            self.abort()
            raise RuntimeShimError(f"write {self.path} in sandbox: {e.strerror}") from None
        self._close(unlink=False)

    def _copy_into_existing(self) -> None:
        """The finished bytes into the existing file (through a symlink, resolved inside the
        root): truncated and rewritten in place, as ``write_file`` and E2B's envd do, so its
        inode, links and watchers' ``write`` events stay. A kernel copy through the page cache
        (``sendfile``), not a clone: a clone (``copy_file_range`` on btrfs, XFS) first writes
        the new bytes to disk and waits (10 MiB on the node's btrfs pool: 22 ms, against 8 ms
        copied; the hidden file is gone before it would ever be written back). Copied over the
        old bytes, then cut to the new size: no truncate to 0 first, which on ext4 frees the
        old blocks only to allocate them again and starts a flush at close (``auto_da_alloc``),
        ~2x the commit's time for 10 MiB."""
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = _open_for_write(root_fd, self.path, self.mode, truncate=False)
        finally:
            os.close(root_fd)
        try:
            if self._held is not None:
                for piece in self._held:
                    _write_all(fd, piece)
            offset = 0 if self._held is None else self.written
            while offset < self.written:
                count = min(self.written - offset, 1 << 30)
                os.lseek(fd, offset, os.SEEK_SET)
                n = os.sendfile(fd, self._fd, offset, count)
                if n == 0:
                    raise OSError(errno.EIO, "the file shrank while it was copied")
                offset += n
            os.ftruncate(fd, self.written)
            os.fchmod(fd, self.mode)
            os.fchown(fd, self.uid, self.gid)
        finally:
            os.close(fd)
        if self._held is None:
            os.unlink(self._tmp, dir_fd=self._dir)

    def abort(self) -> None:
        """Drop what was written; the path is left as it was (idempotent)."""
        self._close(unlink=True)

    def _close(self, *, unlink: bool) -> None:
        self._ended, self._held = True, None
        if self._fd >= 0:
            ours = os.fstat(self._fd)
            os.close(self._fd)
            self._fd = -1
            name = self._name if self._direct else self._tmp
            try:  # only the file this writer made, if the sandbox did not replace it
                st = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
                if unlink and (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
                    os.unlink(name, dir_fd=self._dir)
            except FileNotFoundError:
                pass
        if self._dir >= 0:
            os.close(self._dir)
            self._dir = -1

