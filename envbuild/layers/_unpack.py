"""Unpack an envbuild layer into a directory: safely and fast.

**One safe unpacker** for every tar that reaches a build host's disk: envbuild layers
(``unpack_layer``, here) and foreign tars (``unpack_tar`` in ``_untar``: ``rootfs`` tarballs,
OCI image layers, workspace archives and git archives). Both write through ``SafeTree``
(``_safetree``), which never follows a symlink, and check names with ``_names``: relative,
no ``.``/``..`` components; a hardlink points to a regular file extracted earlier from the
same layer; device nodes are refused with ``allow_devices=False`` (the node cache).

For layers the verified TOC is authoritative: members, metadata and each file's offset come
from it, the contents from the frames, each checked against its TOC digest. Every member's tar
header must agree with its TOC entry (``docs/layer-format.md``): the header bytes are compared
with the TOC entry's canonical encoding, and only when they differ parsed and compared field
by field; a disagreement is ``CorruptLayerError``.
"""

from __future__ import annotations

import hashlib
import os
import stat
from itertools import chain

from envbuild.errors import CorruptLayerError, LayerError, UnsafeLayerError
from envbuild.layers._names import WHITEOUT_PREFIX, check_member_name
from envbuild.layers._safetree import (
    FD_CACHE,
    SPARSE_MIN,
    SafeTree,
    apply_meta,
    open_root,
    write_data,
)
from envbuild.layers._stream import TarStream, Truncated, read_pax_header, skip_pad
from envbuild.layers._tar import (
    BLOCK,
    ZERO_BLOCK,
    TarFormatError,
    encode_header,
    make_entry,
    parse_ustar,
)
from envbuild.layers._toc import Entry

# Old import paths of names the split moved out (issue 38); new code imports them from
# ``envbuild.layers``. runtime_shim.node.nodecache and envbuild.build still use ``unpack_tar`` here.
from envbuild.layers._untar import MAX_STRIP_COMPONENTS as MAX_STRIP_COMPONENTS
from envbuild.layers._untar import unpack_tar as unpack_tar
from envbuild.layers._whiteouts import apply_whiteouts, overlay_whiteout

WHITEOUT_MODES = ("apply", "overlay", "keep")


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
    root_fd, root = open_root(dest)
    tree = SafeTree(root_fd, name)
    mask = 0o7777 & ~(stat.S_ISUID | stat.S_ISGID) if strip_setid else 0o7777
    job = _LayerUnpack(tree, whiteouts, same_owner, mask, f"{overlay_xattr}.overlay.opaque")
    frames = reader.iter_frames()
    try:
        if whiteouts == "apply":
            apply_whiteouts(toc, tree, name)
        job.run(toc, TarStream(frames))
        frames.close()
        tree.finish_dirs(job.dir_meta, same_owner)
    except (TarFormatError, Truncated) as err:
        raise CorruptLayerError(f"layer {name}: tar stream: {err}") from None
    except OSError as err:
        raise LayerError(f"layer {name}: unpack into {root}: {err}") from err
    finally:
        frames.close()
        tree.close()
        os.close(root_fd)


class _LayerUnpack:
    """One ``unpack_layer``: the TOC's members, in tar order, onto ``tree``."""

    def __init__(self, tree: SafeTree, whiteouts: str, same_owner: bool, mask: int,
                 opaque_key: str) -> None:
        self.tree, self.name = tree, tree.name
        self.whiteouts, self.same_owner, self.mask = whiteouts, same_owner, mask
        self.opaque_key = opaque_key
        self.dir_meta: list[tuple[str, Entry]] = []

    def run(self, toc: list[Entry], stream: TarStream) -> None:
        tree, name = self.tree, self.name
        fds, root_fd = tree.fds, tree.root_fd
        for i, e in enumerate(toc):
            if len(fds) > FD_CACHE:
                tree.evict()
            stream = _check_header(stream, e, i, name)
            path = e.path
            parts = check_member_name(name, path)
            # the parent's fd straight from the cache in the common case (no join, no call)
            pfd = fds.get(path.rpartition("/")[0]) if len(parts) > 1 else root_fd
            if pfd is None:
                pfd = tree.parent_made(parts, path)
            kind = e.type
            if kind == "file":
                self.file(stream, pfd, parts, e)
            elif kind == "dir":
                tree.mkdir(pfd, parts[-1], path)
                self.dir_meta.append((path, e))
            elif kind == "hardlink":
                self.hardlink(pfd, parts, e)
            else:  # symlink, char, block, fifo
                tree.node(pfd, parts[-1], path, e, self.same_owner, self.mask)

    def file(self, stream: TarStream, pfd: int, parts: list[str], e: Entry) -> None:
        """A regular file, its contents checked against its TOC digest (or a whiteout)."""
        path, base, name = e.path, parts[-1], self.name
        if e.size:
            c = e.chunks[0] if e.chunks else None
            if c is None or c.uoffset + c.inner != stream.offset:
                raise CorruptLayerError(f"layer {name}: chunks of {path} do not start "
                                        "where its tar header ends")
        if base.startswith(WHITEOUT_PREFIX) and self.whiteouts != "keep":
            if stream.skip(e.size) != e.size:
                raise Truncated("tar stream ends inside member data")
            skip_pad(stream, e.size)
            if self.whiteouts == "overlay":
                overlay_whiteout(self.tree, pfd, parts, path, e, self.opaque_key,
                                 self.same_owner)
            return
        fd = self.tree.create_file(pfd, base, path)
        try:
            h = hashlib.sha256()
            got = write_data(fd, stream.pieces(e.size), e.size >= SPARSE_MIN, h)
            if got != e.size:
                raise Truncated("tar stream ends inside member data")
            if "sha256:" + h.hexdigest() != e.digest:
                raise CorruptLayerError(f"layer {name}: content of {path} does not "
                                        "match its TOC digest")
            apply_meta(fd, e, self.same_owner, name, path, self.mask)
        finally:
            os.close(fd)
        skip_pad(stream, e.size)
        self.tree.files.add(path)

    def hardlink(self, pfd: int, parts: list[str], e: Entry) -> None:
        """A hardlink to a regular file extracted earlier from this layer."""
        target = check_member_name(self.name, e.linkname, "hardlink target")
        if e.linkname not in self.tree.files:
            raise UnsafeLayerError(f"layer {self.name}: hardlink {e.path!r} points to "
                                   f"{e.linkname!r}, which is not a regular file "
                                   "earlier in this layer")
        self.tree.hardlink(pfd, parts[-1], e.path, target, e.linkname)


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
