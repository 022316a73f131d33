"""Unpack a layer, or any tar envbuild applies, into a directory: safely and fast.

**One safe unpacker** for every tar that reaches a build host's disk: envbuild layers
(``unpack_layer``) and foreign tars (``unpack_tar``: ``rootfs`` tarballs, OCI image layers,
workspace archives and git archives; plain, gzip, zstd, xz or bzip2). Both write through
``_Tree``, which never follows a symlink:

- every parent directory is reached through a directory fd opened component by component with
  ``O_NOFOLLOW | O_DIRECTORY`` from the root fd (or ``safefs.open_beneath``), and cached; a
  symlink on the way (planted by this tar or a layer below) refuses the member
  (``UnsafeLayerError``) — containerd would resolve it inside the root, envbuild refuses;
- every create, replace, remove, chmod and whiteout is an ``*at`` call on that fd with one
  name, so no path is ever resolved again; directories are removed with
  ``safefs.remove_tree(dir_fd=...)``;
- names are relative without ``.``/``..`` components (foreign tars: a leading ``/`` or ``./``
  is dropped, as GNU tar does); hardlinks point to a regular file already in the tree (for an
  envbuild layer: extracted earlier from the same layer);
- device nodes are refused in foreign tars always and in layers with ``allow_devices=False``
  (the node cache); ``trusted.overlay.*``/``user.overlay.*`` xattrs of a foreign tar are refused
  (overlayfs would act on them);
- long runs of zero bytes in a file are written as holes (a 64 KiB window that compares equal
  to zeros is skipped, then ``ftruncate``), so a sparse file in a snapshot stays sparse.

For layers the verified TOC is authoritative: members, metadata and each file's offset come
from it, the contents from the frames, each checked against its TOC digest. Every member's tar
header must agree with its TOC entry (``docs/layer-format.md``): the header bytes are compared
with the TOC entry's canonical encoding, and only when they differ parsed and compared field
by field; a disagreement is ``CorruptLayerError``.
"""

from __future__ import annotations

import bz2
import errno
import hashlib
import lzma
import os
import stat
import zlib
from collections.abc import Iterable, Iterator
from itertools import chain

import zstandard

from envbuild.errors import CorruptLayerError, LayerError, UnsafeLayerError
from envbuild.layers._stream import TarStream, Truncated, read_pax_header
from envbuild.layers._tar import (
    BLOCK,
    GNU_LONG_LINK,
    GNU_LONG_NAME,
    MAX_GNU_LONG,
    MAX_PAX_HEADER,
    ZERO_BLOCK,
    TarFormatError,
    encode_header,
    foreign_pax,
    make_entry,
    make_foreign_entry,
    parse_foreign_header,
    parse_pax,
    parse_ustar,
)
from envbuild.layers._toc import Entry
from envbuild.layers._walk import OPAQUE_MARKER, WHITEOUT_PREFIX
from envbuild.safefs import open_beneath, remove_tree

WHITEOUT_MODES = ("apply", "overlay", "keep")
TAR_WHITEOUT_MODES = ("apply", "overlay", "refuse")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FD_CACHE = 256       # directory fds kept open (tars are mostly depth-first: high locality)
HOLE = 1 << 16        # zero windows of this size become holes
_ZERO_HOLE = bytes(HOLE)
_SPARSE_MIN = HOLE    # smaller files are written as they are
_READ = 1 << 20
_REFUSED_XATTRS = ("trusted.overlay.", "user.overlay.")


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


def foreign_member_name(name: str, path: str, what: str = "member") -> list[str]:
    """The components of a foreign tar's member name: ``/`` and ``.`` components dropped
    (``./etc/passwd`` and ``/etc/passwd`` are ``etc/passwd``), ``..`` refused; [] for the root."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeLayerError(f"{name}: {what} {path!r} has a '..' path component")
    return parts


class _Tree:
    """Every change below one root directory, through verified directory fds (never a path
    resolved twice, never a symlink followed)."""

    def __init__(self, root_fd: int, name: str) -> None:
        self.root_fd = root_fd
        self.name = name
        self.fds: dict[str, int] = {"": root_fd}
        self.files: set[str] = set()  # regular files extracted so far (layer hardlink targets)

    def close(self) -> None:
        for rel, fd in self.fds.items():
            if rel:
                os.close(fd)
        # in place: unpack_layer holds this dict (a stale copy would hold closed fd numbers)
        self.fds.clear()
        self.fds[""] = self.root_fd

    def parent(self, parts: list[str], path: str, create: bool = True) -> int | None:
        """A verified fd of the directory holding ``parts[-1]``, creating missing directories
        (0755); None (only with ``create=False``) if one is missing. The fd belongs to the
        cache. Levels of a very deep path beyond the cache's bound are walked through and
        closed, so depth costs neither recursion nor more than ``_FD_CACHE`` + 1 fds."""
        rel = "/".join(parts[:-1])
        fd = self.fds.get(rel)
        if fd is not None:
            return fd
        i = len(parts) - 1
        while i > 0 and "/".join(parts[:i]) not in self.fds:
            i -= 1
        fd = self.fds["/".join(parts[:i])]
        owned = False  # fd is a walked-through level, not in the cache: close it after use
        try:
            for j in range(i, len(parts) - 1):
                comp = parts[j]
                try:
                    child = os.open(comp, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        return None
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    child = os.open(comp, _DIR, dir_fd=fd)
                except NotADirectoryError:
                    p = "/".join(parts[:j + 1])
                    if stat.S_ISLNK(os.stat(comp, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise UnsafeLayerError(f"layer {self.name}: member {path!r} would be "
                                               f"written through the symlink {p!r}") from None
                    raise LayerError(f"layer {self.name}: member {path!r} needs {p!r} to be a "
                                     "directory, but it is not") from None
                if owned:
                    os.close(fd)
                fd = child
                if j == len(parts) - 2 or len(self.fds) < _FD_CACHE:
                    self.fds["/".join(parts[:j + 1])] = child
                    owned = False
                else:
                    owned = True
            return fd
        finally:
            if owned:
                os.close(fd)

    def evict(self) -> None:
        """Bound the fd cache. Called between members only: an fd handed out for the current
        member (its parent, a hardlink's target dir) stays open until the member is done."""
        if len(self.fds) > _FD_CACHE:
            # drop the older half (dicts keep insertion order): the newest entries are the
            # current member's ancestors, so a deep or long tar keeps hitting the cache
            for rel in list(self.fds)[1:len(self.fds) // 2]:
                os.close(self.fds.pop(rel))

    def forget(self, rel: str) -> None:
        """The directory ``rel`` was removed: forget it and everything below it, so nothing is
        later written or hardlinked through whatever replaces it."""
        prefix = rel + "/"
        for d in [d for d in self.fds if d == rel or d.startswith(prefix)]:
            if d:
                os.close(self.fds.pop(d))
        if self.files:
            self.files = {f for f in self.files if not f.startswith(prefix)}

    def remove(self, pfd: int, base: str, rel: str) -> bool:
        """Remove whatever is at ``base`` in ``pfd`` (never following it); True if it existed."""
        try:
            st = os.stat(base, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            self.forget(rel)
            remove_tree(base, dir_fd=pfd)
        else:
            os.unlink(base, dir_fd=pfd)
        self.files.discard(rel)
        return True

    def create_file(self, pfd: int, base: str, rel: str) -> int:
        try:
            return os.open(base, _CREATE, 0o600, dir_fd=pfd)
        except FileExistsError:
            self.remove(pfd, base, rel)
            return os.open(base, _CREATE, 0o600, dir_fd=pfd)

    def mkdir(self, pfd: int, base: str, rel: str) -> None:
        try:
            os.mkdir(base, 0o700, dir_fd=pfd)
        except FileExistsError:
            if not stat.S_ISDIR(os.stat(base, dir_fd=pfd, follow_symlinks=False).st_mode):
                os.unlink(base, dir_fd=pfd)
                os.mkdir(base, 0o700, dir_fd=pfd)

    def node(self, pfd: int, base: str, rel: str, e: Entry, same_owner: bool,
             mode_mask: int = 0o7777) -> None:
        """A symlink, FIFO or device node (replacing what is there)."""
        self.remove(pfd, base, rel)
        if e.type == "symlink":
            os.symlink(e.linkname, base, dir_fd=pfd)
        elif e.type == "fifo":
            os.mkfifo(base, 0o600, dir_fd=pfd)
        else:
            fmt = stat.S_IFCHR if e.type == "char" else stat.S_IFBLK
            os.mknod(base, fmt | 0o600, os.makedev(e.devmajor, e.devminor), dir_fd=pfd)
        if same_owner:
            os.chown(base, e.uid, e.gid, dir_fd=pfd, follow_symlinks=False)
        if e.type != "symlink":
            os.chmod(base, e.mode & mode_mask, dir_fd=pfd)  # just created by us: not a symlink
            for k, v in e.xattrs.items():
                # no *xattrat in Python: the verified dir fd's /proc name, then one name
                set_xattr(f"/proc/self/fd/{pfd}/{base}", k, v, f"layer {self.name}", rel)
        os.utime(base, (e.mtime, e.mtime), dir_fd=pfd, follow_symlinks=False)

    def hardlink(self, pfd: int, base: str, rel: str, target: list[str], tpath: str) -> None:
        tfd = self.parent(target, tpath, create=False)
        if tfd is None or not stat.S_ISREG(os.stat(target[-1], dir_fd=tfd,
                                                   follow_symlinks=False).st_mode):
            raise UnsafeLayerError(f"layer {self.name}: hardlink {rel!r} points to {tpath!r}, "
                                   "which is not a regular file in the tree")
        self.remove(pfd, base, rel)
        os.link(target[-1], base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)

    def finish_dirs(self, dir_meta: list[tuple[str, Entry]], same_owner: bool) -> None:
        """Directory metadata last, deepest first: a mode may forbid writes, and creating
        children would bump mtimes. A directory replaced since (by a later member or a
        whiteout) is skipped: its fd is opened no-follow, never through what replaced it."""
        self.close()
        for rel, e in reversed(dir_meta):
            try:
                fd = _open_dir_beneath(self.root_fd, rel) if rel else os.dup(self.root_fd)
            except OSError as err:
                if err.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue
                raise
            try:
                _apply_meta(fd, e, same_owner, self.name, rel)
            finally:
                os.close(fd)


def _apply_meta(fd: int, e: Entry, same_owner: bool, name: str, rel: str,
                mode_mask: int = 0o7777) -> None:
    """Owner (when restoring owners), mode (``& mode_mask``), xattrs and mtime of ``e`` onto the
    open ``fd`` (member ``rel`` of layer ``name``, for errors)."""
    if same_owner:
        os.fchown(fd, e.uid, e.gid)
    os.fchmod(fd, e.mode & mode_mask)
    for k, v in e.xattrs.items():
        set_xattr(fd, k, v, f"layer {name}", rel)
    os.utime(fd, (e.mtime, e.mtime))


def set_xattr(target: int | str, key: str, value: bytes, where: str, rel: str, *,
              drop_unsupported: bool = False) -> None:
    """``setxattr`` of one member's attribute (``target``: an fd, or a path never followed),
    a refusal of the kernel raised as one line naming ``where`` (the layer), the member and
    the attribute: an invalid ``security.capability`` value (a hand-made layer's) is EINVAL,
    which said only "[Errno 22] Invalid argument: 5" before (issue 34). With
    ``drop_unsupported`` an attribute this filesystem cannot hold is dropped, as GNU tar does."""
    try:
        if isinstance(target, str):
            os.setxattr(target, key, value, follow_symlinks=False)
        else:
            os.setxattr(target, key, value)
    except OSError as err:
        if drop_unsupported and err.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return
        why = " (not a file capability of a known version)" \
            if key == "security.capability" and err.errno == errno.EINVAL else ""
        raise CorruptLayerError(f"{where}: member {rel!r}: the kernel refuses its xattr "
                                f"{key!r}: {err.strerror}{why}",
                                hint="rebuild the layer from a real tree, or without that "
                                     "attribute") from None


def _open_dir_beneath(root_fd: int, rel: str) -> int:
    """``safefs.open_beneath`` of a directory, in steps of < 2 KiB of path, so a tree deeper
    than ``PATH_MAX`` resolves too (each step from the verified fd of the one before)."""
    if len(rel) < 2048:
        return open_beneath(root_fd, rel, _DIR)
    fd = os.dup(root_fd)
    pos = 0
    try:
        while pos < len(rel):
            end = pos + 2048
            if end >= len(rel):
                step, pos = rel[pos:], len(rel)
            else:
                cut = rel.rfind("/", pos, end)
                if cut <= pos:
                    raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), rel)
                step, pos = rel[pos:cut], cut + 1
            nfd = open_beneath(fd, step, _DIR)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _write_data(fd: int, pieces: Iterable, sparse: bool, h) -> int:
    """Write ``pieces`` to ``fd`` (hashing them into ``h``); with ``sparse``, 64 KiB windows of
    zeros become holes. Returns the byte count."""
    got = 0
    write = os.write
    hole = False
    for piece in pieces:
        h.update(piece)
        n = len(piece)
        got += n
        if sparse:
            pos = start = 0  # piece[start:pos] is data not yet written
            while pos < n:
                end = pos + HOLE
                # first/last byte first: data that is not zero fails without a copy
                if end <= n and piece[pos] == 0 and piece[end - 1] == 0 \
                        and bytes(piece[pos:end]) == _ZERO_HOLE:
                    w = piece[start:pos]
                    while w:
                        w = w[write(fd, w):]
                    os.lseek(fd, HOLE, os.SEEK_CUR)
                    hole = True
                    start = end
                pos = end
            w = piece[start:n]
            if w:
                hole = False
            while w:
                w = w[write(fd, w):]
            continue
        while piece:
            piece = piece[write(fd, piece):]
    if hole:
        os.ftruncate(fd, got)
    return got


def _open_root(dest) -> tuple[int, str]:
    if isinstance(dest, int):
        return os.dup(dest), f"fd {dest}"
    root = os.fspath(dest).rstrip("/") or "/"
    os.makedirs(root, exist_ok=True)
    return os.open(root, _DIR), root


def unpack_layer(reader, dest, *, whiteouts: str = "apply",
                 same_owner: bool | None = None, allow_devices: bool = True,
                 strip_setid: bool = False, overlay_xattr: str = "trusted") -> None:
    """Extract the layer read by ``reader`` (a ``LayerReader``) below ``dest`` (a path or a
    directory fd).

    ``whiteouts``: ``"apply"`` deletes what OCI whiteouts name from the existing tree at
    ``dest`` (stacking a layer onto the ones below it; ``.wh.*`` files are not written);
    ``"overlay"`` turns them back into overlayfs whiteouts (0/0 character devices and
    ``<overlay_xattr>.overlay.opaque=y``) so ``dest`` can serve as an overlay lower dir;
    ``"keep"`` writes them as the plain files they are in the tar.
    ``same_owner`` (default: running as root) restores uid/gid; ``allow_devices=False`` refuses
    character and block devices (FIFOs stay: they reach no hardware, and the host's file APIs
    never open one, ``runtime_shim.isolation.fsaccess``); ``strip_setid`` clears the setuid and setgid
    bits of every file and node (directories keep theirs: a setgid directory grants nothing).
    Raises ``UnsafeLayerError`` before writing anything unsafe and
    ``CorruptLayerError`` when a file's contents fail their TOC digest, a tar header disagrees
    with its TOC entry, or the frames end early.
    """
    if whiteouts not in WHITEOUT_MODES:
        raise ValueError(f"whiteouts must be one of {WHITEOUT_MODES}, not {whiteouts!r}")
    name = reader.name
    if same_owner is None:
        same_owner = os.geteuid() == 0
    toc = reader.entries()
    if not allow_devices:
        _refuse_devices(toc, name)
    root_fd, root = _open_root(dest)
    tree = _Tree(root_fd, name)
    opaque_key = f"{overlay_xattr}.overlay.opaque"
    dir_meta: list[tuple[str, Entry]] = []
    frames = reader.iter_frames()
    stream = TarStream(frames)
    sha256 = hashlib.sha256
    mask = 0o7777 & ~(stat.S_ISUID | stat.S_ISGID) if strip_setid else 0o7777
    try:
        if whiteouts == "apply":
            _apply_whiteouts(toc, tree, name)
        fds = tree.fds
        for i, e in enumerate(toc):
            if len(fds) > _FD_CACHE:
                tree.evict()
            stream = _check_header(stream, e, i, name)
            path = e.path
            parts = check_member_name(name, path)
            # the parent's fd straight from the cache in the common case (no join, no call)
            pfd = fds.get(path.rpartition("/")[0]) if len(parts) > 1 else root_fd
            if pfd is None:
                pfd = tree.parent(parts, path)
            base = parts[-1]
            kind = e.type
            if kind == "file":
                if e.size:
                    c = e.chunks[0] if e.chunks else None
                    if c is None or c.uoffset + c.inner != stream.offset:
                        raise CorruptLayerError(f"layer {name}: chunks of {path} do not start "
                                                "where its tar header ends")
                if base.startswith(WHITEOUT_PREFIX) and whiteouts != "keep":
                    if stream.skip(e.size) != e.size:
                        raise Truncated("tar stream ends inside member data")
                    _skip_pad(stream, e.size)
                    if whiteouts == "overlay":
                        _overlay_whiteout(tree, pfd, parts, path, e, opaque_key, same_owner)
                    continue
                fd = tree.create_file(pfd, base, path)
                try:
                    h = sha256()
                    got = _write_data(fd, stream.pieces(e.size), e.size >= _SPARSE_MIN, h)
                    if got != e.size:
                        raise Truncated("tar stream ends inside member data")
                    if "sha256:" + h.hexdigest() != e.digest:
                        raise CorruptLayerError(f"layer {name}: content of {path} does not "
                                                "match its TOC digest")
                    _apply_meta(fd, e, same_owner, name, path, mask)
                finally:
                    os.close(fd)
                _skip_pad(stream, e.size)
                tree.files.add(path)
            elif kind == "dir":
                tree.mkdir(pfd, base, path)
                dir_meta.append((path, e))
            elif kind == "hardlink":
                target = check_member_name(name, e.linkname, "hardlink target")
                if e.linkname not in tree.files:
                    raise UnsafeLayerError(f"layer {name}: hardlink {path!r} points to "
                                           f"{e.linkname!r}, which is not a regular file "
                                           "earlier in this layer")
                tree.hardlink(pfd, base, path, target, e.linkname)
            else:  # symlink, char, block, fifo
                tree.node(pfd, base, path, e, same_owner, mask)
        frames.close()
        tree.finish_dirs(dir_meta, same_owner)
    except (TarFormatError, Truncated) as err:
        raise CorruptLayerError(f"layer {name}: tar stream: {err}") from None
    except OSError as err:
        raise LayerError(f"layer {name}: unpack into {root}: {err}") from err
    finally:
        frames.close()
        tree.close()
        os.close(root_fd)


def _refuse_devices(toc: list[Entry], name: str) -> None:
    """``UnsafeLayerError`` naming the first device node of ``toc``, before anything is
    written (each member's tar header is checked against its TOC entry as it is unpacked)."""
    for e in toc:
        if e.type in ("char", "block"):
            raise UnsafeLayerError(
                f"layer {name}: {e.path} is a {e.type} node, refused (a device, "
                f"{e.devmajor}:{e.devminor}); nothing was unpacked",
                hint="device nodes are created only when asked for: envbuild layer unpack "
                     "--allow-devices (as root, from a layer you trust)")


def _skip_pad(stream: TarStream, size: int) -> None:
    pad = -size % BLOCK
    if pad and stream.skip(pad) != pad:
        raise Truncated("tar stream ends inside member padding")


def _check_header(stream: TarStream, e: Entry, index: int, name: str) -> TarStream:
    """Consume member ``index``'s header(s) from ``stream`` and check they say what its TOC
    entry says. Fast path: the bytes equal the entry's canonical encoding (what the writer
    produced). Else the headers are parsed and compared field by field (``same_header``);
    the stream returned replaces ``stream`` (the bytes already read are put back in front)."""
    try:
        want = encode_header(e)
    except ValueError:
        want = b""
    got = stream.read(len(want)) if want else b""
    if want and bytes(got) == want:
        return stream
    start = stream.offset - len(got)
    again = TarStream(chain([bytes(got)], stream.rest()))
    again.offset = start
    parsed = _read_layer_header(again)
    if parsed is None or not parsed.same_header(e):
        said = "the end of the archive" if parsed is None else repr(parsed.path)
        raise CorruptLayerError(f"layer {name}: tar member {index + 1} ({said}) does not match "
                                f"its TOC entry {e.path!r}",
                                hint="the layer is corrupt or crafted; `envbuild layer verify` "
                                     "names the difference")
    return again


def _read_layer_header(stream: TarStream) -> Entry | None:
    """One v1 member header (with its PAX ``x`` header), or None at the end of the archive."""
    pax = None
    while True:
        hdr = stream.read(BLOCK)
        if len(hdr) < BLOCK:
            raise Truncated("tar stream ends inside a header")
        if hdr == ZERO_BLOCK:
            return None
        flag, fields = parse_ustar(bytes(hdr))
        if flag != b"x":
            return make_entry(flag, fields, pax)
        pax = read_pax_header(stream, fields["size"])


def _overlay_whiteout(tree: _Tree, pfd: int, parts: list[str], path: str, e: Entry,
                      opaque_key: str, same_owner: bool) -> None:
    base = parts[-1]
    if base == OPAQUE_MARKER:
        os.setxattr(pfd, opaque_key, b"y")
    elif not base.startswith(".wh..wh."):
        _check_whiteout_target(tree.name, path, base)
        target = base[4:]
        tree.remove(pfd, target, "/".join(parts[:-1] + [target]))
        os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=pfd)
        if same_owner:
            os.chown(target, e.uid, e.gid, dir_fd=pfd, follow_symlinks=False)


def _check_whiteout_target(name: str, path: str, base: str) -> None:
    if base[4:] in ("", ".", "..") or "/" in base[4:]:
        raise UnsafeLayerError(f"layer {name}: whiteout {path!r} names no file")


def _apply_whiteouts(toc: list[Entry], tree: _Tree, name: str) -> None:
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
            _empty_dir(tree, pfd, prefix, keep=None)
        elif base.startswith(".wh..wh."):
            continue  # other aufs metadata: ignored, as containerd does
        else:
            _check_whiteout_target(name, e.path, base)
            tree.remove(pfd, base[4:], "/".join(parts[:-1] + [base[4:]]))


def _empty_dir(tree: _Tree, dfd: int, rel: str, keep: set[str] | None) -> None:
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
                        cfd = os.open(n, _DIR, dir_fd=fd)
                    except (NotADirectoryError, FileNotFoundError):
                        continue
                    todo.append((crel, cfd, True))
                else:
                    tree.remove(fd, n, crel)
        finally:
            if owned:
                os.close(fd)


# ----------------------------------------------------------------------------- foreign tars


def _decompressed(f, name: str) -> Iterator[bytes]:
    """The tar bytes of ``f`` (plain, gzip, zstd, xz or bzip2; told apart by magic bytes)."""
    head = f.read(_READ)
    if head.startswith(b"\x1f\x8b"):
        dec = zlib.decompressobj(31)
        data = head
        while True:
            while data:
                out = dec.decompress(data)
                if out:
                    yield out
                if dec.eof:  # concatenated gzip members
                    data = dec.unused_data
                    dec = zlib.decompressobj(31)
                    if not data:
                        break
                else:
                    data = b""
            data = f.read(_READ)
            if not data:
                return
    elif head.startswith(b"\x28\xb5\x2f\xfd"):
        reader = zstandard.ZstdDecompressor().stream_reader(chain_reader(head, f),
                                                            read_across_frames=True)
        while chunk := reader.read(_READ):
            yield chunk
    elif head.startswith((b"\xfd7zXZ\x00", b"BZh")):
        dec = lzma.LZMADecompressor() if head[0] == 0xFD else bz2.BZ2Decompressor()
        data = head
        while data:
            out = dec.decompress(data)
            if out:
                yield out
            data = f.read(_READ)
    else:
        data = head
        while data:
            yield data
            data = f.read(_READ)


class chain_reader:
    """A file-like ``read`` over ``head`` then the rest of ``f``."""

    def __init__(self, head: bytes, f) -> None:
        self.head, self.f = head, f

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = self.head[:n] if n >= 0 else self.head, \
                self.head[n:] if n >= 0 else b""
            return out
        return self.f.read(n)


def iter_foreign_members(stream: TarStream, name: str) -> Iterator[tuple[Entry, int]]:
    """``(entry, data size)`` per member of a foreign tar; the consumer reads or skips the data,
    padding is skipped here. GNU long names, PAX and global headers are folded in."""
    pax: dict[bytes, bytes] = {}
    long_name = long_link = None
    while True:
        hdr = stream.read(BLOCK)
        if len(hdr) < BLOCK:
            if not len(hdr):
                return  # no end-of-archive marker: GNU tar accepts that too
            raise Truncated("tar stream ends inside a header")
        if hdr == ZERO_BLOCK:
            return
        flag, fields = parse_foreign_header(bytes(hdr))
        if flag in (b"x", b"g", GNU_LONG_NAME, GNU_LONG_LINK, b"V"):
            size = fields["size"]
            if size > (MAX_PAX_HEADER if flag in (b"x", b"g") else MAX_GNU_LONG):
                raise TarFormatError(f"{flag.decode()} header too large")
            data = bytes(stream.read(size + (-size % BLOCK)))
            if len(data) < size:
                raise Truncated("tar stream ends inside an extended header")
            if flag == b"x":
                pax.update(foreign_pax(parse_pax(data[:size])))
            elif flag == GNU_LONG_NAME:
                long_name = data[:size].rstrip(b"\0")
            elif flag == GNU_LONG_LINK:
                long_link = data[:size].rstrip(b"\0")
            # g: global records (times, charset) do not change member contents; V: a label
            continue
        if flag in (b"S", b"M", b"N", b"D"):
            raise TarFormatError(f"GNU tar member type {flag!r} is not supported")
        if long_name is not None:
            fields["name"] = long_name
        if long_link is not None:
            fields["linkname"] = long_link
        entry, size = make_foreign_entry(flag, fields, pax or None)
        pax, long_name, long_link = {}, None, None
        start = stream.offset
        yield entry, size
        if stream.offset != start + size:
            rest = start + size - stream.offset
            if stream.skip(rest) != rest:
                raise Truncated("tar stream ends inside member data")
        _skip_pad(stream, size)


#: Deepest ``strip_components`` accepted (the schema's bound too): no real archive nests its
#: files more than a few directories down, and a bound keeps a typo from emptying a tree.
MAX_STRIP_COMPONENTS = 16


def unpack_tar(source, dest, *, name: str, whiteouts: str = "refuse",
               same_owner: bool | None = None, overlay_xattr: str = "trusted",
               strip_components: int = 0) -> None:
    """Extract a foreign tar (a path or a binary file object; any compression
    ``_decompressed`` knows) below ``dest`` (a path or a directory fd) with the safety rules of
    the module docstring. ``name`` prefixes every error (``rootfs base.tar.gz``).

    ``whiteouts="apply"`` (OCI layers, stacked onto the tree below): ``.wh.NAME`` removes
    ``NAME`` and ``.wh..wh..opq`` empties its directory, of what *lower* layers put there only
    (never an entry of this tar, wherever in the tar the whiteout comes); ``"refuse"`` (rootfs
    tarballs, archives): a ``.wh.*`` member is an error (a packed layer would read it as a
    deletion); ``"overlay"`` (a foreign OCI layer unpacked alone as an overlay lower dir: the
    node cache) turns them into overlayfs whiteouts once the whole tar is written — a 0/0
    character device for ``.wh.NAME``, ``<overlay_xattr>.overlay.opaque=y`` on the directory
    for ``.wh..wh..opq`` and on a directory ``NAME`` this tar also holds (its own entry hides
    the lower one; a directory merges, so it is made opaque instead). Device nodes of the tar
    are always refused (runc provides ``/dev``); FIFOs are kept.

    ``strip_components=N`` (archive and git sources) drops the first N components of every
    member name and hardlink target, as ``tar --strip-components``, after the ``..`` check of
    the whole name; a directory left with no name is dropped (it is the stripped top), any
    other member left with none, a hardlink whose target is stripped away, and a tar of which
    nothing remains are refused (a strip that silently loses files is a wrong strip).
    """
    if whiteouts not in TAR_WHITEOUT_MODES:
        raise ValueError(f"whiteouts must be one of {TAR_WHITEOUT_MODES}, not {whiteouts!r}")
    if not 0 <= strip_components <= MAX_STRIP_COMPONENTS:
        raise UnsafeLayerError(f"{name}: strip_components {strip_components} is not within "
                               f"0..{MAX_STRIP_COMPONENTS}")
    if same_owner is None:
        same_owner = os.geteuid() == 0
    own = not hasattr(source, "read")
    f = open(source, "rb") if own else source
    root_fd, root = _open_root(dest)
    tree = _Tree(root_fd, name)
    tree.name = name
    created: set[str] = set()   # what this tar wrote (and the parents it implied)
    dir_meta: list[tuple[str, Entry]] = []
    pending: list[tuple[list[str], str, Entry]] = []   # overlay whiteouts, made at the end
    try:
        stream = TarStream(_decompressed(f, name))
        for e, size in iter_foreign_members(stream, name):
            tree.evict()
            parts = foreign_member_name(name, e.path)
            if strip_components:
                if len(parts) <= strip_components:
                    if e.type == "dir" or not parts:
                        continue  # a stripped top directory
                    raise UnsafeLayerError(
                        f"{name}: strip_components {strip_components} leaves nothing of "
                        f"{e.type} {e.path!r}",
                        hint="lower strip_components, or repack the archive with every file "
                             "under its top directory")
                parts = parts[strip_components:]
            if not parts:
                continue  # the root itself ("./"): dest keeps its own metadata
            path = "/".join(parts)
            base = parts[-1]
            if base.startswith(WHITEOUT_PREFIX):
                if whiteouts == "refuse":
                    raise UnsafeLayerError(f"{name}: member {path!r} is a whiteout; only OCI "
                                           "image layers may hold whiteouts")
                if whiteouts == "overlay":
                    pending.append((parts, path, e))
                else:
                    _foreign_whiteout(tree, parts, path, created)
                continue
            for k in e.xattrs:
                if k.startswith(_REFUSED_XATTRS):
                    raise UnsafeLayerError(f"{name}: member {path!r} carries the xattr {k!r}, "
                                           "refused (overlayfs would act on it)")
            if e.type in ("char", "block"):
                raise UnsafeLayerError(
                    f"{name}: member {path!r} is a {e.type} device node, refused",
                    hint="device nodes never enter a layer (runc provides /dev); rebuild the "
                         "tarball without them, e.g. tar --exclude='./dev/*'")
            pfd = tree.parent(parts, path)
            created.add(path)
            up = path.rpartition("/")[0]
            while up and up not in created:  # the parents it implied, stopping at a known one
                created.add(up)
                up = up.rpartition("/")[0]
            if e.type == "file":
                fd = tree.create_file(pfd, base, path)
                try:
                    got = _write_data(fd, stream.pieces(size), size >= _SPARSE_MIN,
                                      _NoHash)
                    if got != size:
                        raise Truncated("tar stream ends inside member data")
                    if same_owner:
                        os.fchown(fd, e.uid, e.gid)
                    os.fchmod(fd, e.mode)
                    for k, v in e.xattrs.items():
                        set_xattr(fd, k, v, name, path, drop_unsupported=True)
                    os.utime(fd, (e.mtime, e.mtime))
                finally:
                    os.close(fd)
            elif e.type == "dir":
                tree.mkdir(pfd, base, path)
                dir_meta.append((path, e))
            elif e.type == "hardlink":
                target = foreign_member_name(name, e.linkname, "hardlink target")
                if strip_components:
                    if len(target) <= strip_components:
                        raise UnsafeLayerError(
                            f"{name}: hardlink {e.path!r} points to {e.linkname!r}, which "
                            f"strip_components {strip_components} removes")
                    target = target[strip_components:]
                if not target:
                    raise UnsafeLayerError(f"{name}: hardlink {path!r} points to the root")
                tree.hardlink(pfd, base, path, target, "/".join(target))
            else:  # symlink, fifo
                tree.node(pfd, base, path, e, same_owner)
        if strip_components and not created:
            raise UnsafeLayerError(f"{name}: strip_components {strip_components} leaves "
                                   "nothing of it", hint="lower strip_components (an sdist "
                                   "or a GitHub tarball needs 1)")
        for parts, path, e in pending:
            tree.evict()
            _foreign_overlay_whiteout(tree, parts, path, e, created,
                                      f"{overlay_xattr}.overlay.opaque", same_owner)
        tree.finish_dirs(dir_meta, same_owner)
    except (TarFormatError, Truncated) as err:
        raise CorruptLayerError(f"{name}: not a readable tar: {err}") from None
    except (zlib.error, zstandard.ZstdError, lzma.LZMAError, EOFError) as err:
        raise CorruptLayerError(f"{name}: cannot decompress: {err}") from None
    except UnsafeLayerError as err:
        if err.message.startswith("layer "):  # from _Tree: say which tar, not "layer"
            err.message = err.message.removeprefix("layer ")
        raise
    except OSError as err:
        raise LayerError(f"{name}: unpack into {root}: {err}") from err
    finally:
        tree.close()
        os.close(root_fd)
        if own:
            f.close()


class _NoHash:
    @staticmethod
    def update(_data) -> None:
        pass


def _foreign_whiteout(tree: _Tree, parts: list[str], path: str, created: set[str]) -> None:
    """Apply one OCI whiteout of a foreign layer to what lower layers left (``created`` holds
    this layer's own entries, which no whiteout of it may remove)."""
    base = parts[-1]
    pfd = tree.parent(parts, path, create=False)
    if pfd is None:
        return
    prefix = "/".join(parts[:-1])
    if base == OPAQUE_MARKER:
        _empty_dir(tree, pfd, prefix, keep=created)
    elif base.startswith(".wh..wh."):
        return
    else:
        _check_whiteout_target(tree.name, path, base)
        target = base[4:]
        rel = f"{prefix}/{target}" if prefix else target
        if rel not in created:
            tree.remove(pfd, target, rel)
        else:  # this layer has its own entry there: hide only what lies below it
            try:
                cfd = os.open(target, _DIR, dir_fd=pfd)
            except (NotADirectoryError, FileNotFoundError):
                return
            try:
                _empty_dir(tree, cfd, rel, keep=created)
            finally:
                os.close(cfd)


def _foreign_overlay_whiteout(tree: _Tree, parts: list[str], path: str, e: Entry,
                              created: set[str], opaque_key: str, same_owner: bool) -> None:
    """One OCI whiteout of a foreign layer as an overlayfs whiteout in the layer's own
    directory (``unpack_tar(whiteouts="overlay")``), after the tar's members are written."""
    base = parts[-1]
    if base.startswith(".wh..wh.") and base != OPAQUE_MARKER:
        return  # other aufs metadata: ignored, as containerd does
    pfd = tree.parent(parts, path)
    assert pfd is not None  # create=True: missing parents are made
    if base == OPAQUE_MARKER:
        os.setxattr(pfd, opaque_key, b"y")
        return
    _check_whiteout_target(tree.name, path, base)
    target = base[4:]
    rel = "/".join(parts[:-1] + [target])
    if rel in created:  # this layer's own entry hides the lower one; a directory merges
        if stat.S_ISDIR(os.stat(target, dir_fd=pfd, follow_symlinks=False).st_mode):
            cfd = os.open(target, _DIR, dir_fd=pfd)
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
