"""OCI whiteouts (``.wh.NAME``, ``.wh..wh..opq``) applied to the tree below a layer, or turned
into overlayfs whiteouts (a 0/0 character device, ``<ns>.overlay.opaque=y``), for envbuild
layers (``_unpack``) and foreign OCI layers (``_untar``).

A layer's whiteouts hide what *lower* layers put there, never an entry of the same layer
(OCI image-spec, layer.md); other ``.wh..wh.*`` names (aufs metadata) are ignored, as
containerd does. Every removal goes through ``SafeTree`` (no symlink followed).
"""

from __future__ import annotations

import os
import stat

from envbuild.layers._names import (
    OPAQUE_MARKER,
    WHITEOUT_PREFIX,
    check_member_name,
    check_whiteout_target,
)
from envbuild.layers._safetree import DIR_FLAGS, SafeTree
from envbuild.layers._toc import Entry


def overlay_whiteout(tree: SafeTree, pfd: int, parts: list[str], path: str, e: Entry,
                     opaque_key: str, same_owner: bool) -> None:
    """One whiteout of an envbuild layer as an overlayfs whiteout (``whiteouts="overlay"``)."""
    base = parts[-1]
    if base == OPAQUE_MARKER:
        os.setxattr(pfd, opaque_key, b"y")
    elif not base.startswith(".wh..wh."):
        check_whiteout_target(tree.name, path, base)
        target = base[4:]
        tree.remove(pfd, target, "/".join(parts[:-1] + [target]))
        os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=pfd)
        if same_owner:
            os.chown(target, e.uid, e.gid, dir_fd=pfd, follow_symlinks=False)


def apply_whiteouts(toc: list[Entry], tree: SafeTree, name: str) -> None:
    """Delete what the layer's whiteouts hide, before extracting anything: whiteouts apply only
    to lower layers, never to entries of the same layer (OCI image-spec, layer.md)."""
    for e in toc:
        base = e.path.rpartition("/")[2]
        if not base.startswith(WHITEOUT_PREFIX):
            continue
        tree.evict()
        parts = check_member_name(name, e.path)
        pfd = tree.parent(parts, e.path, create=False)
        if pfd is None:
            continue  # the parent does not exist: nothing to hide
        prefix = "/".join(parts[:-1])
        if base == OPAQUE_MARKER:
            empty_dir(tree, pfd, prefix, keep=None)
        elif base.startswith(".wh..wh."):
            continue  # other aufs metadata: ignored, as containerd does
        else:
            check_whiteout_target(name, e.path, base)
            tree.remove(pfd, base[4:], "/".join(parts[:-1] + [base[4:]]))


def empty_dir(tree: SafeTree, dfd: int, rel: str, keep: set[str] | None) -> None:
    """Remove every entry of directory ``rel`` (fd ``dfd``) not in ``keep``; directories in
    ``keep`` are emptied the same way (iteratively: depth costs no recursion)."""
    todo = [(rel, dfd, False)]
    while todo:
        drel, fd, owned = todo.pop()
        try:
            with os.scandir(fd) as it:
                names = [de.name for de in it]
            for n in names:
                crel = f"{drel}/{n}" if drel else n
                if keep is not None and crel in keep:
                    try:
                        cfd = os.open(n, DIR_FLAGS, dir_fd=fd)
                    except (NotADirectoryError, FileNotFoundError):
                        continue
                    todo.append((crel, cfd, True))
                else:
                    tree.remove(fd, n, crel)
        finally:
            if owned:
                os.close(fd)


# ----------------------------------------------------------------------------- foreign tars


def foreign_whiteout(tree: SafeTree, parts: list[str], path: str, created: set[str]) -> None:
    """Apply one OCI whiteout of a foreign layer to what lower layers left (``created`` holds
    this layer's own entries, which no whiteout of it may remove)."""
    base = parts[-1]
    pfd = tree.parent(parts, path, create=False)
    if pfd is None:
        return
    prefix = "/".join(parts[:-1])
    if base == OPAQUE_MARKER:
        empty_dir(tree, pfd, prefix, keep=created)
    elif base.startswith(".wh..wh."):
        return
    else:
        check_whiteout_target(tree.name, path, base)
        target = base[4:]
        rel = f"{prefix}/{target}" if prefix else target
        if rel not in created:
            tree.remove(pfd, target, rel)
        else:  # this layer has its own entry there: hide only what lies below it
            try:
                cfd = os.open(target, DIR_FLAGS, dir_fd=pfd)
            except (NotADirectoryError, FileNotFoundError):
                return
            try:
                empty_dir(tree, cfd, rel, keep=created)
            finally:
                os.close(cfd)


def foreign_overlay_whiteout(tree: SafeTree, parts: list[str], path: str, e: Entry,
                             created: set[str], opaque_key: str, same_owner: bool) -> None:
    """One OCI whiteout of a foreign layer as an overlayfs whiteout in the layer's own
    directory (``unpack_tar(whiteouts="overlay")``), after the tar's members are written."""
    base = parts[-1]
    if base.startswith(".wh..wh.") and base != OPAQUE_MARKER:
        return  # other aufs metadata: ignored, as containerd does
    pfd = tree.parent_made(parts, path)
    if base == OPAQUE_MARKER:
        os.setxattr(pfd, opaque_key, b"y")
        return
    check_whiteout_target(tree.name, path, base)
    target = base[4:]
    rel = "/".join(parts[:-1] + [target])
    if rel in created:  # this layer's own entry hides the lower one; a directory merges
        if stat.S_ISDIR(os.stat(target, dir_fd=pfd, follow_symlinks=False).st_mode):
            cfd = os.open(target, DIR_FLAGS, dir_fd=pfd)
            try:
                os.setxattr(cfd, opaque_key, b"y")
            finally:
                os.close(cfd)
        return
    with_same = False
    try:
        os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=pfd)
        with_same = same_owner
    except FileExistsError:
        return  # two whiteouts of one name
    if with_same:
        os.chown(target, e.uid, e.gid, dir_fd=pfd, follow_symlinks=False)
