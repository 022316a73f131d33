"""Copying into a build's rootfs without trusting it (side effects).

A rootfs being built holds an image's files, which may be hostile: a symlink ``/opt ->
/root/.ssh`` must lead to the rootfs's ``/root/.ssh``, never the host's. So a destination is
opened with the rootfs as ``/`` (``open_dir_in_root``, ``safefs.open_in_root``), and everything
is created through directory fds with ``O_NOFOLLOW``: what is in the way is replaced, never
written through. A source tree is copied leaving out exactly what the tree hash leaves out
(``envbuild.build.pin``), so a layer holds what its key describes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from envbuild.build.pin import IGNORED_DIR_NAMES, IGNORED_FILE_SUFFIXES, IGNORED_NAMES
from envbuild.errors import BuildError, SourceError, UnsafeLayerError
from envbuild.safefs import open_in_root, remove_tree


def open_dir_in_root(root: Path, rel: str) -> int:
    """A directory fd for ``rel`` inside the tree ``root`` (a build's merged rootfs), missing
    directories created: every component is resolved with ``root`` as ``/``
    (``safefs.open_in_root``), so an image's symlink ``/opt -> /root/.ssh`` leads to the
    rootfs's ``/root/.ssh``, never the host's."""
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        fd = os.dup(root_fd)
        for i, comp in enumerate(parts):
            os.close(fd)
            sub = "/".join(parts[:i + 1])
            try:
                fd = open_in_root(root_fd, sub, _DIR_RO)
            except FileNotFoundError:
                parent = open_in_root(root_fd, "/".join(parts[:i]), _DIR_RO)
                try:
                    os.mkdir(comp, 0o755, dir_fd=parent)
                finally:
                    os.close(parent)
                fd = open_in_root(root_fd, sub, _DIR_RO)
        return fd
    except OSError as e:
        raise BuildError(f"create {rel} in the build rootfs: {e.strerror}") from None
    finally:
        os.close(root_fd)


_DIR_RO = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_DIR_NOFOLLOW = _DIR_RO | os.O_NOFOLLOW


def drop_devices(root: Path, refuse: str | None = None) -> list[str]:
    """Remove (or with ``refuse``, refuse with ``UnsafeLayerError``) every block and character
    device below ``root``; iterative, never following symlinks. Returns what was removed."""
    removed: list[str] = []
    todo = [""]
    while todo:
        rel = todo.pop()
        with os.scandir(root / rel if rel else root) as it:
            for e in it:
                crel = f"{rel}/{e.name}" if rel else e.name
                if e.is_dir(follow_symlinks=False):
                    todo.append(crel)
                    continue
                mode = e.stat(follow_symlinks=False).st_mode
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                    if refuse:
                        raise UnsafeLayerError(
                            f"{refuse}: {crel} is a device node, refused",
                            hint="device nodes never enter a layer (runc provides /dev)")
                    os.unlink(e.path)
                    removed.append(crel)
    return removed


def copy_source_tree(src: Path, dest: Path | int, *, owner: tuple[int, int] | None = None,
                     mode: int | None = None) -> None:
    """Copy a source tree into ``dest`` (a path, or a directory fd from ``open_dir_in_root``),
    leaving out exactly what the tree hash leaves out (``.git``, ``__pycache__``, ``*.pyc``),
    so the layer holds what its key describes. Symlinks are copied as links (never followed),
    everything is created through directory fds with ``O_NOFOLLOW`` (what is in the way is
    replaced, never written through). ``owner``/``mode`` (copy steps) apply to every entry
    (``mode`` to files only). Iterative: depth costs no recursion."""
    if isinstance(dest, int):
        top = os.dup(dest)
    else:
        dest.mkdir(parents=True, exist_ok=True)
        top = os.open(dest, _DIR_NOFOLLOW)
    try:
        st = os.lstat(src)
        os.fchmod(top, st.st_mode & 0o7777)
        if owner is not None:
            os.fchown(top, *owner)
        todo = [(str(src), top)]
        top = -1
        while todo:
            sdir, dfd = todo.pop()
            try:
                for entry in sorted(os.scandir(sdir), key=lambda e: e.name):
                    sub = _copy_entry(entry, dfd, owner, mode)
                    if sub is not None:
                        todo.append((entry.path, sub))
            finally:
                os.close(dfd)
    finally:
        if top >= 0:
            os.close(top)


def _copy_entry(entry: os.DirEntry, dfd: int, owner, mode) -> int | None:
    """Copy one entry into ``dfd``; a directory's new fd is returned for the caller to fill."""
    name = entry.name
    if name in IGNORED_NAMES:
        return None
    st = entry.stat(follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        if name in IGNORED_DIR_NAMES:
            return None
        try:
            sub = os.open(name, _DIR_NOFOLLOW, dir_fd=dfd)
        except FileNotFoundError:
            os.mkdir(name, 0o700, dir_fd=dfd)
            sub = os.open(name, _DIR_NOFOLLOW, dir_fd=dfd)
        except NotADirectoryError:
            os.unlink(name, dir_fd=dfd)  # a file or symlink in the way: replaced
            os.mkdir(name, 0o700, dir_fd=dfd)
            sub = os.open(name, _DIR_NOFOLLOW, dir_fd=dfd)
        os.fchmod(sub, st.st_mode & 0o7777)
        if owner is not None:
            os.fchown(sub, *owner)
        return sub
    if name.endswith(IGNORED_FILE_SUFFIXES):
        return None
    _unlink_if_there(name, dfd)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(entry.path), name, dir_fd=dfd)
        if owner is not None:
            os.chown(name, *owner, dir_fd=dfd, follow_symlinks=False)
        return None
    if not stat.S_ISREG(st.st_mode):
        raise SourceError(f"{entry.path} is not a regular file, directory or symlink",
                          hint="copy and path sources hold files, directories and symlinks")
    copy_file_into(entry.path, dfd, name, st, owner, mode)
    return None


def _unlink_if_there(name: str, dfd: int) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        remove_tree(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def copy_file_into(src: str, dfd: int, name: str, st: os.stat_result | None = None,
                   owner: tuple[int, int] | None = None, mode: int | None = None) -> None:
    """Copy the regular file ``src`` (not followed if it is a symlink) to ``name`` in ``dfd``
    (replacing what is there, never writing through it), with its mode and mtime."""
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(sfd)
        if not stat.S_ISREG(st.st_mode):
            raise SourceError(f"{src} is not a regular file")
        _unlink_if_there(name, dfd)
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=dfd)
        try:
            left = st.st_size
            while left > 0:
                # sendfile: copy_file_range refuses EXDEV between overlayfs and the source fs
                n = os.sendfile(out, sfd, None, min(left, 1 << 30))
                if n == 0:
                    break
                left -= n
            os.fchmod(out, mode if mode is not None else st.st_mode & 0o7777)
            if owner is not None:
                os.fchown(out, *owner)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(sfd)
