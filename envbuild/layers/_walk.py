"""Walk a directory tree into sorted, normalised TOC entries (no file contents read here)."""

from __future__ import annotations

import os
import stat

from envbuild.errors import LayerError, UnsafeLayerError
from envbuild.layers._toc import Entry

OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_OVERLAY_PREFIXES = ("trusted.overlay.", "user.overlay.")
_UNSUPPORTED_OVERLAY = ("redirect", "metacopy")
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"


def _xattrs(path: bytes) -> dict[str, bytes]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}  # filesystem without xattr support
    if not names:
        return {}
    out = {}
    for n in names:
        try:
            out[n] = os.getxattr(path, n, follow_symlinks=False)
        except OSError:
            continue  # vanished or not readable by this user
    return out


def walk_tree(root: str | os.PathLike, *, source_date_epoch: int = 0,
              overlay_upper: bool = False, allow_devices: bool = True
              ) -> list[tuple[Entry, bytes | None]]:
    """Entries of every member below ``root`` (the root itself is not a member), sorted by path
    bytes, each with the absolute path to read a regular file's contents from.

    Applies the determinism rules (mtime clamped to ``source_date_epoch``, hardlinks to the first
    path in sorted order) and, with ``overlay_upper``, converts overlayfs whiteouts and opaque
    directories to their OCI form. Sockets are skipped: tar cannot hold them.
    """
    rootb = os.fsencode(root)
    found: list[tuple[bytes, bytes, os.stat_result]] = []  # (rel, abs, lstat)
    stack = [(rootb, b"")]
    while stack:
        absdir, reldir = stack.pop()
        try:
            it = os.scandir(absdir)
        except OSError as e:
            raise LayerError(f"pack {os.fsdecode(rootb)}: list {os.fsdecode(absdir)}: "
                             f"{e.strerror}") from e
        with it:
            for de in it:
                rel = reldir + de.name
                st = de.stat(follow_symlinks=False)
                found.append((rel, de.path, st))
                if stat.S_ISDIR(st.st_mode):
                    stack.append((de.path, rel + b"/"))
    epoch = max(0, int(source_date_epoch))
    nodes: list[tuple[bytes, Entry, bytes | None, os.stat_result]] = []
    for rel, absp, st in found:
        try:
            path = rel.decode("utf-8")
        except UnicodeDecodeError:
            raise LayerError(f"pack {os.fsdecode(rootb)}: file name {os.fsdecode(rel)!r} is not "
                             "UTF-8", hint="layer format v1 stores names as UTF-8") from None
        m = st.st_mode
        fmt = stat.S_IFMT(m)
        mtime = min(max(st.st_mtime_ns // 1_000_000_000, 0), epoch)
        xattrs = _xattrs(absp)
        e = Entry(path=path, type="file", mode=m & 0o7777, uid=st.st_uid, gid=st.st_gid,
                  mtime=mtime)
        src = None
        opaque = False
        if overlay_upper and xattrs:
            for k in list(xattrs):
                if k.startswith(_OVERLAY_PREFIXES):
                    if k.rsplit(".", 1)[1] in _UNSUPPORTED_OVERLAY:
                        raise LayerError(f"pack {os.fsdecode(rootb)}: {path} has overlayfs "
                                         f"attribute {k}, which layers cannot represent",
                                         hint="mount the overlay without redirect_dir/metacopy")
                    if k in OPAQUE_XATTRS and xattrs[k] == b"y":
                        opaque = True
                    del xattrs[k]
        e.xattrs = dict(sorted(xattrs.items()))
        if fmt == stat.S_IFREG:
            e.size = st.st_size
            src = absp
        elif fmt == stat.S_IFDIR:
            e.type = "dir"
        elif fmt == stat.S_IFLNK:
            e.type = "symlink"
            try:
                e.linkname = os.readlink(absp).decode("utf-8")
            except UnicodeDecodeError:
                raise LayerError(f"pack {os.fsdecode(rootb)}: target of symlink {path} is not "
                                 "UTF-8") from None
        elif fmt == stat.S_IFCHR and overlay_upper and st.st_rdev == 0:
            # overlayfs whiteout -> OCI whiteout (an empty regular file, mode 0600 as Docker does)
            d, _, n = rel.rpartition(b"/")
            rel = (d + b"/" if d else b"") + b".wh." + n
            e.path = rel.decode("utf-8")
            e.mode = 0o600
            e.xattrs = {}
        elif fmt in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO):
            if not allow_devices:
                raise UnsafeLayerError(f"pack {os.fsdecode(rootb)}: {path} is a device node or "
                                       "FIFO, refused (allow_devices=False)")
            e.type = {stat.S_IFCHR: "char", stat.S_IFBLK: "block", stat.S_IFIFO: "fifo"}[fmt]
            if fmt != stat.S_IFIFO:
                e.devmajor, e.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        else:
            continue  # socket: tar cannot represent it (GNU tar skips them too)
        nodes.append((rel, e, src, st))
        if opaque:
            marker = Entry(path=path + "/" + OPAQUE_MARKER, type="file", mode=m & 0o777,
                           uid=st.st_uid, gid=st.st_gid, mtime=mtime)
            nodes.append((rel + b"/" + OPAQUE_MARKER.encode(), marker, None, st))
    nodes.sort(key=lambda n: n[0])
    first: dict[tuple[int, int], str] = {}
    out: list[tuple[Entry, bytes | None]] = []
    for _, e, src, st in nodes:
        if src is not None and st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            target = first.get(key)
            if target is None:
                first[key] = e.path
            else:
                e.type, e.linkname, e.size, src = "hardlink", target, 0, None
        out.append((e, src))
    return out
