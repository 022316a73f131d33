"""A native lazy layer's metadata tree: the whole layer as the kernel serves it, built from
the TOC once per node, with every regular file's data in the node's object store.

For layer ``<hex>``::

    <node>/meta/trees/native/<hex>   the tree (on the node's tree tmpfs, ``metagen.TREES``)
    <node>/native/<hex>              a read-only overlay: lowerdir=TREE::<node>/objects/data
                                     (metacopy=on, redirect_dir=follow), the sandbox's lower

The tree holds every member of the layer (``tree_of``: the rules of what a lazy mount
presents): directories, symlinks, fifos, modes, owners, mtimes, xattrs (never the TOC's
``trusted.overlay.*``), hardlinks as one inode, and for each regular file an empty file of
its size carrying ``trusted.overlay.metacopy`` and ``trusted.overlay.redirect=/<sha256>``
(``metatree._make_file``: one copy of the composefs shape). The layer's own overlay
semantics must reach the *sandbox's* overlay through this inner one, which would consume
plain whiteouts and ``opaque`` xattrs itself, so they are written escaped (Linux >= 6.8):

- a whiteout ``D/NAME`` is an empty regular file with ``trusted.overlay.overlay.whiteout``,
  ``D`` and the tree's root carry ``trusted.overlay.overlay.opaque=x`` (the inner overlay
  shows them as ``trusted.overlay.whiteout`` / ``opaque=x``: an xwhiteout for the outer one);
- an opaque directory carries ``trusted.overlay.overlay.opaque=y`` (seen as ``opaque=y``).

Device nodes are refused (as by the sandbox's unpack). **Cost, bounded**: a layer over
``MAX_MEMBERS`` members is refused with a hint (pull it in full); a TOC is already capped by
``LayerReader`` (``MAX_TOC_USIZE``). Measured at the cap (261,544 files of distinct
contents, 2026-12-06, load ~4 on 2 cores): its first create on a node took 41.9 s, the
creating process peaked at 452 MiB, the kernel's slab grew by 705 MiB (the tree's tmpfs
inodes, the placeholders' ext4 inodes, one fanotify mark each), the filler's worker held
218 MiB, the object store 48 MiB on disk (the layer's source record, directory blocks).
``node gc`` frees the tree, the mount, and (``objgc``) the layer's record and the objects
and marks no mounted layer names, once no sandbox uses the layer.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable

from envbuild.errors import RuntimeShimError
from envbuild.oci import is_hex64
from runtime_shim.lazyfs.metagen import (
    TREES,
    _ensure_trees,
    _is_mount,
    _layer_flock,
    mount_generation,
)
from runtime_shim.lazyfs.metatree import MetaEntry, _make_file, _set_meta, _umask, _xattrs
from runtime_shim.lazyfs.tree import OPAQUE_XATTR, Node

#: Members a native layer may have (more: refused, pull the layer in full).
MAX_MEMBERS = 262_144
XWHITEOUT = "trusted.overlay.overlay.whiteout"
ESCAPED_OPAQUE = "trusted.overlay.overlay.opaque"


def tree_dir(node_root: str, hexd: str) -> str:
    return os.path.join(node_root, "meta", TREES, "native", hexd)


def mount_dir(node_root: str, hexd: str) -> str:
    return os.path.join(node_root, "native", hexd)


def ensure(node_root: str, hexd: str, nodes: dict[str, Node], objects_data: str,
           start: Callable[[], Callable[[], None]]) -> str:
    """The mounted overlay of layer ``hexd`` (built from ``nodes`` if this node has no tree
    of it). ``start()`` begins making the layer's objects (the filler places and marks
    them) and returns the call that waits for them: it runs while the tree is built and
    is waited for before the mount (nothing can reach a placeholder before its mark)."""
    mnt = mount_dir(node_root, hexd)
    with _layer_flock(node_root, f"native-{hexd}"):
        if _is_mount(mnt):
            return mnt
        wait = start()
        try:
            tree = tree_dir(node_root, hexd)
            if not os.path.isdir(tree):
                _build_new(tree, node_root, nodes)
        finally:
            wait()
        os.makedirs(mnt, mode=0o700, exist_ok=True)
        mount_generation(tree, objects_data, mnt)
    return mnt


def _build_new(tree: str, node_root: str, nodes: dict[str, Node]) -> None:
    _ensure_trees(os.path.join(node_root, "meta"))
    os.makedirs(os.path.dirname(tree), mode=0o700, exist_ok=True)
    tmp = f"{tree}.tmp-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp, 0o700)
    try:
        build(tmp, nodes)
        os.rename(tmp, tree)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _entry(path: str, node: Node, paths: tuple[str, ...] = (), digest: str = "") -> MetaEntry:
    return MetaEntry(paths or (path,), stat.S_IMODE(node.mode), node.uid, node.gid,
                     node.mtime, _xattrs(node), node.size, digest)


def build(root: str, nodes: dict[str, Node]) -> None:
    """Create the tree of ``nodes`` in the empty dir ``root`` (module docstring)."""
    if len(nodes) > MAX_MEMBERS:
        raise RuntimeShimError(
            f"layer has {len(nodes)} members, over the {MAX_MEMBERS} a native lazy layer may "
            "have", hint="pull it in full (lazy=False)")
    names: dict[int, list[str]] = {}
    for path, node in nodes.items():
        if stat.S_ISREG(node.mode):
            names.setdefault(id(node), []).append(path)
    dirs = sorted((p for p, n in nodes.items() if n.is_dir), key=lambda p: (p.count("/"), p))
    for path in dirs[1:] if dirs and dirs[0] == "" else dirs:
        os.mkdir(os.path.join(root, path), 0o700)
    umask = _umask()
    made: set[int] = set()
    xdirs: set[str] = set()
    for path, node in nodes.items():
        if stat.S_ISREG(node.mode):
            if id(node) not in made:
                made.add(id(node))
                hexd = node.digest.removeprefix("sha256:")
                if not is_hex64(hexd):
                    raise RuntimeShimError(f"native layer tree: /{path} has no sha256 digest "
                                           f"({node.digest!r})", hint="pull it in full")
                paths = names[id(node)]
                if not _make_file(root, paths, _entry(path, node, tuple(paths), hexd), hexd,
                                  umask):
                    raise RuntimeShimError(f"native layer tree: cannot create {paths[0]}")
        elif not node.is_dir and _make_other(root, path, node):
            xdirs.add(path.rpartition("/")[0])
    _finish_dirs(root, nodes, dirs, xdirs)


def _make_other(root: str, path: str, node: Node) -> bool:
    """Create a member that is neither a directory nor a regular file; True for a whiteout
    (made an xwhiteout: its directory must say so)."""
    full = os.path.join(root, path)
    kind = stat.S_IFMT(node.mode)
    if kind == stat.S_IFCHR and node.rdev == 0:
        with open(full, "x"):
            pass
        os.setxattr(full, XWHITEOUT, b"")
        return True
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        raise RuntimeShimError(f"native lazy layers hold no device nodes: /{path}",
                               hint="pull the layer in full (lazy=False)")
    if kind == stat.S_IFIFO:
        os.mkfifo(full, 0o600)
        _meta_path(full, _entry(path, node))
    elif kind == stat.S_IFLNK:
        os.symlink(node.link, full)
        os.chown(full, node.uid, node.gid, follow_symlinks=False)
        os.utime(full, ns=(node.mtime * 10**9,) * 2, follow_symlinks=False)
    return False


def _finish_dirs(root: str, nodes: dict[str, Node], dirs: list[str], xdirs: set[str]) -> None:
    """Directories' metadata, children first (an entry made moves its dir's mtime), with the
    escaped opaque markers (``y``: opaque; ``x``: holds xwhiteouts; the root: the layer
    has some)."""
    for path in reversed(dirs):
        node = nodes[path]
        full = os.path.join(root, path) if path else root
        if OPAQUE_XATTR in node.xattrs:
            os.setxattr(full, ESCAPED_OPAQUE, b"y")
        elif path in xdirs or (not path and xdirs):
            os.setxattr(full, ESCAPED_OPAQUE, b"x")
        _meta_path(full, _entry(path, node))


def _meta_path(path: str, e: MetaEntry) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        _set_meta(fd, e)
    finally:
        os.close(fd)


__all__ = ["ESCAPED_OPAQUE", "MAX_MEMBERS", "XWHITEOUT", "build", "ensure", "mount_dir",
           "tree_dir"]
