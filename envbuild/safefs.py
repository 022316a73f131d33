"""Opening, creating and removing paths of an *untrusted* tree without following it.

A tree a sandbox wrote, a layer named, or a tarball unpacked is hostile: any component may be a
symlink to the host's ``/etc``, a directory may be 4,096 levels deep, a name may hold ``..``.
This module is the one mechanism every unpacker, importer, snapshotter and file API uses
(STYLE.md §19, after runc's ``securejoin`` and containerd's ``fs``):

- ``open_in_root(root_fd, path, flags)``: ``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)``
  (Linux >= 5.6): the kernel resolves every component with ``root_fd`` as ``/``, symlinks and
  ``..`` included, so no path can leave the root;
- ``open_beneath(dir_fd, path, flags)``: ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``: the path
  must stay below ``dir_fd`` and no component may be a symlink at all (for trees where a
  symlink on the way is itself the attack, e.g. a layer member below a symlinked directory);
- ``remove_tree(path)``: iterative and fd-based: it never follows a symlink, never crosses
  into another mount (a mount inside a sandbox dir is a bug to report, not to delete through),
  and holds two directory fds at any depth, so a 100,000-deep tree is removed like a flat one;
- ``DirCursor``: one directory fd that moves down into a child and back up through ``..``
  (checking it comes back to the directory it left), for walks of any depth and path length
  (``envbuild.layers._walk.walk_tree``, ``iter_tree``) without recursion, ``PATH_MAX`` or one
  fd per level;
- ``iter_tree(path)``: every entry below ``path`` with the fd of its directory, unsorted;
- ``listxattr_at(dir_fd, name)``: the xattr names of ``name`` in ``dir_fd``, no-follow
  (``listxattrat(2)``, Linux >= 6.13, else through ``/proc/<pid>/fd``);
- ``read_tail(path, limit)``: the last ``limit`` bytes of a log as text, never through a
  symlink, never blocked on a FIFO put in its place (a sandbox's stderr log can be as large as
  its disk).

Everything here raises ``OSError``; callers wrap it with their own "verb object:" context.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from envbuild.libc import function

_SYS_OPENAT2 = 437  # x86_64 and aarch64 share the generic syscall number
_SYS_LISTXATTRAT = 465  # likewise (Linux 6.13)
_AT_SYMLINK_NOFOLLOW = 0x100
_syscall = function("syscall", ctypes.c_long)

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dir_fd: int, path: str | bytes, flags: int, mode: int = 0o644, *,
            resolve: int) -> int:
    """``openat2(2)``: an fd for ``path`` relative to ``dir_fd`` under ``resolve`` rules."""
    # openat2 refuses a mode without O_CREAT/O_TMPFILE (O_TMPFILE's bits include O_DIRECTORY)
    creates = flags & os.O_CREAT or flags & os.O_TMPFILE == os.O_TMPFILE
    how = _OpenHow(flags | os.O_CLOEXEC, mode if creates else 0, resolve)
    raw = os.fsencode(path)
    fd = _syscall(_SYS_OPENAT2, dir_fd, raw or b".", ctypes.byref(how),
                       ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fsdecode(raw))
    return fd


def open_in_root(root_fd: int, path: str | bytes, flags: int, mode: int = 0o644) -> int:
    """An fd for ``path`` resolved inside the directory ``root_fd`` (never outside it):
    absolute symlinks and ``..`` are taken relative to the root, as in a chroot."""
    raw = os.fsencode(path).lstrip(b"/") or b"."
    return openat2(root_fd, raw, flags, mode, resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)


def open_beneath(dir_fd: int, path: str | bytes, flags: int, mode: int = 0o644) -> int:
    """An fd for ``path`` below ``dir_fd`` where no component is a symlink (``ELOOP``) and
    none leads above ``dir_fd`` (``EXDEV``)."""
    raw = os.fsencode(path).lstrip(b"/") or b"."
    return openat2(dir_fd, raw, flags, mode,
                   resolve=RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)


_listxattrat_missing = False


def listxattr_at(dir_fd: int, name: str) -> list[str]:
    """The extended attribute names of ``name`` in ``dir_fd`` without following a symlink
    (``name`` is one component). ``listxattrat(2)`` where the kernel has it (as fast as an
    ``llistxattr`` by path, and no path to resolve); else ``llistxattr`` through the fd's
    ``/proc`` entry. Raises ``OSError``."""
    global _listxattrat_missing
    if not _listxattrat_missing:
        raw = name.encode("utf-8", "surrogateescape")
        n = _syscall(_SYS_LISTXATTRAT, dir_fd, raw, _AT_SYMLINK_NOFOLLOW, None, 0)
        if n == 0:
            return []  # most files: one syscall, no buffer
        if n > 0:
            buf = ctypes.create_string_buffer(n + 256)  # room for one racing addition
            n = _syscall(_SYS_LISTXATTRAT, dir_fd, raw, _AT_SYMLINK_NOFOLLOW, buf, n + 256)
            if n >= 0:
                return [os.fsdecode(k) for k in buf.raw[:n].split(b"\0") if k]
        err = ctypes.get_errno()
        if err != errno.ENOSYS:
            raise OSError(err, os.strerror(err), name)
        _listxattrat_missing = True
    return os.listxattr(proc_path(dir_fd, name), follow_symlinks=False)


def read_tail(path: str | os.PathLike[str], limit: int) -> str:
    """The last ``limit`` bytes of the regular file ``path``, decoded (invalid UTF-8
    replaced). No component's symlink is followed at the end, a FIFO or device in its place is
    refused without blocking (``OSError`` ``EINVAL``), and memory stays ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        return os.pread(fd, limit, max(0, st.st_size - limit)).decode(errors="replace")
    finally:
        os.close(fd)


def proc_path(dir_fd: int, name: str = "") -> str:
    """``name`` in directory ``dir_fd`` as a short path through ``/proc/<pid>/fd`` (for calls
    that take no ``dir_fd``): resolved from the fd at any depth; the last component is not
    followed by no-follow calls."""
    return f"/proc/{os.getpid()}/fd/{dir_fd}/{name}"


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def remove_tree(path: str | os.PathLike[str], *, missing_ok: bool = True,
                dir_fd: int | None = None) -> None:
    """Delete ``path`` and everything below it without following symlinks or crossing mounts.

    Depth costs no recursion and no file descriptors: the walk keeps the names and identities
    of the directories above it and climbs back with ``..``, checking each parent is the one it
    came from (a concurrent rename is an error, never a delete elsewhere). ``path`` itself may
    be a file or a symlink (then only the link goes). A directory on another device below
    ``path`` raises ``OSError(EXDEV)`` (unmount first: deleting through a mount would delete
    another filesystem's files). With ``dir_fd``, ``path`` is a name in that directory (the
    way to remove below a directory whose own path may be longer than ``PATH_MAX``, and how
    the unpacker removes through its verified directory fds)."""
    path = os.fspath(path)
    try:
        fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        os.unlink(path, dir_fd=dir_fd)  # a file or a symlink: remove the name only
        return
    ancestors = [_identity(fd)]
    names: list[str] = []
    try:
        while True:
            child = _first_subdir_emptying(fd, ancestors[0][0])
            if child is not None:
                name, child_fd = child
                names.append(name)
                ancestors.append(_identity(child_fd))
                os.close(fd)
                fd = child_fd
                continue
            if not names:
                break
            up = os.open("..", _DIR_FLAGS, dir_fd=fd)
            if _identity(up) != ancestors[-2]:
                os.close(up)
                raise OSError(errno.ESTALE, "directory moved while it was being removed",
                              os.path.join(path, *names))
            os.close(fd)
            fd = up
            ancestors.pop()
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path, dir_fd=dir_fd)


def _first_subdir_emptying(dir_fd: int, device: int) -> tuple[str, int] | None:
    """Unlink every non-directory in ``dir_fd`` and return its first subdirectory (name and
    fd), or None when none is left; a subdirectory on another device raises ``EXDEV``."""
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                try:
                    os.unlink(entry.name, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
                continue
            child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
            if os.fstat(child).st_dev != device:
                os.close(child)
                raise OSError(errno.EXDEV, "a mount point is inside the tree being removed",
                              entry.name)
            return entry.name, child
    return None


class DirCursor:
    """One open directory fd walking a tree: ``down(name)`` into a subdirectory (never through
    a symlink: ``O_NOFOLLOW``), ``up()`` back through ``..``, which must be the directory it
    came from (a rename during the walk raises ``ESTALE`` instead of walking elsewhere).

    Any depth costs one fd and the ``(st_dev, st_ino)`` of each ancestor, so trees deeper than
    the recursion limit and paths longer than ``PATH_MAX`` are walked like flat ones.
    ``proc_prefix`` names the current directory through ``/proc/<pid>/fd`` for the calls that
    take no ``dir_fd`` (``listxattr``, ``getxattr``, opening a file to read later): a short
    path at any depth, resolved by the kernel from the fd, not from the walk's path.
    ``same_device`` makes ``down`` refuse another mount (``EXDEV``)."""

    def __init__(self, path: str | bytes | os.PathLike, *, same_device: bool = False) -> None:
        self.fd = os.open(path, _DIR_FLAGS & ~os.O_NOFOLLOW)  # the caller named the root
        self._ancestors = [_identity(self.fd)]
        self._same_device = same_device
        self.proc_prefix = proc_path(self.fd)

    @property
    def depth(self) -> int:
        return len(self._ancestors) - 1

    def down(self, name: str | bytes) -> None:
        child = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        ident = _identity(child)
        if self._same_device and ident[0] != self._ancestors[0][0]:
            os.close(child)
            raise OSError(errno.EXDEV, "a mount point is inside the tree", os.fsdecode(name))
        os.close(self.fd)
        self.fd = child
        self._ancestors.append(ident)
        self.proc_prefix = proc_path(child)

    def up(self) -> None:
        if len(self._ancestors) < 2:
            raise ValueError("DirCursor.up() at the root")
        parent = os.open("..", _DIR_FLAGS, dir_fd=self.fd)
        if _identity(parent) != self._ancestors[-2]:
            os.close(parent)
            raise OSError(errno.ESTALE, "directory moved while the tree was walked")
        os.close(self.fd)
        self.fd = parent
        self._ancestors.pop()
        self.proc_prefix = proc_path(parent)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirCursor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_tree(path: str | bytes | os.PathLike, *, same_device: bool = False):
    """``(parts, dir_fd, entry)`` for every entry below ``path`` (depth first, unsorted):
    ``parts`` the names of the directories from ``path`` down to the entry's directory (one
    list, changed as the walk goes: join it while the entry is current, ``b"/".join(parts)``),
    ``entry`` an ``os.DirEntry`` of a scan of ``dir_fd`` (its ``stat`` is relative to that fd).
    Symlinks are entries, never followed; ``dir_fd`` is valid until the next entry is taken.
    Iterative, one fd and O(depth) memory at any depth (``DirCursor``)."""
    with DirCursor(path, same_device=same_device) as cur:
        parts: list[bytes] = []
        stack: list[list[bytes]] = [[]]  # per level: subdirectories not visited yet
        pending = True  # the top level still needs its listing
        while stack:
            subdirs = stack[-1]
            if pending:
                pending = False
                with os.scandir(cur.fd) as it:
                    for entry in it:
                        yield parts, cur.fd, entry
                        if entry.is_dir(follow_symlinks=False):
                            subdirs.append(os.fsencode(entry.name))
                subdirs.reverse()
            if subdirs:
                name = subdirs.pop()
                cur.down(name)
                parts.append(name)
                stack.append([])
                pending = True
                continue
            stack.pop()
            if stack:
                cur.up()
                parts.pop()
