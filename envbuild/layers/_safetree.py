"""Every change below one root directory through verified directory fds: the writing half of the
one safe unpacker (``_unpack`` for envbuild layers, ``_untar`` for foreign tars).

- every parent directory is reached through a directory fd opened component by component with
  ``O_NOFOLLOW | O_DIRECTORY`` from the root fd (or ``safefs.open_beneath``), and cached; a
  symlink on the way (planted by this tar or a layer below) refuses the member
  (``UnsafeLayerError``) — containerd would resolve it inside the root, envbuild refuses;
- every create, replace, remove, chmod and whiteout is an ``*at`` call on that fd with one
  name, so no path is ever resolved again; directories are removed with
  ``safefs.remove_tree(dir_fd=...)``;
- long runs of zero bytes in a file are written as holes (a 64 KiB window that compares equal
  to zeros is skipped, then ``ftruncate``), so a sparse file in a snapshot stays sparse.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable

from envbuild.errors import CorruptLayerError, LayerError, UnsafeLayerError
from envbuild.layers._toc import Entry
from envbuild.safefs import open_beneath, remove_tree

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FD_CACHE = 256        # directory fds kept open (tars are mostly depth-first: high locality)
HOLE = 1 << 16        # zero windows of this size become holes
_ZERO_HOLE = bytes(HOLE)
SPARSE_MIN = HOLE     # smaller files are written as they are


class SafeTree:
    """Every change below one root directory, through verified directory fds (never a path
    resolved twice, never a symlink followed)."""

    def __init__(self, root_fd: int, name: str) -> None:
        self.root_fd = root_fd
        self.name = name
        self.fds: dict[str, int] = {"": root_fd}
        self.files: set[str] = set()  # regular files extracted so far (layer hardlink targets)

    def close(self) -> None:
        for rel, fd in self.fds.items():
            if rel:
                os.close(fd)
        # in place: unpack_layer holds this dict (a stale copy would hold closed fd numbers)
        self.fds.clear()
        self.fds[""] = self.root_fd

    def parent(self, parts: list[str], path: str, create: bool = True) -> int | None:
        """A verified fd of the directory holding ``parts[-1]``, creating missing directories
        (0755); None (only with ``create=False``) if one is missing. The fd belongs to the
        cache. Levels of a very deep path beyond the cache's bound are walked through and
        closed, so depth costs neither recursion nor more than ``FD_CACHE`` + 1 fds."""
        rel = "/".join(parts[:-1])
        fd = self.fds.get(rel)
        if fd is not None:
            return fd
        i = len(parts) - 1
        while i > 0 and "/".join(parts[:i]) not in self.fds:
            i -= 1
        fd = self.fds["/".join(parts[:i])]
        owned = False  # fd is a walked-through level, not in the cache: close it after use
        try:
            for j in range(i, len(parts) - 1):
                comp = parts[j]
                try:
                    child = os.open(comp, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        return None
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    child = os.open(comp, DIR_FLAGS, dir_fd=fd)
                except NotADirectoryError:
                    p = "/".join(parts[:j + 1])
                    if stat.S_ISLNK(os.stat(comp, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise UnsafeLayerError(f"layer {self.name}: member {path!r} would be "
                                               f"written through the symlink {p!r}") from None
                    raise LayerError(f"layer {self.name}: member {path!r} needs {p!r} to be a "
                                     "directory, but it is not") from None
                if owned:
                    os.close(fd)
                fd = child
                if j == len(parts) - 2 or len(self.fds) < FD_CACHE:
                    self.fds["/".join(parts[:j + 1])] = child
                    owned = False
                else:
                    owned = True
            return fd
        finally:
            if owned:
                os.close(fd)

    def parent_made(self, parts: list[str], path: str) -> int:
        """``parent`` with missing directories created: always an fd."""
        fd = self.parent(parts, path)
        assert fd is not None, "parent(create=True) returned no fd"  # a bug, never input
        return fd

    def evict(self) -> None:
        """Bound the fd cache. Called between members only: an fd handed out for the current
        member (its parent, a hardlink's target dir) stays open until the member is done."""
        if len(self.fds) > FD_CACHE:
            # drop the older half (dicts keep insertion order): the newest entries are the
            # current member's ancestors, so a deep or long tar keeps hitting the cache
            for rel in list(self.fds)[1:len(self.fds) // 2]:
                os.close(self.fds.pop(rel))

    def forget(self, rel: str) -> None:
        """The directory ``rel`` was removed: forget it and everything below it, so nothing is
        later written or hardlinked through whatever replaces it."""
        prefix = rel + "/"
        for d in [d for d in self.fds if d == rel or d.startswith(prefix)]:
            if d:
                os.close(self.fds.pop(d))
        if self.files:
            self.files = {f for f in self.files if not f.startswith(prefix)}

    def remove(self, pfd: int, base: str, rel: str) -> bool:
        """Remove whatever is at ``base`` in ``pfd`` (never following it); True if it existed."""
        try:
            st = os.stat(base, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            self.forget(rel)
            remove_tree(base, dir_fd=pfd)
        else:
            os.unlink(base, dir_fd=pfd)
        self.files.discard(rel)
        return True

    def create_file(self, pfd: int, base: str, rel: str) -> int:
        try:
            return os.open(base, _CREATE, 0o600, dir_fd=pfd)
        except FileExistsError:
            self.remove(pfd, base, rel)
            return os.open(base, _CREATE, 0o600, dir_fd=pfd)

    def mkdir(self, pfd: int, base: str, rel: str) -> None:
        try:
            os.mkdir(base, 0o700, dir_fd=pfd)
        except FileExistsError:
            if not stat.S_ISDIR(os.stat(base, dir_fd=pfd, follow_symlinks=False).st_mode):
                os.unlink(base, dir_fd=pfd)
                os.mkdir(base, 0o700, dir_fd=pfd)

    def node(self, pfd: int, base: str, rel: str, e: Entry, same_owner: bool,
             mode_mask: int = 0o7777) -> None:
        """A symlink, FIFO or device node (replacing what is there)."""
        self.remove(pfd, base, rel)
        if e.type == "symlink":
            os.symlink(e.linkname, base, dir_fd=pfd)
        elif e.type == "fifo":
            os.mkfifo(base, 0o600, dir_fd=pfd)
        else:
            fmt = stat.S_IFCHR if e.type == "char" else stat.S_IFBLK
            os.mknod(base, fmt | 0o600, os.makedev(e.devmajor, e.devminor), dir_fd=pfd)
        if same_owner:
            os.chown(base, e.uid, e.gid, dir_fd=pfd, follow_symlinks=False)
        if e.type != "symlink":
            os.chmod(base, e.mode & mode_mask, dir_fd=pfd)  # just created by us: not a symlink
            for k, v in e.xattrs.items():
                # no *xattrat in Python: the verified dir fd's /proc name, then one name
                set_xattr(f"/proc/self/fd/{pfd}/{base}", k, v, f"layer {self.name}", rel)
        os.utime(base, (e.mtime, e.mtime), dir_fd=pfd, follow_symlinks=False)

    def hardlink(self, pfd: int, base: str, rel: str, target: list[str], tpath: str) -> None:
        tfd = self.parent(target, tpath, create=False)
        if tfd is None or not stat.S_ISREG(os.stat(target[-1], dir_fd=tfd,
                                                   follow_symlinks=False).st_mode):
            raise UnsafeLayerError(f"layer {self.name}: hardlink {rel!r} points to {tpath!r}, "
                                   "which is not a regular file in the tree")
        self.remove(pfd, base, rel)
        os.link(target[-1], base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)

    def finish_dirs(self, dir_meta: list[tuple[str, Entry]], same_owner: bool) -> None:
        """Directory metadata last, deepest first: a mode may forbid writes, and creating
        children would bump mtimes. A directory replaced since (by a later member or a
        whiteout) is skipped: its fd is opened no-follow, never through what replaced it."""
        self.close()
        for rel, e in reversed(dir_meta):
            try:
                fd = open_dir_beneath(self.root_fd, rel) if rel else os.dup(self.root_fd)
            except OSError as err:
                if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue
                raise
            try:
                apply_meta(fd, e, same_owner, self.name, rel)
            finally:
                os.close(fd)


def apply_meta(fd: int, e: Entry, same_owner: bool, name: str, rel: str,
                mode_mask: int = 0o7777) -> None:
    """Owner (when restoring owners), xattrs, mode (``& mode_mask``) and mtime of ``e`` onto
    the open ``fd`` (member ``rel`` of layer ``name``, for errors). Xattrs before the mode: a
    user who is not root may not set ``user.*`` on a file the mode makes read-only; after the
    owner, whose change clears ``security.capability``."""
    if same_owner:
        os.fchown(fd, e.uid, e.gid)
    for k, v in e.xattrs.items():
        set_xattr(fd, k, v, f"layer {name}", rel)
    os.fchmod(fd, e.mode & mode_mask)
    os.utime(fd, (e.mtime, e.mtime))


def set_xattr(target: int | str, key: str, value: bytes, where: str, rel: str, *,
              drop_unsupported: bool = False) -> None:
    """``setxattr`` of one member's attribute (``target``: an fd, or a path never followed),
    a refusal of the kernel raised as one line naming ``where`` (the layer), the member and
    the attribute: an invalid ``security.capability`` value (a hand-made layer's) is EINVAL,
    which said only "[Errno 22] Invalid argument: 5" before (issue 34). With
    ``drop_unsupported`` an attribute this filesystem cannot hold is dropped, as GNU tar does."""
    try:
        if isinstance(target, str):
            os.setxattr(target, key, value, follow_symlinks=False)
        else:
            os.setxattr(target, key, value)
    except OSError as err:
        if drop_unsupported and err.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return
        why = " (not a file capability of a known version)" \
            if key == "security.capability" and err.errno == errno.EINVAL else ""
        raise CorruptLayerError(f"{where}: member {rel!r}: the kernel refuses its xattr "
                                f"{key!r}: {err.strerror}{why}",
                                hint="rebuild the layer from a real tree, or without that "
                                     "attribute") from None


def open_dir_beneath(root_fd: int, rel: str) -> int:
    """``safefs.open_beneath`` of a directory, in steps of < 2 KiB of path, so a tree deeper
    than ``PATH_MAX`` resolves too (each step from the verified fd of the one before)."""
    if len(rel) < 2048:
        return open_beneath(root_fd, rel, DIR_FLAGS)
    fd = os.dup(root_fd)
    pos = 0
    try:
        while pos < len(rel):
            end = pos + 2048
            if end >= len(rel):
                step, pos = rel[pos:], len(rel)
            else:
                cut = rel.rfind("/", pos, end)
                if cut <= pos:
                    raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), rel)
                step, pos = rel[pos:cut], cut + 1
            nfd = open_beneath(fd, step, DIR_FLAGS)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_data(fd: int, pieces: Iterable, sparse: bool, h) -> int:
    """Write ``pieces`` to ``fd`` (hashing them into ``h``); with ``sparse``, 64 KiB windows of
    zeros become holes. Returns the byte count."""
    got = 0
    write = os.write
    hole = False
    for piece in pieces:
        h.update(piece)
        n = len(piece)
        got += n
        if sparse:
            pos = start = 0  # piece[start:pos] is data not yet written
            while pos < n:
                end = pos + HOLE
                # first/last byte first: data that is not zero fails without a copy
                if end <= n and piece[pos] == 0 and piece[end - 1] == 0 \
                        and bytes(piece[pos:end]) == _ZERO_HOLE:
                    w = piece[start:pos]
                    while w:
                        w = w[write(fd, w):]
                    os.lseek(fd, HOLE, os.SEEK_CUR)
                    hole = True
                    start = end
                pos = end
            w = piece[start:n]
            if w:
                hole = False
            while w:
                w = w[write(fd, w):]
            continue
        while piece:
            piece = piece[write(fd, piece):]
    if hole:
        os.ftruncate(fd, got)
    return got


def open_root(dest) -> tuple[int, str]:
    if isinstance(dest, int):
        return os.dup(dest), f"fd {dest}"
    root = os.fspath(dest).rstrip("/") or "/"
    os.makedirs(root, exist_ok=True)
    return os.open(root, DIR_FLAGS), root


class NoHash:
    """A hash that hashes nothing (``write_data`` for foreign tars, which carry no digests)."""

    @staticmethod
    def update(_data) -> None:
        pass
