"""The TOC-backed inode table: a layer's TOC entries as the tree a lazy mount presents.

Pure (no I/O): ``build_tree`` turns ``LayerReader.entries()`` into path → ``Node``, with the
rules in ``runtime_shim.lazyfs`` ("what the mount presents"): OCI whiteouts as overlayfs
whiteouts, opaque directories as ``trusted.overlay.opaque``, hardlinks as one inode, stable
inode numbers (root 1, TOC member *i* is *i* + 2, synthesised directories after those).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Sequence

from envbuild.layers import Entry

log = logging.getLogger("envbuild.lazyfs")

OPAQUE_XATTR = "trusted.overlay.opaque"
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_IFMT = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK,
         "char": stat.S_IFCHR, "block": stat.S_IFBLK, "fifo": stat.S_IFIFO}
_NS = 10 ** 9


@dataclasses.dataclass(eq=False)
class Node:
    """One inode of the presented tree. Hardlinked names share one ``Node``."""

    ino: int
    mode: int        # type and permission bits
    uid: int
    gid: int
    mtime: int
    size: int = 0
    rdev: int = 0
    nlink: int = 1
    link: str = ""             # symlink target
    read_path: str = ""        # regular file: the TOC path LazyLayer reads
    frames: tuple[int, ...] = ()  # regular file: blob offsets of the frames holding it
    xattrs: dict[str, bytes] = dataclasses.field(default_factory=dict)
    children: dict[str, None] | None = None  # directory: names in tar order

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    def attrs(self) -> dict[str, int]:
        t = self.mtime * _NS
        return {"st_ino": self.ino, "st_mode": self.mode, "st_nlink": self.nlink,
                "st_uid": self.uid, "st_gid": self.gid, "st_size": self.size,
                "st_rdev": self.rdev, "st_blocks": (self.size + 511) // 512,
                "st_atime": t, "st_mtime": t, "st_ctime": t}


def build_tree(entries: Sequence[Entry]) -> dict[str, Node]:
    """Path (``""`` is the root, no leading ``/``) → ``Node``: the layer as an overlay lower
    dir (see the module docstring). Pure: no I/O."""
    nodes: dict[str, Node] = {"": Node(1, stat.S_IFDIR | 0o755, 0, 0, 0, children={})}
    next_ino = len(entries) + 2

    def parent_dir(path: str) -> Node:
        nonlocal next_ino
        parent = path.rpartition("/")[0]
        node = nodes.get(parent)
        if node is not None and node.is_dir:
            return node
        grand = parent_dir(parent)  # missing (or shadowed by a non-dir): synthesise
        node = Node(next_ino, stat.S_IFDIR | 0o755, 0, 0, 0, children={})
        next_ino += 1
        _place(nodes, grand, parent, node)
        return node

    for i, e in enumerate(entries):
        path = e.path.strip("/")
        if not path:
            continue
        base = path.rpartition("/")[2]
        parent = parent_dir(path)
        if base.startswith(WHITEOUT_PREFIX):
            if base == OPAQUE_MARKER:
                parent.xattrs[OPAQUE_XATTR] = b"y"
            elif not base.startswith(".wh..wh.") and base[4:] not in ("", ".", ".."):
                target = path[:len(path) - len(base)] + base[4:]
                _place(nodes, parent, target,
                       Node(i + 2, stat.S_IFCHR | 0o600, e.uid, e.gid, e.mtime, rdev=0))
            continue
        if e.type == "hardlink":
            node = nodes.get(e.linkname.strip("/"))
            if node is None or not stat.S_ISREG(node.mode):
                log.warning("hardlink %s points to %s, not an earlier regular file: skipped",
                            path, e.linkname)
                continue
            if nodes.get(path) is node:
                continue
            node.nlink += 1
            _place(nodes, parent, path, node)
            continue
        old = nodes.get(path)
        if e.type == "dir" and old is not None and old.is_dir:
            # a synthesised parent (or a repeated dir) takes the member's metadata
            old.mode, old.uid, old.gid, old.mtime = stat.S_IFDIR | e.mode, e.uid, e.gid, e.mtime
            old.xattrs.update(e.xattrs)
            continue
        fmt = _IFMT.get(e.type)
        if fmt is None:
            log.warning("member %s has unknown type %r: skipped", path, e.type)
            continue
        node = Node(i + 2, fmt | e.mode, e.uid, e.gid, e.mtime, xattrs=dict(e.xattrs))
        if e.type == "file":
            node.size, node.read_path = e.size, path
            node.frames = tuple(c.offset for c in e.chunks)
        elif e.type == "symlink":
            node.link, node.size = e.linkname, len(os.fsencode(e.linkname))
        elif e.type in ("char", "block"):
            node.rdev = os.makedev(e.devmajor, e.devminor)
        elif e.type == "dir":
            node.children = {}
        _place(nodes, parent, path, node)
    for node in nodes.values():
        if node.is_dir:
            node.nlink = 2
    for path, node in nodes.items():  # a directory's ".." links its parent
        if node.is_dir and path:
            nodes[path.rpartition("/")[0]].nlink += 1
    return nodes


def _place(nodes: dict[str, Node], parent: Node, path: str, node: Node) -> None:
    """Put ``node`` at ``path`` below ``parent``, replacing what was there (a replaced
    directory takes its subtree with it; a replaced hardlink name drops one link)."""
    old = nodes.get(path)
    if old is not None:
        if old.is_dir:
            prefix = path + "/"
            for p in [p for p in nodes if p.startswith(prefix)]:
                del nodes[p]
        elif stat.S_ISREG(old.mode) and old.nlink > 1:
            old.nlink -= 1
    nodes[path] = node
    assert parent.children is not None
    parent.children.pop(path.rpartition("/")[2], None)  # re-added last: tar order
    parent.children[path.rpartition("/")[2]] = None


def statfs_of(nodes: dict[str, Node]) -> dict[str, int]:
    total = sum(n.size for n in {id(n): n for n in nodes.values()}.values()
                if stat.S_ISREG(n.mode))
    return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": (total + 4095) // 4096,
            "f_bfree": 0, "f_bavail": 0, "f_files": len(nodes), "f_ffree": 0,
            "f_favail": 0, "f_namemax": 255, "f_flag": os.ST_RDONLY}

