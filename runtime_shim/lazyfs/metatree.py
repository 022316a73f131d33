"""The pieces of a native layer's metadata tree (``nativetree``): an inode as created
(``MetaEntry``), its metadata set on an fd, and a regular file as a sparse metacopy file
carrying a ``trusted.overlay.redirect`` to its object (the composefs shape). Hostile layers:
the TOC's ``trusted.overlay.*`` xattrs are never copied (``_xattrs``); files are created
``O_EXCL | O_NOFOLLOW``, never through a symlink."""

from __future__ import annotations

import dataclasses
import logging
import os

from runtime_shim.lazyfs.tree import Node

log = logging.getLogger("envbuild.lazyfs")

METACOPY_XATTR = "trusted.overlay.metacopy"
REDIRECT_XATTR = "trusted.overlay.redirect"
_OVERLAY_PREFIX = "trusted.overlay."
_NS = 10 ** 9


@dataclasses.dataclass(frozen=True)
class MetaEntry:
    """One inode of a metadata tree: a directory (``digest`` empty) or a regular file with all
    its names (hardlinks)."""

    paths: tuple[str, ...]
    mode: int
    uid: int
    gid: int
    mtime: int
    xattrs: tuple[tuple[str, bytes], ...] = ()
    size: int = 0
    digest: str = ""


def _xattrs(node: Node) -> tuple[tuple[str, bytes], ...]:
    return tuple(sorted((k, bytes(v)) for k, v in node.xattrs.items()
                        if not k.startswith(_OVERLAY_PREFIX)))


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


def _make_file(tree_dir: str, paths: list[str], f: MetaEntry, hexd: str, umask: int) -> bool:
    """Create the metacopy file of ``f`` at ``paths[0]`` (sparse, its size, a redirect to
    ``/<hexd>``, its metadata) and hardlink its other names; False when it cannot be placed."""
    first = os.path.join(tree_dir, paths[0])
    mode = f.mode & 0o777   # the tree's dirs are 0700 while it is built
    try:
        fd = os.open(first, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, mode)
    except OSError as e:
        log.warning("meta tree: %s: %s", paths[0], e)
        return False
    try:
        if f.size:
            os.ftruncate(fd, f.size)
        os.setxattr(fd, METACOPY_XATTR, b"")
        os.setxattr(fd, REDIRECT_XATTR, b"/" + hexd.encode())
        _set_meta(fd, f, created=mode & ~umask)
    except OSError as e:
        log.warning("meta tree: %s: %s", paths[0], e)
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
