"""Walk a directory tree into sorted, normalised TOC entries (no file contents read here)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

from envbuild.errors import LayerError, UnsafeLayerError
from envbuild.layers._toc import Entry

OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_OVERLAY_PREFIXES = ("trusted.overlay.", "user.overlay.")
_UNSUPPORTED_OVERLAY = ("redirect", "metacopy")
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"


def _xattrs(path: bytes, names: list[str]) -> dict[str, bytes]:
    out = {}
    for n in names:
        try:
            out[n] = os.getxattr(path, n, follow_symlinks=False)
        except OSError:
            continue  # vanished or not readable by this user
    return out


def walk_tree(root: str | os.PathLike, *, source_date_epoch: int = 0,
              overlay_upper: bool = False, allow_devices: bool = True
              ) -> Iterator[tuple[Entry, bytes | None]]:
    """Entries of every member below ``root`` (the root itself is not a member), each with the
    absolute path to read a regular file's contents from, in layer order: depth first, the
    members of each directory sorted by name bytes (GNU tar's ``--sort=name`` order, i.e. paths
    compared component by component).

    A generator, so the writer packs while the walk goes on. Applies the determinism rules
    (mtime clamped to ``source_date_epoch``, hardlinks to the first path in layer order) and,
    with ``overlay_upper``, converts overlayfs whiteouts and opaque directories to their OCI
    form (sorted under their OCI names). Sockets are skipped: tar cannot hold them.
    """
    rootb = os.fsencode(root)
    rootname = os.fsdecode(rootb)
    epoch = max(0, int(source_date_epoch))
    first: dict[tuple[int, int], str] = {}
    links: dict[str, tuple[int, int]] = {}  # multiply linked files seen, resolved on emission
    S_IFMT, S_IFREG, S_IFDIR, S_IFLNK = stat.S_IFMT, stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK
    listxattr = os.listxattr

    def special(de: os.DirEntry, path: str, e: Entry, st, fmt: int, absp: bytes):
        """Devices, FIFOs and whiteouts: (sort name, entry) or None for a socket."""
        name = de.name
        if fmt == stat.S_IFCHR and overlay_upper and st.st_rdev == 0:
            # overlayfs whiteout -> OCI whiteout (an empty regular file, mode 0600 as Docker does)
            name = b".wh." + name
            e.path = path[:len(path) - len(de.name.decode())] + name.decode()
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

    def listdir(absdir: bytes, reldir: bytes, opaque_dir: Entry | None) -> list:
        """The sorted members of one directory: (sort name, entry, source, opaque, abs, rel)."""
        try:
            with os.scandir(absdir) as it:
                des = list(it)
        except OSError as err:
            raise LayerError(f"pack {rootname}: list {os.fsdecode(absdir)}: "
                             f"{err.strerror}") from err
        nodes = []
        for de in des:
            # one loop body per directory entry: this is the hot path of pack_tree
            absp = de.path
            rel = reldir + de.name
            st = de.stat(follow_symlinks=False)
            try:
                path = rel.decode("utf-8")
            except UnicodeDecodeError:
                raise LayerError(f"pack {rootname}: file name {os.fsdecode(rel)!r} is not UTF-8",
                                 hint="layer format v1 stores names as UTF-8") from None
            m = st.st_mode
            fmt = S_IFMT(m)
            mtime = st.st_mtime_ns // 1_000_000_000
            mtime = epoch if mtime > epoch else (mtime if mtime > 0 else 0)
            e = Entry(path, "file", m & 0o7777, st.st_uid, st.st_gid, 0, mtime)
            try:
                names = listxattr(absp, follow_symlinks=False)
            except OSError:
                names = None  # filesystem without xattr support
            opaque = False
            if names:
                xattrs = _xattrs(absp, names)
                if overlay_upper:
                    opaque = _strip_overlay(xattrs, rootname, path)
                if xattrs:
                    e.xattrs = dict(sorted(xattrs.items()))
            src = None
            name = de.name
            if fmt == S_IFREG:
                e.size = st.st_size
                src = absp
                if st.st_nlink > 1:
                    links[path] = (st.st_dev, st.st_ino)
            elif fmt == S_IFDIR:
                e.type = "dir"
            elif fmt == S_IFLNK:
                e.type = "symlink"
                try:
                    e.linkname = os.readlink(absp).decode("utf-8")
                except UnicodeDecodeError:
                    raise LayerError(f"pack {rootname}: target of symlink {path} is not "
                                     "UTF-8") from None
            else:
                got = special(de, path, e, st, fmt, absp)
                if got is None:
                    continue
                name, e = got
            nodes.append((name, e, src, opaque, absp, rel))
        if opaque_dir is not None:  # the marker sorts among the directory's own members
            d = opaque_dir
            marker = Entry(path=d.path + "/" + OPAQUE_MARKER, type="file", mode=d.mode & 0o777,
                           uid=d.uid, gid=d.gid, mtime=d.mtime)
            nodes.append((OPAQUE_MARKER.encode(), marker, None, False, None, None))
        nodes.sort(key=_first)
        return nodes

    # depth first with an explicit stack (no generator per directory level)
    stack = [iter(listdir(rootb, b"", None))]
    while stack:
        for _name, e, src, opaque, absp, rel in stack[-1]:
            if src is not None and links and e.path in links:
                key = links.pop(e.path)
                target = first.get(key)
                if target is None:
                    first[key] = e.path
                else:
                    e.type, e.linkname, e.size, src = "hardlink", target, 0, None
            yield e, src
            if e.type == "dir":
                stack.append(iter(listdir(absp, rel + b"/", e if opaque else None)))
                break
        else:
            stack.pop()


def _first(node: tuple) -> bytes:
    return node[0]


def _strip_overlay(xattrs: dict[str, bytes], rootname: str, path: str) -> bool:
    """Drop overlayfs attributes in place; True if they mark an opaque directory."""
    opaque = False
    for k in list(xattrs):
        if k.startswith(_OVERLAY_PREFIXES):
            if k.rsplit(".", 1)[1] in _UNSUPPORTED_OVERLAY:
                raise LayerError(f"pack {rootname}: {path} has overlayfs attribute {k}, "
                                 "which layers cannot represent",
                                 hint="mount the overlay without redirect_dir/metacopy")
            if k in OPAQUE_XATTRS and xattrs[k] == b"y":
                opaque = True
            del xattrs[k]
    return opaque
