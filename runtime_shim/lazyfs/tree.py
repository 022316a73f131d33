"""The TOC-backed inode table: a layer's TOC as the tree a native layer presents.

Pure (no I/O). ``tree_of(reader)`` turns an open layer's TOC into path → ``Node`` with the
rules of ``LayerReader.unpack(dest, whiteouts="overlay")``, which a native layer's metadata
tree (``nativetree``) must present: OCI whiteouts as overlayfs whiteouts, opaque directories
as ``trusted.overlay.opaque``, hardlinks as one inode, stable inode numbers (root 1, TOC
member *i* is *i* + 2, synthesised directories after those).

Two ways in, one algorithm (``_assemble``): a v2 TOC (every layer envbuild writes) is decoded
straight from its rows, column by column (``RowEntries.columns``: one ``json.loads`` and
C-level type checks), with no ``Entry`` per member — a lazy create decodes every layer of its
stack under one GIL, and the ``Entry`` objects were most of that time; any other TOC goes
through ``build_tree(entries)``. Both refuse the member names ``LayerReader.unpack`` refuses
(absolute, empty, ``.`` or ``..`` components: ``UnsafeLayerError``), so no TOC can put a name
outside its tree or a second ``..`` in a directory.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import logging
import os
import re
import stat
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from envbuild.errors import CorruptLayerError, UnsafeLayerError
from envbuild.layers import OPAQUE_MARKER, WHITEOUT_PREFIX, Entry

log = logging.getLogger("envbuild.lazyfs")

OPAQUE_XATTR = "trusted.overlay.opaque"
_IFMT = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK,
         "char": stat.S_IFCHR, "block": stat.S_IFBLK, "fifo": stat.S_IFIFO}
_NS = 10 ** 9
#: The xattrs of a node that has none: shared, and read-only so that no one mutates it for all.
NO_XATTRS: Mapping[str, bytes] = MappingProxyType({})
# in the names of a TOC joined by "\0" (and framed by it): an empty, "." or ".." component
_UNSAFE = re.compile("[\0/][.]{0,2}(?=[\0/])")


@dataclasses.dataclass(eq=False, slots=True)
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
    digest: str = ""           # regular file: its content digest from the TOC ("" for none)
    # replaced, never mutated (may be shared)
    xattrs: Mapping[str, bytes] = dataclasses.field(default_factory=lambda: NO_XATTRS)
    children: dict[str, None] | None = None  # directory: names in tar order

    @property
    def is_dir(self) -> bool:
        return self.children is not None


# one member for _assemble: path, type, mode, uid, gid, size, mtime, linkname, xattrs, rdev,
# frames (blob offsets), content digest (or None)
_Member = tuple[str, str, int, int, int, int, int, str, Mapping[str, bytes], int,
                tuple[int, ...], str | None]


def build_tree(entries: Sequence[Entry], name: str = "layer") -> dict[str, Node]:
    """Path (``""`` is the root, no leading ``/``) → ``Node``: the layer as an overlay lower
    dir (see the module docstring), from decoded TOC entries. ``UnsafeLayerError`` for a
    member name unpack would refuse. Pure: no I/O."""
    check_names([e.path for e in entries], name)
    members = ((e.path, e.type, e.mode, e.uid, e.gid, e.size, e.mtime, e.linkname,
                dict(e.xattrs) if e.xattrs else NO_XATTRS,
                os.makedev(e.devmajor, e.devminor) if e.type in ("char", "block") else 0,
                tuple(c.offset for c in e.chunks), e.digest) for e in entries)
    with _gc_paused():
        return _assemble(len(entries), members)


def tree_of(reader: Any) -> dict[str, Node]:
    """The tree of an open ``LayerReader`` (``LazyLayer.reader``): a v2 TOC decoded column by
    column (module docstring), any other through ``build_tree``. A TOC that does not match
    its schema is a ``CorruptLayerError`` naming the layer, as ``entries()`` would raise."""
    rows = reader.toc.entries
    columns = getattr(rows, "columns", None)
    if columns is None:
        return build_tree(reader.entries(), reader.name)
    from envbuild.layers import TocFormatError

    with _gc_paused():
        try:
            cols = columns()
        except TocFormatError as e:
            raise CorruptLayerError(f"layer {reader.name}: {e}") from None
        paths = rows._paths
        check_names(paths, reader.name)
        members = _v2_members(paths, cols, rows._index, reader.name)
        return _assemble(len(paths), members)


def _v2_members(paths: list[str], cols: list[tuple], index: Any, name: str
                ) -> Iterator[_Member]:
    import base64

    types, modes, uids, gids, sizes, mtimes, links, xattrs, dmaj, dmin, digests, datas = cols
    uoffs, offs, tar_size = index.uoffsets, index.offsets, index.tar_size
    last = len(uoffs) - 1
    bisect_right = bisect.bisect_right
    makedev = os.makedev
    for i, t in enumerate(types):
        data = datas[i]
        frames: tuple[int, ...] = ()
        if data is not None:
            size = sizes[i]
            end = data + size
            if end > tar_size:
                raise CorruptLayerError(f"layer {name}: TOC entry {i} ends past the tar "
                                        f"(data at {data} + {size} bytes)")
            k = bisect_right(uoffs, data) - 1
            if end <= uoffs[k + 1]:
                frames = (offs[k],)
            else:
                got = [offs[k]]
                k += 1
                while k < last and uoffs[k] < end:
                    got.append(offs[k])
                    k += 1
                frames = tuple(got)
        x = xattrs[i]
        if x:
            try:
                x = {k: base64.b64decode(v, validate=True) for k, v in x.items()}
            except (TypeError, ValueError):
                raise CorruptLayerError(f"layer {name}: TOC entry {i} has xattrs that are not "
                                        "base64 strings") from None
        else:
            x = NO_XATTRS
        yield (paths[i], t, modes[i], uids[i], gids[i], sizes[i], mtimes[i], links[i], x,
               makedev(dmaj[i], dmin[i]) if t == "char" or t == "block" else 0, frames,
               digests[i])


def check_names(paths: Iterable[str], name: str) -> None:
    """``UnsafeLayerError`` unless every path is a safe relative member name (no leading or
    doubled ``/``, no empty, ``.`` or ``..`` component): what unpack refuses. Checked on the
    joined names, without a Python loop per member."""
    if _UNSAFE.search("\0" + "\0".join(paths) + "\0"):
        bad = next((p for p in paths if not p or p.startswith("/") or any(
            c in ("", ".", "..") for c in p.split("/"))), "a name with a NUL")
        raise UnsafeLayerError(f"layer {name}: member {bad!r} is not a safe relative name "
                               "(absolute, or an empty, '.' or '..' component)",
                               hint="a layer envbuild wrote never has one: rebuild it")


def _assemble(n: int, members: Iterable[_Member]) -> dict[str, Node]:
    """The tree of ``n`` TOC members in tar order (see the module docstring)."""
    nodes: dict[str, Node] = {"": Node(1, stat.S_IFDIR | 0o755, 0, 0, 0, children={})}
    next_ino = [n + 2]   # the next synthesised directory's inode number
    get = nodes.get
    for i, (path, t, mode, uid, gid, size, mtime, linkname, xattrs, rdev, frames, digest) \
            in enumerate(members):
        path = path.strip("/")
        if not path:
            continue
        head, _, base = path.rpartition("/")
        parent = get(head)
        if parent is None or parent.children is None:
            parent = _parent_dir(nodes, path, next_ino)
        if base.startswith(WHITEOUT_PREFIX):
            _whiteout(nodes, parent, path, base, (i + 2, uid, gid, mtime))
            continue
        if t == "hardlink":
            _hardlink(nodes, parent, path, linkname)
            continue
        old = get(path)
        if t == "dir" and old is not None and old.children is not None:
            # a synthesised parent (or a repeated dir) takes the member's metadata
            old.mode, old.uid, old.gid, old.mtime = stat.S_IFDIR | mode, uid, gid, mtime
            if xattrs:
                old.xattrs = {**old.xattrs, **xattrs}
            continue
        fmt = _IFMT.get(t)
        if fmt is None:
            log.warning("member %s has unknown type %r: skipped", path, t)
            continue
        if t == "file":
            node = Node(i + 2, fmt | mode, uid, gid, mtime, size, xattrs=xattrs,
                        read_path=path, frames=frames, digest=digest or "")
        elif t == "dir":
            node = Node(i + 2, fmt | mode, uid, gid, mtime, xattrs=xattrs, children={})
        elif t == "symlink":
            node = Node(i + 2, fmt | mode, uid, gid, mtime, len(os.fsencode(linkname)),
                        xattrs=xattrs, link=linkname)
        else:
            node = Node(i + 2, fmt | mode, uid, gid, mtime, rdev=rdev, xattrs=xattrs)
        if old is None:  # the common case: a new name
            nodes[path] = node
            children = parent.children
            assert children is not None
            children[base] = None
        else:
            _place(nodes, parent, path, node)
    _count_dir_links(nodes)
    return nodes


def _parent_dir(nodes: dict[str, Node], path: str, next_ino: list[int]) -> Node:
    """The directory ``path`` is in; synthesised (mode 0755, root's, the next of
    ``next_ino``) with its missing ancestors when it is missing or shadowed by a non-dir."""
    parent = path.rpartition("/")[0]
    node = nodes.get(parent)
    if node is not None and node.children is not None:
        return node
    grand = _parent_dir(nodes, parent, next_ino)
    node = Node(next_ino[0], stat.S_IFDIR | 0o755, 0, 0, 0, children={})
    next_ino[0] += 1
    _place(nodes, grand, parent, node)
    return node


def _whiteout(nodes: dict[str, Node], parent: Node, path: str, base: str,
              meta: tuple[int, int, int, int]) -> None:
    """The whiteout member ``path`` (``base``: its name; ``meta``: its inode number, owner
    and mtime): an opaque marker makes ``parent`` opaque; ``.wh.NAME`` puts a 0/0 character
    device (the overlayfs whiteout) at ``NAME``; other ``.wh..wh.*`` names and empty, ``.``
    or ``..`` targets are skipped."""
    if base == OPAQUE_MARKER:
        parent.xattrs = {**parent.xattrs, OPAQUE_XATTR: b"y"}
    elif not base.startswith(".wh..wh.") and base[4:] not in ("", ".", ".."):
        target = path[:len(path) - len(base)] + base[4:]
        ino, uid, gid, mtime = meta
        _place(nodes, parent, target, Node(ino, stat.S_IFCHR | 0o600, uid, gid, mtime, rdev=0))


def _hardlink(nodes: dict[str, Node], parent: Node, path: str, linkname: str) -> None:
    """The hardlink member ``path``: one more name of the earlier regular file
    ``linkname`` (skipped when there is none)."""
    node = nodes.get(linkname.strip("/"))
    if node is None or not stat.S_ISREG(node.mode):
        log.warning("hardlink %s points to %s, not an earlier regular file: skipped",
                    path, linkname)
        return
    if nodes.get(path) is node:
        return
    node.nlink += 1
    _place(nodes, parent, path, node)


def _count_dir_links(nodes: dict[str, Node]) -> None:
    """Each directory's ``st_nlink``: 2, plus one for each subdirectory's ``..``."""
    dirs = [(path, node) for path, node in nodes.items() if node.children is not None]
    for _, node in dirs:
        node.nlink = 2
    for path, _node in dirs:  # a directory's ".." links its parent
        if path:
            nodes[path.rpartition("/")[0]].nlink += 1


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


_gc_lock = threading.Lock()
_gc_holders = 0
_gc_was_enabled = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while trees are built (several threads may build at
    once): a tree is ~15,000 new objects per large layer and none is garbage, yet each 700
    allocations start a collection that walks the young ones and, every so often, the
    whole heap — measured, that tripled the build of a 14,742-entry layer."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()
