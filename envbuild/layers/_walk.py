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
    rootname = os.fsdecode(os.fspath(root))
    epoch = max(0, int(source_date_epoch))
    first: dict[tuple[int, int], str] = {}
    links: dict[str, tuple[int, int]] = {}  # multiply linked files seen, resolved on emission
    S_IFMT, S_IFREG, S_IFDIR, S_IFLNK = stat.S_IFMT, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK
    listxattr = listxattr_at
    if overlay_xattr not in OVERLAY_NAMESPACES:
        raise LayerError(f"pack {rootname}: unknown overlay xattr namespace {overlay_xattr!r}")
    own_prefix = overlay_xattr + ".overlay."
    own_opaque = own_prefix + "opaque"
    foreign_prefixes = tuple(n + ".overlay." for n in OVERLAY_NAMESPACES if n != overlay_xattr)

    def dropped(path: str, action: str, reason: str) -> None:
        if on_dropped is None:
            raise UnsafeLayerError(f"pack {rootname}: {path}: {reason}",
                                   hint="remove it from the tree before packing")
        on_dropped(path, action, reason)

    def special(name: str, path: str, e: Entry, st, fmt: int):
        """Devices, FIFOs and whiteouts: (sort name, entry) or None for a socket."""
        if fmt == stat.S_IFCHR and overlay_upper and st.st_rdev == 0:
            # overlayfs whiteout -> OCI whiteout (an empty regular file, mode 0600 as Docker does)
            e.path = path[:len(path) - len(name)] + WHITEOUT_PREFIX + name
            name = WHITEOUT_PREFIX + name
            e.mode = 0o600
            e.xattrs = {}
        elif fmt in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO):
            if not allow_devices:
                raise UnsafeLayerError(f"pack {rootname}: {path} is a device node or FIFO, "
                                       "refused (allow_devices=False)")
            e.type = {stat.S_IFCHR: "char", stat.S_IFBLK: "block", stat.S_IFIFO: "fifo"}[fmt]
            if fmt != stat.S_IFIFO:
                e.devmajor, e.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        else:
            return None  # socket: tar cannot represent it (GNU tar skips them too)
        return name, e

    def strip_overlay(xattrs: dict[str, bytes], path: str) -> bool:
        """Drop overlayfs attributes in place; True if the overlay's own mark an opaque dir."""
        opaque = False
        for k in list(xattrs):
            if k.startswith(own_prefix):
                if k.rsplit(".", 1)[1] in _UNSUPPORTED_OVERLAY:
                    raise LayerError(f"pack {rootname}: {path} has overlayfs attribute {k}, "
                                     "which layers cannot represent",
                                     hint="mount the overlay without redirect_dir/metacopy")
                if k == own_opaque and xattrs[k] == b"y":
                    opaque = True
                del xattrs[k]
            elif k.startswith(foreign_prefixes):
                del xattrs[k]
                dropped(path, "dropped-xattr",
                        f"{k} is not an attribute of this overlay (mounted with "
                        f"{own_prefix}*): never interpreted")
        return opaque

    def listdir(cur: DirCursor, reldir: str, reldir_len: int, opaque_dir: Entry | None):
        """The sorted members of the cursor's directory: (sort name, entry, source, opaque,
        name on disk)."""
        fd = cur.fd
        pre = cur.proc_prefix
        try:
            with os.scandir(fd) as it:
                des = list(it)
        except OSError as err:
            raise LayerError(f"pack {rootname}: list {reldir or '.'}: {err.strerror}") from err
        nodes = []
        for de in des:
            # one loop body per directory entry: this is the hot path of pack_tree
            name = de.name
            path = reldir + name
            if name.isascii():
                n = reldir_len + len(name)
            else:
                try:
                    n = reldir_len + len(name.encode("utf-8"))
                except UnicodeEncodeError:
                    raise LayerError(f"pack {rootname}: file name {path!r} is not UTF-8",
                                     hint="layer format v1 stores names as UTF-8") from None
            if n > max_path_bytes:
                raise UnsafeLayerError(f"pack {rootname}: path {path[:64]}… ({path.count('/') + 1} "
                                 f"levels) is {n} bytes long, over the {max_path_bytes}-byte "
                                 "limit of layers",
                                 hint="layers hold paths up to PATH_MAX; flatten the tree")
            st = de.stat(follow_symlinks=False)
            m = st.st_mode
            fmt = S_IFMT(m)
            if overlay_upper and name[:4] == WHITEOUT_PREFIX:
                kind = ("directory" if fmt == S_IFDIR else "symlink" if fmt == S_IFLNK
                        else "file")
                dropped(path, "dropped", f"a {kind} named {WHITEOUT_PREFIX}*: the name is "
                        "reserved for OCI whiteouts, so a layer cannot hold it")
                continue
            mtime = st.st_mtime_ns // 1_000_000_000
            mtime = epoch if mtime > epoch else (mtime if mtime > 0 else 0)
            e = Entry(path, "file", m & 0o7777, st.st_uid, st.st_gid, 0, mtime)
            try:
                names = listxattr(fd, name)
            except OSError:
                names = None  # filesystem without xattr support
            opaque = False
            if names:
                xattrs = _xattrs(pre + name, names)
                if overlay_upper:
                    opaque = strip_overlay(xattrs, path)
                if xattrs:
                    e.xattrs = dict(sorted(xattrs.items()))
            src = None
            sort_name = name
            if fmt == S_IFREG:
                e.size = st.st_size
                src = FileSource(pre + name)
                src.dir_fd, src.name = fd, name
                if st.st_nlink > 1:
                    links[path] = (st.st_dev, st.st_ino)
            elif fmt == S_IFDIR:
                e.type = "dir"
            elif fmt == S_IFLNK:
                e.type = "symlink"
                try:
                    e.linkname = os.readlink(os.fsencode(name), dir_fd=fd).decode("utf-8")
                except UnicodeDecodeError:
                    raise LayerError(f"pack {rootname}: target of symlink {path} is not "
                                     "UTF-8") from None
            else:
                got = special(name, path, e, st, fmt)
                if got is None:
                    continue
                sort_name, e = got
            nodes.append((sort_name, e, src, opaque, name, n))
        if opaque_dir is not None:  # the marker sorts among the directory's own members
            d = opaque_dir
            marker = Entry(path=d.path + "/" + OPAQUE_MARKER, type="file", mode=d.mode & 0o777,
                           uid=d.uid, gid=d.gid, mtime=d.mtime)
            nodes.append((OPAQUE_MARKER, marker, None, False, None, 0))
        # str order of valid UTF-8 names is their byte order (code points sort like UTF-8)
        nodes.sort(key=_first)
        return nodes

    # depth first with an explicit stack of sorted listings and one directory fd (the cursor
    # stands in each listing's directory while its members are emitted)
    try:
        cur = DirCursor(root)
    except OSError as err:
        raise LayerError(f"pack {rootname}: open: {err.strerror}") from err
    try:
        stack = [iter(listdir(cur, "", 0, None))]
        while stack:
            for _, e, src, opaque, name, n in stack[-1]:
                if src is not None and links and e.path in links:
                    key = links.pop(e.path)
                    target = first.get(key)
                    if target is None:
                        first[key] = e.path
                    else:
                        e.type, e.linkname, e.size, src = "hardlink", target, 0, None
                if src is not None and src.dir_fd != cur.fd:
                    # the cursor came back up from a subdirectory: its fd is a new one (the
                    # one listed was closed and its number may belong to another directory or
                    # thread by now), so name the file through the fd the cursor holds now
                    src = _refreshed(src, cur, name)
                yield e, src
                if e.type == "dir":
                    try:
                        cur.down(name)
                    except OSError as err:
                        raise LayerError(f"pack {rootname}: open {e.path}: "
                                         f"{err.strerror}") from err
                    stack.append(iter(listdir(cur, e.path + "/", n + 1, e if opaque else None)))
                    break
            else:
                stack.pop()
                if stack:
                    try:
                        cur.up()
                    except OSError as err:
                        raise LayerError(f"pack {rootname}: walk back up: {err.strerror}",
                                         hint="was the tree changed while it was packed?"
                                         ) from err
    finally:
        cur.close()


def _refreshed(src: FileSource, cur, name: str) -> FileSource:
    fresh = FileSource(cur.proc_prefix + name)
    fresh.dir_fd, fresh.name = cur.fd, name
    return fresh


def _first(node: tuple) -> str:
    return node[0]
