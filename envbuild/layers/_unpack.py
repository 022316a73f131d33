"""Unpack a layer into a directory, safely and fast.

The verified TOC is authoritative: members, metadata and the offset of each file's contents come
from it, and the contents from the frames (decompressed in parallel, in order), each checked
against its TOC digest. Tar headers are not parsed again here (that costs as much as everything
else together); ``verify_layer`` is the check that the headers agree with the TOC.
Safety without a ``realpath`` per member: every parent directory is either one this unpack
created or one it checked with ``lstat`` once (``_Dirs``), so nothing is ever written through a
symlink; names must be relative without ``.``/``..`` components; hardlinks must point to a
regular file extracted earlier from the same layer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat

from envbuild.errors import CorruptLayerError, LayerError, UnsafeLayerError
from envbuild.layers._stream import TarStream, Truncated
from envbuild.layers._tar import TarFormatError
from envbuild.layers._toc import Entry
from envbuild.layers._walk import OPAQUE_MARKER, WHITEOUT_PREFIX

WHITEOUT_MODES = ("apply", "overlay", "keep")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def check_member_name(name: str, path: str, what: str = "member") -> list[str]:
    """The components of a safe relative member name, or ``UnsafeLayerError``."""
    if not path:
        raise UnsafeLayerError(f"layer {name}: {what} with an empty name")
    if path.startswith("/"):
        raise UnsafeLayerError(f"layer {name}: {what} {path!r} has an absolute path")
    parts = path.split("/")
    for p in parts:
        if p in ("", ".", ".."):
            raise UnsafeLayerError(f"layer {name}: {what} {path!r} has a "
                                   f"{'..' if p == '..' else 'empty or .'} path component")
    return parts


def _remove(path: str) -> bool:
    """Remove whatever is at ``path`` (never following symlinks); True if it was a directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
        return True
    os.unlink(path)
    return False


class _Dirs:
    """Relative directories known to be real directories under ``root`` (never symlinks)."""

    def __init__(self, root: str, name: str) -> None:
        self.root = root
        self.name = name
        self.known: set[str] = {""}
        self.files: set[str] = set()  # regular files extracted so far: valid hardlink targets

    def ensure(self, parts: list[str], path: str, create: bool = True) -> bool:
        """Make sure the parent of ``parts`` is a real directory, creating missing ones.
        Returns False (only with ``create=False``) if some parent does not exist."""
        parent = "/".join(parts[:-1])
        if parent in self.known:
            return True
        for i in range(1, len(parts)):
            p = "/".join(parts[:i])
            if p in self.known:
                continue
            full = self.root + "/" + p
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                if not create:
                    return False
                os.mkdir(full, 0o755)
                self.known.add(p)
                continue
            if stat.S_ISLNK(st.st_mode):
                raise UnsafeLayerError(f"layer {self.name}: member {path!r} would be written "
                                       f"through the symlink {p!r}")
            if not stat.S_ISDIR(st.st_mode):
                raise LayerError(f"layer {self.name}: member {path!r} needs {p!r} to be a "
                                 "directory, but it is not")
            self.known.add(p)
        return True

    def forget(self, rel: str) -> None:
        """The directory ``rel`` was removed: forget it and everything below it, so nothing is
        later written or hardlinked through whatever replaces it."""
        prefix = rel + "/"
        self.known = {d for d in self.known if d != rel and not d.startswith(prefix)}
        self.files = {f for f in self.files if not f.startswith(prefix)}


def unpack_layer(reader, dest: str | os.PathLike, *, whiteouts: str = "apply",
                 same_owner: bool | None = None, allow_devices: bool = True,
                 overlay_xattr: str = "trusted") -> None:
    """Extract the layer read by ``reader`` (a ``LayerReader``) below ``dest``.

    ``whiteouts``: ``"apply"`` deletes what OCI whiteouts name from the existing tree at
    ``dest`` (stacking a layer onto the ones below it; ``.wh.*`` files are not written);
    ``"overlay"`` turns them back into overlayfs whiteouts (0/0 character devices and
    ``<overlay_xattr>.overlay.opaque=y``) so ``dest`` can serve as an overlay lower dir;
    ``"keep"`` writes them as the plain files they are in the tar.
    ``same_owner`` (default: running as root) restores uid/gid; ``allow_devices=False`` refuses
    device nodes and FIFOs. Raises ``UnsafeLayerError`` before writing anything unsafe and
    ``CorruptLayerError`` when a file's contents fail their TOC digest or the frames end early.
    """
    if whiteouts not in WHITEOUT_MODES:
        raise ValueError(f"whiteouts must be one of {WHITEOUT_MODES}, not {whiteouts!r}")
    name = reader.name
    root = os.fspath(dest).rstrip("/") or "/"
    os.makedirs(root, exist_ok=True)
    if same_owner is None:
        same_owner = os.geteuid() == 0
    toc = reader.entries()
    dirs = _Dirs(root, name)
    if whiteouts == "apply":
        _apply_whiteouts(toc, root, dirs, name)
    opaque_key = f"{overlay_xattr}.overlay.opaque"
    dir_meta: list[tuple[str, Entry]] = []
    frames = reader.iter_frames()
    stream = TarStream(frames)
    pieces = stream.pieces
    sha256 = hashlib.sha256
    write = os.write
    try:
        for e in toc:
            path = e.path
            parts = check_member_name(name, path)
            dirs.ensure(parts, path)
            full = root + "/" + path
            base = parts[-1]
            kind = e.type
            if base.startswith(WHITEOUT_PREFIX) and whiteouts != "keep":
                if whiteouts == "overlay":
                    if base == OPAQUE_MARKER:
                        os.setxattr(root + "/" + "/".join(parts[:-1]) if len(parts) > 1
                                    else root, opaque_key, b"y")
                    elif not base.startswith(".wh..wh."):
                        target = full[:len(full) - len(base)] + base[4:]
                        _check_whiteout_target(name, path, base)
                        if _remove(target):
                            dirs.forget("/".join(parts[:-1] + [base[4:]]))
                        os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(0, 0))
                        if same_owner:
                            os.lchown(target, e.uid, e.gid)
                continue
            if kind == "file":
                try:
                    fd = os.open(full, _CREATE, 0o600)
                except FileExistsError:
                    if _remove(full):
                        dirs.forget(path)
                    fd = os.open(full, _CREATE, 0o600)
                try:
                    h = sha256()
                    got = 0
                    if e.size:
                        c = e.chunks[0] if e.chunks else None
                        gap = c.uoffset + c.inner - stream.offset if c else -1
                        if gap < 0:
                            raise CorruptLayerError(f"layer {name}: chunks of {path} are missing "
                                                    "or out of order")
                        if stream.skip(gap) != gap:
                            raise Truncated("tar stream ends before member data")
                    for piece in pieces(e.size):
                        h.update(piece)
                        got += len(piece)
                        while piece:
                            w = write(fd, piece)
                            piece = piece[w:]
                    if got != e.size:
                        raise Truncated("tar stream ends inside member data")
                    if "sha256:" + h.hexdigest() != e.digest:
                        raise CorruptLayerError(f"layer {name}: content of {path} does not "
                                                "match its TOC digest")
                    if same_owner:
                        os.fchown(fd, e.uid, e.gid)
                    os.fchmod(fd, e.mode)
                    for k, v in e.xattrs.items():
                        os.setxattr(fd, k, v)
                    os.utime(fd, (e.mtime, e.mtime))
                finally:
                    os.close(fd)
                dirs.files.add(path)
            elif kind == "dir":
                try:
                    os.mkdir(full, 0o700)
                except FileExistsError:
                    st = os.lstat(full)
                    if not stat.S_ISDIR(st.st_mode):
                        os.unlink(full)
                        os.mkdir(full, 0o700)
                dirs.known.add(path)
                dir_meta.append((full, e))
            elif kind == "symlink":
                _replace(full, path, dirs)
                os.symlink(e.linkname, full)
                if same_owner:
                    os.lchown(full, e.uid, e.gid)
                os.utime(full, (e.mtime, e.mtime), follow_symlinks=False)
            elif kind == "hardlink":
                check_member_name(name, e.linkname, "hardlink target")
                if e.linkname not in dirs.files:
                    raise UnsafeLayerError(f"layer {name}: hardlink {path!r} points to "
                                           f"{e.linkname!r}, which is not a regular file "
                                           "earlier in this layer")
                _replace(full, path, dirs)
                os.link(root + "/" + e.linkname, full, follow_symlinks=False)
            else:  # char, block, fifo
                if not allow_devices:
                    raise UnsafeLayerError(f"layer {name}: {path} is a {kind} node, refused "
                                           "(allow_devices=False)")
                _replace(full, path, dirs)
                if kind == "fifo":
                    os.mkfifo(full, 0o600)
                else:
                    fmt = stat.S_IFCHR if kind == "char" else stat.S_IFBLK
                    os.mknod(full, fmt | 0o600, os.makedev(e.devmajor, e.devminor))
                if same_owner:
                    os.lchown(full, e.uid, e.gid)
                os.chmod(full, e.mode)
                for k, v in e.xattrs.items():
                    os.setxattr(full, k, v, follow_symlinks=False)
                os.utime(full, (e.mtime, e.mtime))
    except (TarFormatError, Truncated) as err:
        raise CorruptLayerError(f"layer {name}: tar stream: {err}") from None
    except OSError as err:
        raise LayerError(f"layer {name}: unpack into {root}: {err}") from err
    finally:
        frames.close()
    # directories last, deepest first: their mode may forbid writes, and creating children
    # would bump their mtime
    for full, e in reversed(dir_meta):
        if same_owner:
            os.lchown(full, e.uid, e.gid)
        os.chmod(full, e.mode)
        for k, v in e.xattrs.items():
            os.setxattr(full, k, v, follow_symlinks=False)
        os.utime(full, (e.mtime, e.mtime), follow_symlinks=False)


def _replace(full: str, path: str, dirs: _Dirs) -> None:
    try:
        os.lstat(full)
    except FileNotFoundError:
        return
    if _remove(full):
        dirs.forget(path)


def _check_whiteout_target(name: str, path: str, base: str) -> None:
    if base[4:] in ("", ".", ".."):
        raise UnsafeLayerError(f"layer {name}: whiteout {path!r} names no file")


def _apply_whiteouts(toc: list[Entry], root: str, dirs: _Dirs, name: str) -> None:
    """Delete what the layer's whiteouts hide, before extracting anything: whiteouts apply only
    to lower layers, never to entries of the same layer (OCI image-spec, layer.md)."""
    for e in toc:
        base = e.path.rpartition("/")[2]
        if not base.startswith(WHITEOUT_PREFIX):
            continue
        parts = check_member_name(name, e.path)
        if not dirs.ensure(parts, e.path, create=False):
            continue  # the parent does not exist: nothing to hide
        parent = root + "/" + "/".join(parts[:-1]) if len(parts) > 1 else root
        if base == OPAQUE_MARKER:
            with os.scandir(parent) as it:
                for de in it:
                    _remove(de.path)
            prefix = "/".join(parts[:-1])
            dirs.known = {d for d in dirs.known
                          if not prefix or d == prefix or not d.startswith(prefix + "/")}
            if not prefix:
                dirs.known = {""}
        elif base.startswith(".wh..wh."):
            continue  # other aufs metadata: ignored, as containerd does
        else:
            _check_whiteout_target(name, e.path, base)
            if _remove(parent + "/" + base[4:]):
                dirs.forget("/".join(parts[:-1] + [base[4:]]))
