"""Unpack a foreign tar — a ``rootfs`` tarball, an OCI image layer, a workspace or git archive
(plain, gzip, zstd, xz or bzip2) — into a directory, with the same safety rules as envbuild's
own layers (``_unpack``): every write goes through ``SafeTree``, which never follows a symlink.

Names are relative without ``..`` components (a leading ``/`` or ``./`` is dropped, as GNU tar
does); a hardlink points to a regular file already in the tree; device nodes are always
refused (runc provides ``/dev``); ``trusted.overlay.*``/``user.overlay.*`` xattrs are refused
(overlayfs would act on them). GNU long names, PAX and global headers are folded in; GNU sparse
and multi-volume members are refused.
"""

from __future__ import annotations

import bz2
import contextlib
import lzma
import os
import zlib
from collections.abc import Iterator

import zstandard

from envbuild.errors import CorruptLayerError, LayerError, UnsafeLayerError
from envbuild.layers._names import WHITEOUT_PREFIX, foreign_member_name
from envbuild.layers._safetree import SPARSE_MIN, NoHash, SafeTree, open_root, set_xattr, write_data
from envbuild.layers._stream import TarStream, Truncated, skip_pad
from envbuild.layers._tar import (
    BLOCK,
    GNU_LONG_LINK,
    GNU_LONG_NAME,
    MAX_GNU_LONG,
    MAX_PAX_HEADER,
    ZERO_BLOCK,
    TarFormatError,
    foreign_pax,
    make_foreign_entry,
    parse_foreign_header,
    parse_pax,
)
from envbuild.layers._toc import Entry
from envbuild.layers._whiteouts import foreign_overlay_whiteout, foreign_whiteout

TAR_WHITEOUT_MODES = ("apply", "overlay", "refuse")
#: Deepest ``strip_components`` accepted (the schema's bound too): no real archive nests its
#: files more than a few directories down, and a bound keeps a typo from emptying a tree.
MAX_STRIP_COMPONENTS = 16
_READ = 1 << 20
_REFUSED_XATTRS = ("trusted.overlay.", "user.overlay.")


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
    root_fd, root = open_root(dest)
    job = _TarUnpack(SafeTree(root_fd, name), whiteouts, same_owner, strip_components,
                     f"{overlay_xattr}.overlay.opaque")
    try:
        with _tar_errors(name, root):
            job.run(TarStream(_decompressed(f, name)))
    finally:
        job.tree.close()
        os.close(root_fd)
        if own:
            f.close()


@contextlib.contextmanager
def _tar_errors(name: str, root: str) -> Iterator[None]:
    """The errors of unpacking foreign tar ``name`` into ``root`` as one line each."""
    try:
        yield
    except (TarFormatError, Truncated) as err:
        raise CorruptLayerError(f"{name}: not a readable tar: {err}") from None
    except (zlib.error, zstandard.ZstdError, lzma.LZMAError, EOFError) as err:
        raise CorruptLayerError(f"{name}: cannot decompress: {err}") from None
    except UnsafeLayerError as err:
        if err.message.startswith("layer "):  # from SafeTree: say which tar, not "layer"
            err.message = err.message.removeprefix("layer ")
        raise
    except OSError as err:
        raise LayerError(f"{name}: unpack into {root}: {err}") from err


class _TarUnpack:
    """One ``unpack_tar``: the tar's members, one by one, onto ``tree``."""

    def __init__(self, tree: SafeTree, whiteouts: str, same_owner: bool, strip: int,
                 opaque_key: str) -> None:
        self.tree, self.name = tree, tree.name
        self.whiteouts, self.same_owner, self.strip = whiteouts, same_owner, strip
        self.opaque_key = opaque_key
        self.created: set[str] = set()   # what this tar wrote (and the parents it implied)
        self.dir_meta: list[tuple[str, Entry]] = []
        self.pending: list[tuple[list[str], str, Entry]] = []  # overlay whiteouts, made last

    def run(self, stream: TarStream) -> None:
        tree = self.tree
        for e, size in iter_foreign_members(stream, self.name):
            tree.evict()
            parts = self.member_parts(e)
            if parts:  # [] is the root itself ("./", dest keeps its own metadata) or stripped
                self.member(stream, e, size, parts)
        if self.strip and not self.created:
            raise UnsafeLayerError(f"{self.name}: strip_components {self.strip} leaves "
                                   "nothing of it", hint="lower strip_components (an sdist "
                                   "or a GitHub tarball needs 1)")
        for parts, path, e in self.pending:
            tree.evict()
            foreign_overlay_whiteout(tree, parts, path, e, self.created, self.opaque_key,
                                     self.same_owner)
        tree.finish_dirs(self.dir_meta, self.same_owner)

    def member_parts(self, e: Entry) -> list[str]:
        """The components of ``e``'s name once ``strip_components`` are dropped; [] to skip."""
        parts = foreign_member_name(self.name, e.path)
        if not self.strip:
            return parts
        if len(parts) <= self.strip:
            if e.type == "dir" or not parts:
                return []  # a stripped top directory
            raise UnsafeLayerError(
                f"{self.name}: strip_components {self.strip} leaves nothing of "
                f"{e.type} {e.path!r}",
                hint="lower strip_components, or repack the archive with every file "
                     "under its top directory")
        return parts[self.strip:]

    def member(self, stream: TarStream, e: Entry, size: int, parts: list[str]) -> None:
        path = "/".join(parts)
        base = parts[-1]
        if base.startswith(WHITEOUT_PREFIX):
            if self.whiteouts == "refuse":
                raise UnsafeLayerError(f"{self.name}: member {path!r} is a whiteout; only OCI "
                                       "image layers may hold whiteouts")
            if self.whiteouts == "overlay":
                self.pending.append((parts, path, e))
            else:
                foreign_whiteout(self.tree, parts, path, self.created)
            return
        self.refuse(e, path)
        pfd = self.tree.parent_made(parts, path)
        self.note_created(path)
        if e.type == "file":
            self.file(stream, pfd, base, path, e, size)
        elif e.type == "dir":
            self.tree.mkdir(pfd, base, path)
            self.dir_meta.append((path, e))
        elif e.type == "hardlink":
            self.hardlink(pfd, base, path, e)
        else:  # symlink, fifo
            self.tree.node(pfd, base, path, e, self.same_owner)

    def refuse(self, e: Entry, path: str) -> None:
        """``UnsafeLayerError`` for overlay xattrs and device nodes."""
        for k in e.xattrs:
            if k.startswith(_REFUSED_XATTRS):
                raise UnsafeLayerError(f"{self.name}: member {path!r} carries the xattr {k!r}, "
                                       "refused (overlayfs would act on it)")
        if e.type in ("char", "block"):
            raise UnsafeLayerError(
                f"{self.name}: member {path!r} is a {e.type} device node, refused",
                hint="device nodes never enter a layer (runc provides /dev); rebuild the "
                     "tarball without them, e.g. tar --exclude='./dev/*'")

    def note_created(self, path: str) -> None:
        """``path`` and the parents it implied, stopping at a known one."""
        self.created.add(path)
        up = path.rpartition("/")[0]
        while up and up not in self.created:
            self.created.add(up)
            up = up.rpartition("/")[0]

    def file(self, stream: TarStream, pfd: int, base: str, path: str, e: Entry,
             size: int) -> None:
        fd = self.tree.create_file(pfd, base, path)
        try:
            got = write_data(fd, stream.pieces(size), size >= SPARSE_MIN, NoHash)
            if got != size:
                raise Truncated("tar stream ends inside member data")
            if self.same_owner:
                os.fchown(fd, e.uid, e.gid)
            os.fchmod(fd, e.mode)
            for k, v in e.xattrs.items():
                set_xattr(fd, k, v, self.name, path, drop_unsupported=True)
            os.utime(fd, (e.mtime, e.mtime))
        finally:
            os.close(fd)

    def hardlink(self, pfd: int, base: str, path: str, e: Entry) -> None:
        target = foreign_member_name(self.name, e.linkname, "hardlink target")
        if self.strip:
            if len(target) <= self.strip:
                raise UnsafeLayerError(
                    f"{self.name}: hardlink {e.path!r} points to {e.linkname!r}, which "
                    f"strip_components {self.strip} removes")
            target = target[self.strip:]
        if not target:
            raise UnsafeLayerError(f"{self.name}: hardlink {path!r} points to the root")
        self.tree.hardlink(pfd, base, path, target, "/".join(target))


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
        # zstandard needs only read(); its stubs ask for an IO[bytes]
        reader = zstandard.ZstdDecompressor().stream_reader(
            chain_reader(head, f), read_across_frames=True)  # type: ignore[arg-type]
        while chunk := reader.read(_READ):
            yield chunk
    elif head.startswith((b"\xfd7zXZ\x00", b"BZh")):
        xdec = lzma.LZMADecompressor() if head[0] == 0xFD else bz2.BZ2Decompressor()
        data = head
        while data:
            out = xdec.decompress(data)
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


def iter_foreign_members(stream: TarStream, name: str) -> Iterator[tuple[Entry, int]]:  # noqa: C901  one header state machine (PAX, GNU long names, globals): its states share the pending values
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
        skip_pad(stream, size)
