"""A meta layer's tree, planned (``plan``) and built (``build``).

``plan`` picks the regular files of a lazy layer whose verified contents are on the node and
the directories above them (pure); ``build`` creates the tree — directories and sparse
metacopy files carrying a ``trusted.overlay.redirect`` to their content — and the data-only
layer of hardlinks beside it (``runtime_shim.lazyfs.metalayer``). Hostile layers: only names
made of plain components (``safe_path``) are created, never through a symlink, and the TOC's
``trusted.overlay.*`` xattrs are never copied."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Callable, Collection, Iterable, Mapping

from runtime_shim.lazyfs.tree import Node

log = logging.getLogger("envbuild.lazyfs")

#: Longest path (bytes, below ``tree``) a meta entry may have; longer ones stay on FUSE.
MAX_PATH = 3000
METACOPY_XATTR = "trusted.overlay.metacopy"
REDIRECT_XATTR = "trusted.overlay.redirect"
_OVERLAY_PREFIX = "trusted.overlay."
_NS = 10 ** 9


@dataclasses.dataclass(frozen=True)
class MetaEntry:
    """One inode of a meta tree: a directory (``digest`` empty) or a regular file with all its
    names (hardlinks)."""

    paths: tuple[str, ...]
    mode: int
    uid: int
    gid: int
    mtime: int
    xattrs: tuple[tuple[str, bytes], ...] = ()
    size: int = 0
    digest: str = ""


def safe_path(path: str) -> bool:
    """Whether ``path`` (relative, ``/``-separated) is made only of plain names: it cannot
    leave the directory it is created in."""
    if not path or len(os.fsencode(path)) > MAX_PATH:
        return False
    for part in path.split("/"):
        if part in ("", ".", "..") or "\0" in part or len(os.fsencode(part)) > 255:
            return False
    return True


def _xattrs(node: Node) -> tuple[tuple[str, bytes], ...]:
    return tuple(sorted((k, bytes(v)) for k, v in node.xattrs.items()
                        if not k.startswith(_OVERLAY_PREFIX)))


def plan(nodes: Mapping[str, Node], digest_of: Callable[[Node], str],
         present: Collection[str]) -> tuple[list[MetaEntry], list[MetaEntry]]:
    """The meta tree of a layer (pure): ``(dirs, files)`` for the regular files of ``nodes``
    whose digest is in ``present``, dirs parents first, each file once with all its safe
    names (tar order). Names that are not ``safe_path`` are left out."""
    by_inode: dict[int, tuple[Node, list[str]]] = {}
    for path, node in nodes.items():
        if not stat.S_ISREG(node.mode):
            continue
        got = by_inode.get(id(node))
        if got is None:
            # the set lookup first: most of a layer's files are not fetched, and checking
            # every name of a 15,000-file layer was most of a small generation's plan
            if digest_of(node) not in present or not safe_path(path):
                continue
            by_inode[id(node)] = (node, [path])
        elif safe_path(path):
            got[1].append(path)
    dirs: set[str] = set()
    files = []
    for node, paths in by_inode.values():
        for p in paths:
            parent = p.rpartition("/")[0]
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = parent.rpartition("/")[0]
        files.append(MetaEntry(tuple(paths), stat.S_IMODE(node.mode), node.uid, node.gid,
                               node.mtime, _xattrs(node), node.size, digest_of(node)))
    out_dirs = []
    for d in sorted(dirs, key=lambda p: (p.count("/"), p)):
        dnode = nodes.get(d)
        if dnode is None or not dnode.is_dir:  # cannot happen with build_tree: be safe
            continue
        out_dirs.append(MetaEntry((d,), stat.S_IMODE(dnode.mode), dnode.uid, dnode.gid,
                                  dnode.mtime, _xattrs(dnode)))
    root = nodes.get("")
    if root is not None:
        out_dirs.insert(0, MetaEntry(("",), stat.S_IMODE(root.mode), root.uid, root.gid,
                                     root.mtime, _xattrs(root)))
    return out_dirs, files


def _set_meta(fd: int, e: MetaEntry, created: int | None = None) -> None:
    """Give ``fd`` the entry's xattrs, owner, mode and mtime. ``created``: the mode it was
    created with (after the umask): no ``fchmod`` when that is the entry's and it has no
    set-id bits, no ``fchown`` when this process's owner is the entry's (a tree is mostly
    root's files: two syscalls of the ~9 per file)."""
    for k, v in e.xattrs:
        os.setxattr(fd, k, v)
    if (e.uid, e.gid) != (os.geteuid(), os.getegid()):
        os.fchown(fd, e.uid, e.gid)
    if created != e.mode or e.mode & 0o7000:
        os.fchmod(fd, e.mode)  # after chown, which clears set-id bits
    t = e.mtime * _NS
    os.utime(fd, ns=(t, t))


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it process-wide)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o7777   # unknown: every created mode counts as different (always fchmod)


def build(tree_dir: str, data_dir: str, dirs: Iterable[MetaEntry],
          files: Iterable[MetaEntry], sources: Callable[[str], list[str]]) -> int:
    """Create the meta tree in the empty ``tree_dir`` and the data-only layer in the empty
    ``data_dir`` (hardlinks, from the first of ``sources(hex)`` that is a regular file of the
    entry's size; the caller names only verified cache files). A file whose
    data or metadata cannot be placed is skipped (left to the FUSE mount). Returns the number
    of files placed."""
    dirs = list(dirs)
    placed_dirs = _make_dirs(tree_dir, dirs)
    linked: set[str] = set()
    placed = 0
    umask = _umask()
    for f in files:
        hexd = f.digest.removeprefix("sha256:")
        if hexd not in linked:
            if not _link_data(data_dir, hexd, f.size, sources):
                continue  # evicted meanwhile: on FUSE
            linked.add(hexd)
        paths = [p for p in f.paths if p.rpartition("/")[0] in placed_dirs]
        if paths and _make_file(tree_dir, paths, f, hexd, umask):
            placed += 1
    for d in reversed(dirs):  # children first: creating entries moves a directory's mtime
        path = d.paths[0]
        if path not in placed_dirs:
            continue
        fd = os.open(os.path.join(tree_dir, path) if path else tree_dir,
                     os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _set_meta(fd, d)
        except OSError as e:
            log.warning("meta tree: directory %s metadata: %s", path or "/", e)
        finally:
            os.close(fd)
    return placed


def _make_dirs(tree_dir: str, dirs: list[MetaEntry]) -> set[str]:
    """Create the directories ``dirs`` (parents first) in ``tree_dir``, mode 0700 while the
    tree is built; returns those placed (a directory whose parent was not is skipped)."""
    placed_dirs = {""}
    for d in dirs:
        path = d.paths[0]
        if path:
            parent = path.rpartition("/")[0]
            if parent not in placed_dirs:
                continue
            try:
                os.mkdir(os.path.join(tree_dir, path), 0o700)
            except OSError as e:
                log.warning("meta tree: directory %s: %s (its files stay on FUSE)", path, e)
                continue
            placed_dirs.add(path)
    return placed_dirs


def _link_data(data_dir: str, hexd: str, size: int, sources: Callable[[str], list[str]]) -> bool:
    """Hardlink the content ``hexd`` into ``data_dir`` from the first of ``sources(hexd)``
    that is a regular file of ``size`` bytes; False when none is (evicted meanwhile)."""
    for src in sources(hexd):
        try:  # a regular file of the right size, never a symlink's target
            st = os.lstat(src)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                log.warning("meta tree: %s is not a %d-byte file: not used", src, size)
                continue
            os.link(src, os.path.join(data_dir, hexd), follow_symlinks=False)
            return True
        except FileNotFoundError:
            continue
    return False


def _make_file(tree_dir: str, paths: list[str], f: MetaEntry, hexd: str, umask: int) -> bool:
    """Create the metacopy file of ``f`` at ``paths[0]`` (sparse, its size, a redirect to
    ``/<hexd>``, its metadata) and hardlink its other names; False when it cannot be placed
    (then it stays on FUSE)."""
    first = os.path.join(tree_dir, paths[0])
    mode = f.mode & 0o777   # the tree's dirs are 0700 while it is built
    try:
        fd = os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, mode)
    except OSError as e:
        log.warning("meta tree: %s: %s (stays on FUSE)", paths[0], e)
        return False
    try:
        if f.size:
            os.ftruncate(fd, f.size)
        os.setxattr(fd, METACOPY_XATTR, b"")
        os.setxattr(fd, REDIRECT_XATTR, b"/" + hexd.encode())
        _set_meta(fd, f, created=mode & ~umask)
    except OSError as e:
        log.warning("meta tree: %s: %s (stays on FUSE)", paths[0], e)
        os.close(fd)
        os.unlink(first)
        return False
    os.close(fd)
    for p in paths[1:]:
        try:
            os.link(first, os.path.join(tree_dir, p), follow_symlinks=False)
        except OSError as e:
            log.warning("meta tree: hardlink %s: %s", p, e)
    return True
