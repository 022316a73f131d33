"""Walk a directory tree into sorted, normalised TOC entries (no file contents read here).

The walk is iterative and fd-based (``envbuild.safefs.DirCursor``): one directory fd at any
depth, every name opened relative to it without following symlinks, so a 4,096-deep tree
made in a sandbox costs no recursion, no ``PATH_MAX`` failure and no fd per level. Paths
longer than ``MAX_PATH_BYTES`` are refused: they would not unpack (unpackers open a member
relative to the root fd, which ``PATH_MAX`` limits).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator

from envbuild.errors import LayerError, UnsafeLayerError
from envbuild.layers._names import OPAQUE_MARKER, WHITEOUT_PREFIX
from envbuild.layers._toc import Entry
from envbuild.safefs import DirCursor, listxattr_at

_UNSUPPORTED_OVERLAY = ("redirect", "metacopy")
OVERLAY_NAMESPACES = ("trusted", "user")  # overlayfs keeps its markers in trusted.overlay.*,
#                                            or user.overlay.* when mounted with userxattr
MAX_PATH_BYTES = 4095  # PATH_MAX (4096) less the NUL: the longest path openat2 resolves

#: ``on_dropped(path, action, reason)``: told about every member or attribute the overlay
#: conversion leaves out (same signature as ``runtime_shim.node.packdiff.PolicyReport.note``)
OnDropped = Callable[[str, str, str], None]


class FileSource(str):
    """Where the walk found a regular file: a path through ``/proc/<pid>/fd`` (usable wherever
    a path is, valid until the walk moves on) carrying the directory fd and the name, so the
    writer opens it with ``openat(dir_fd, name, O_NOFOLLOW)``: no path to resolve at all."""

    dir_fd: int
    name: str


def _xattrs(path: str, names: list[str]) -> dict[str, bytes]:
    out = {}
    for n in names:
        try:
            out[n] = os.getxattr(path, n, follow_symlinks=False)
        except OSError:
            continue  # vanished or not readable by this user
    return out


def walk_tree(root: str | os.PathLike, *, source_date_epoch: int = 0,
              overlay_upper: bool = False, allow_devices: bool = True,
              overlay_xattr: str = "trusted", on_dropped: OnDropped | None = None,
              max_path_bytes: int = MAX_PATH_BYTES,
              ) -> Iterator[tuple[Entry, str | None]]:
    """Entries of every member below ``root`` (the root itself is not a member), each with a
    path to read a regular file's contents from, in layer order: depth first, the members of
    each directory sorted by name bytes (GNU tar's ``--sort=name`` order, i.e. paths compared
    component by component).

    A generator, so the writer packs while the walk goes on. The source path goes through
    ``/proc/<pid>/fd`` of the walk's directory fd: it is valid only until the next entry is
    taken (the writer opens it at once; a filter must not hold it). Applies the determinism
    rules (mtime clamped to ``source_date_epoch``, hardlinks to the first path in layer order).
    Sockets are skipped: tar cannot hold them.

    With ``overlay_upper`` the tree is an overlayfs upper dir mounted with the
    ``overlay_xattr`` namespace (``trusted``, or ``user`` for ``userxattr``), and only the
    overlay's own markers become OCI ones: a 0/0 character device becomes a whiteout
    ``.wh.NAME``, ``<overlay_xattr>.overlay.opaque=y`` an opaque marker (sorted under their OCI
    names); the overlay's other ``<overlay_xattr>.overlay.*`` attributes are dropped. Whatever
    merely *looks* like a marker is content the writer of the tree chose and is never
    interpreted: a file, directory or symlink whose name starts with ``.wh.`` (OCI reserves
    those names, a layer cannot hold them) and ``overlay.*`` attributes of the other namespace
    are left out, each reported to ``on_dropped``; without ``on_dropped`` they are refused
    (``UnsafeLayerError``). A path longer than ``max_path_bytes`` is refused (``LayerError``).
    """
    walk = _Walk(os.fsdecode(os.fspath(root)), source_date_epoch, overlay_upper, allow_devices,
                 overlay_xattr, on_dropped, max_path_bytes)
    yield from walk.entries(root)


class _Walk:
    """One ``walk_tree``: its options, and the hardlinks seen so far."""

    def __init__(self, rootname: str, source_date_epoch: int, overlay_upper: bool,
                 allow_devices: bool, overlay_xattr: str, on_dropped: OnDropped | None,
                 max_path_bytes: int) -> None:
        if overlay_xattr not in OVERLAY_NAMESPACES:
            raise LayerError(f"pack {rootname}: unknown overlay xattr namespace "
                             f"{overlay_xattr!r}")
        self.rootname = rootname
        self.epoch = max(0, int(source_date_epoch))
        self.overlay_upper, self.allow_devices = overlay_upper, allow_devices
        self.on_dropped, self.max_path_bytes = on_dropped, max_path_bytes
        self.own_prefix = overlay_xattr + ".overlay."
        self.own_opaque = self.own_prefix + "opaque"
        self.foreign_prefixes = tuple(n + ".overlay." for n in OVERLAY_NAMESPACES
                                      if n != overlay_xattr)
        self.first: dict[tuple[int, int], str] = {}
        self.links: dict[str, tuple[int, int]] = {}  # multiply linked files, resolved on emission

    def entries(self, root: str | os.PathLike) -> Iterator[tuple[Entry, str | None]]:
        """Depth first with an explicit stack of sorted listings and one directory fd (the
        cursor stands in each listing's directory while its members are emitted)."""
        rootname = self.rootname
        try:
            cur = DirCursor(root)
        except OSError as err:
            raise LayerError(f"pack {rootname}: open: {err.strerror}") from err
        try:
            stack = [iter(self.listdir(cur, "", 0, None))]
            while stack:
                for _, e, src, opaque, name, n in stack[-1]:
                    if src is not None and self.links and e.path in self.links:
                        src = self.link(e, src)
                    if src is not None and src.dir_fd != cur.fd:
                        # the cursor came back up from a subdirectory: its fd is a new one (the
                        # one listed was closed and its number may belong to another directory
                        # or thread by now), so name the file through the fd the cursor holds
                        src = _refreshed(src, cur, name)
                    yield e, src
                    if e.type == "dir":
                        try:
                            cur.down(name)
                        except OSError as err:
                            raise LayerError(f"pack {rootname}: open {e.path}: "
                                             f"{err.strerror}") from err
                        stack.append(iter(self.listdir(cur, e.path + "/", n + 1,
                                                       e if opaque else None)))
                        break
                else:
                    stack.pop()
                    if stack:
                        self.up(cur)
        finally:
            cur.close()

    def up(self, cur: DirCursor) -> None:
        try:
            cur.up()
        except OSError as err:
            raise LayerError(f"pack {self.rootname}: walk back up: {err.strerror}",
                             hint="was the tree changed while it was packed?") from err

    def link(self, e: Entry, src: FileSource) -> FileSource | None:
        """A multiply linked file: the first path in layer order keeps the contents, the
        others become hardlinks to it (``src`` None)."""
        key = self.links.pop(e.path)
        target = self.first.get(key)
        if target is None:
            self.first[key] = e.path
            return src
        e.type, e.linkname, e.size = "hardlink", target, 0
        return None

    def dropped(self, path: str, action: str, reason: str) -> None:
        if self.on_dropped is None:
            raise UnsafeLayerError(f"pack {self.rootname}: {path}: {reason}",
                                   hint="remove it from the tree before packing")
        self.on_dropped(path, action, reason)

    def special(self, name: str, path: str, e: Entry, st, fmt: int):
        """Devices, FIFOs and whiteouts: (sort name, entry) or None for a socket."""
        if fmt == stat.S_IFCHR and self.overlay_upper and st.st_rdev == 0:
            # overlayfs whiteout -> OCI whiteout (an empty regular file, mode 0600 as Docker does)
            e.path = path[:len(path) - len(name)] + WHITEOUT_PREFIX + name
            name = WHITEOUT_PREFIX + name
            e.mode = 0o600
            e.xattrs = {}
        elif fmt in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO):
            if not self.allow_devices:
                raise UnsafeLayerError(f"pack {self.rootname}: {path} is a device node or FIFO, "
                                       "refused (allow_devices=False)")
            e.type = {stat.S_IFCHR: "char", stat.S_IFBLK: "block", stat.S_IFIFO: "fifo"}[fmt]
            if fmt != stat.S_IFIFO:
                e.devmajor, e.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        else:
            return None  # socket: tar cannot represent it (GNU tar skips them too)
        return name, e

    def strip_overlay(self, xattrs: dict[str, bytes], path: str) -> bool:
        """Drop overlayfs attributes in place; True if the overlay's own mark an opaque dir."""
        opaque = False
        for k in list(xattrs):
            if k.startswith(self.own_prefix):
                if k.rsplit(".", 1)[1] in _UNSUPPORTED_OVERLAY:
                    raise LayerError(f"pack {self.rootname}: {path} has overlayfs attribute "
                                     f"{k}, which layers cannot represent",
                                     hint="mount the overlay without redirect_dir/metacopy")
                if k == self.own_opaque and xattrs[k] == b"y":
                    opaque = True
                del xattrs[k]
            elif k.startswith(self.foreign_prefixes):
                del xattrs[k]
                self.dropped(path, "dropped-xattr",
                             f"{k} is not an attribute of this overlay (mounted with "
                             f"{self.own_prefix}*): never interpreted")
        return opaque

    def listdir(self, cur: DirCursor, reldir: str, reldir_len: int, opaque_dir: Entry | None):
        """The sorted members of the cursor's directory: (sort name, entry, source, opaque,
        name on disk, path length in bytes)."""
        try:
            with os.scandir(cur.fd) as it:
                des = list(it)
        except OSError as err:
            raise LayerError(f"pack {self.rootname}: list {reldir or '.'}: "
                             f"{err.strerror}") from err
        member = self.member
        nodes = [node for de in des
                 if (node := member(cur, de, reldir, reldir_len)) is not None]
        if opaque_dir is not None:  # the marker sorts among the directory's own members
            d = opaque_dir
            marker = Entry(path=d.path + "/" + OPAQUE_MARKER, type="file", mode=d.mode & 0o777,
                           uid=d.uid, gid=d.gid, mtime=d.mtime)
            nodes.append((OPAQUE_MARKER, marker, None, False, None, 0))
        # str order of valid UTF-8 names is their byte order (code points sort like UTF-8)
        nodes.sort(key=_first)
        return nodes

    def path_bytes(self, name: str, path: str, reldir_len: int) -> int:
        """The length of ``path`` in UTF-8 bytes; ``LayerError`` past ``max_path_bytes``."""
        if name.isascii():
            n = reldir_len + len(name)
        else:
            try:
                n = reldir_len + len(name.encode("utf-8"))
            except UnicodeEncodeError:
                raise LayerError(f"pack {self.rootname}: file name {path!r} is not UTF-8",
                                 hint="layer format v1 stores names as UTF-8") from None
        if n > self.max_path_bytes:
            raise UnsafeLayerError(f"pack {self.rootname}: path {path[:64]}… "
                                   f"({path.count('/') + 1} levels) is {n} bytes long, over the "
                                   f"{self.max_path_bytes}-byte limit of layers",
                                   hint="layers hold paths up to PATH_MAX; flatten the tree")
        return n

    def member(self, cur: DirCursor, de: os.DirEntry, reldir: str, reldir_len: int):
        """One directory entry as (sort name, entry, source, opaque, name, path bytes), or None
        to leave it out. This is the hot path of ``pack_tree``: one call per member."""
        name = de.name
        path = reldir + name
        n = self.path_bytes(name, path, reldir_len)
        st = de.stat(follow_symlinks=False)
        m = st.st_mode
        fmt = stat.S_IFMT(m)
        if self.overlay_upper and name[:4] == WHITEOUT_PREFIX:
            kind = ("directory" if fmt == stat.S_IFDIR else "symlink" if fmt == stat.S_IFLNK
                    else "file")
            self.dropped(path, "dropped", f"a {kind} named {WHITEOUT_PREFIX}*: the name is "
                         "reserved for OCI whiteouts, so a layer cannot hold it")
            return None
        mtime = st.st_mtime_ns // 1_000_000_000
        epoch = self.epoch
        mtime = epoch if mtime > epoch else (mtime if mtime > 0 else 0)
        e = Entry(path, "file", m & 0o7777, st.st_uid, st.st_gid, 0, mtime)
        opaque = self.xattrs(cur, name, path, e)
        src = None
        sort_name = name
        if fmt == stat.S_IFREG:
            e.size = st.st_size
            src = FileSource(cur.proc_prefix + name)
            src.dir_fd, src.name = cur.fd, name
            if st.st_nlink > 1:
                self.links[path] = (st.st_dev, st.st_ino)
        elif fmt == stat.S_IFDIR:
            e.type = "dir"
        elif fmt == stat.S_IFLNK:
            e.type = "symlink"
            try:
                e.linkname = os.readlink(os.fsencode(name), dir_fd=cur.fd).decode("utf-8")
            except UnicodeDecodeError:
                raise LayerError(f"pack {self.rootname}: target of symlink {path} is not "
                                 "UTF-8") from None
        else:
            got = self.special(name, path, e, st, fmt)
            if got is None:
                return None
            sort_name, e = got
        return sort_name, e, src, opaque, name, n

    def xattrs(self, cur: DirCursor, name: str, path: str, e: Entry) -> bool:
        """Set ``e.xattrs`` from the file (overlay markers stripped); True if it marks an
        opaque directory of the overlay."""
        try:
            names = listxattr_at(cur.fd, name)
        except OSError:
            return False  # filesystem without xattr support
        if not names:
            return False
        xattrs = _xattrs(cur.proc_prefix + name, names)
        opaque = self.strip_overlay(xattrs, path) if self.overlay_upper else False
        if xattrs:
            e.xattrs = dict(sorted(xattrs.items()))
        return opaque


def _refreshed(src: FileSource, cur, name: str) -> FileSource:
    fresh = FileSource(cur.proc_prefix + name)
    fresh.dir_fd, fresh.name = cur.fd, name
    return fresh


def _first(node: tuple) -> str:
    return node[0]
