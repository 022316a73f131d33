"""Layer blobs (format v1): deterministic PAX tar, zstd in independent frames, TOC, footer.

A layer is an ordinary ``application/vnd.oci.image.layer.v1.tar+zstd`` blob (``zstd -dc | tar
-x`` reads it) that also carries a table of contents in a zstd skippable frame and a fixed-size
footer, so a reader can list it and read one file by fetching only that file's frames. The
byte-level specification is ``docs/layer-format.md``; the TOC contract is documented in
``envbuild.layers._toc``.

Writing::

    with open(tmp, "wb") as out:
        info = pack_tree(src_dir, out, framing="lazy", source_date_epoch=0,
                         overlay_upper=False, allow_devices=True)
    info.digest, info.diff_id, info.size, info.uncompressed_size, info.toc_digest

    pack_tar(tar_stream, out)           # re-frame an existing tar (imports, tests)
    LayerWriter(out).add(entry, src)    # member by member, for producers that are not a tree

``framing="lazy"`` (default) gives files of 16 KiB and more frames of their own (<= 4 MiB
each) and groups headers and smaller files into shared frames of ~256 KiB; ``"compact"`` cuts
~4 MiB frames for layers that are always pulled whole. Both are read the same way.

Reading::

    with LayerReader.open_file(path) as r:                 # local blob
        ...
    r = LayerReader(get_range, size, name=digest,          # any ranged source (store, S3)
                    expected_toc_digest=annotation)        # or get_tail=... instead of size
    r.entries()            # [Entry] in tar order (path, type, mode, uid, gid, size, mtime,
                           #  linkname, xattrs, devmajor, devminor, digest, chunks)
    r.stat("usr/bin/python3")
    r.read("etc/os-release")                # bytes; only that file's frames, digest-checked
    r.unpack(dest, whiteouts="apply")       # or "overlay" (overlayfs lower dir) or "keep"
    verify_layer(r, expected_digest=...)    # full check; returns LayerInfo
    r.stats                                 # ranges / bytes fetched, frames decompressed

Front ends (the ``envbuild layer`` commands) name a layer by a file or a store digest and get
errors that carry hints::

    with open_layer("sha256:3f2a9c81d0e4", get_store, where=url) as r:   # or a path
        read_member(r, "etc/os-release"); unpack_into(r, dest); verify_reader(r)
        layer_summary(r); [long_line(e) for e in r.entries()]
    pack_layer(src_dir, output="layer.tar.zst", store=store)   # atomic file, store, or both

Foreign tars (rootfs tarballs, OCI layers, archives; any compression) go through the same safe
unpacker: ``unpack_tar(path_or_file, dest, name="rootfs base.tar.gz", whiteouts="apply")``.

A store is passed in, never imported: ``envbuild.store`` stands on this package, so these
functions use only the ``Store`` methods they name (``list``, ``stat``, ``get_range``, ``put``).

Errors (all ``LayerError``, one line, starting with ``layer NAME:``): ``CorruptLayerError`` for
truncated, tampered or inconsistent blobs, ``UnsupportedFormatError`` for unknown versions,
``UnsafeLayerError`` for members that would escape the destination or are refused by policy.
The format modules' own errors (``FooterError``, ``TocFormatError``, ``TocVersionError``,
``FrameError``) are exported for the readers outside this package that parse those parts.

Everything public is in ``__all__`` (``tests/unit/test_layers_api.py`` keeps it sorted and
complete, and keeps other packages off the private modules).
"""

from typing import TYPE_CHECKING

from envbuild._lazy import lazy_exports

# The names below are imported on first use (PEP 562), so a program that only reads a TOC
# (``envbuild layer ls``) does not import the writer, the unpacker and the verifier: CLI
# start-up, issue 12. Type checkers see ordinary imports.
if TYPE_CHECKING:
    from envbuild.layers._describe import (
        display_path,
        entry_json,
        human_size,
        layer_summary,
        long_line,
        mode_string,
    )
    from envbuild.layers._footer import (
        FOOTER_MAGIC,
        FOOTER_SIZE,
        FORMAT_VERSION,
        SKIPPABLE_MAGIC,
        Footer,
        FooterError,
    )
    from envbuild.layers._names import OPAQUE_MARKER, WHITEOUT_PREFIX
    from envbuild.layers._ops import (
        iter_member,
        member_entry,
        read_member,
        unpack_into,
        verify_reader,
    )
    from envbuild.layers._pack import pack_layer, pack_to_file, pack_to_store, put_packed
    from envbuild.layers._plan import Framing, plan_frames
    from envbuild.layers._reader import MAX_FRAME_USIZE, LayerReader, ReadStats
    from envbuild.layers._refs import (
        MIN_DIGEST_PREFIX,
        REF_HELP,
        add_hints,
        default_hint,
        locate_layer,
        open_layer,
        resolve_digest,
    )
    from envbuild.layers._stream import TarStream, iter_members
    from envbuild.layers._toc import (
        TOC_VERSION,
        Chunk,
        Entry,
        LayerInfo,
        Toc,
        TocFormatError,
        TocVersionError,
    )
    from envbuild.layers._unpack import WHITEOUT_MODES, unpack_layer
    from envbuild.layers._untar import MAX_STRIP_COMPONENTS, TAR_WHITEOUT_MODES, unpack_tar
    from envbuild.layers._verify import verify_layer
    from envbuild.layers._walk import walk_tree
    from envbuild.layers._writer import LayerWriter, pack_tar, pack_tree
    from envbuild.layers._zstd import FrameError, decompress_frame, frame_size

_LAZY = {
    "display_path": "_describe", "entry_json": "_describe", "human_size": "_describe",
    "layer_summary": "_describe", "long_line": "_describe", "mode_string": "_describe",
    "FOOTER_MAGIC": "_footer", "FOOTER_SIZE": "_footer", "FORMAT_VERSION": "_footer",
    "SKIPPABLE_MAGIC": "_footer", "Footer": "_footer", "FooterError": "_footer",
    "OPAQUE_MARKER": "_names", "WHITEOUT_PREFIX": "_names",
    "iter_member": "_ops", "member_entry": "_ops", "read_member": "_ops",
    "unpack_into": "_ops", "verify_reader": "_ops",
    "pack_layer": "_pack", "pack_to_file": "_pack", "pack_to_store": "_pack",
    "put_packed": "_pack",
    "Framing": "_plan", "plan_frames": "_plan",
    "MAX_FRAME_USIZE": "_reader", "LayerReader": "_reader", "ReadStats": "_reader",
    "MIN_DIGEST_PREFIX": "_refs", "REF_HELP": "_refs", "add_hints": "_refs",
    "default_hint": "_refs", "locate_layer": "_refs", "open_layer": "_refs",
    "resolve_digest": "_refs",
    "TarStream": "_stream", "iter_members": "_stream",
    "TOC_VERSION": "_toc", "Chunk": "_toc", "Entry": "_toc", "LayerInfo": "_toc", "Toc": "_toc",
    "TocFormatError": "_toc", "TocVersionError": "_toc",
    "WHITEOUT_MODES": "_unpack", "unpack_layer": "_unpack",
    "MAX_STRIP_COMPONENTS": "_untar", "TAR_WHITEOUT_MODES": "_untar", "unpack_tar": "_untar",
    "verify_layer": "_verify",
    "walk_tree": "_walk",
    "LayerWriter": "_writer", "pack_tar": "_writer", "pack_tree": "_writer",
    "FrameError": "_zstd", "decompress_frame": "_zstd", "frame_size": "_zstd",
}

MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
# The descriptor annotation that carries ``LayerInfo.toc_digest`` (one name for writer and
# readers: envbuild.oci).
from envbuild.oci import ANNOTATION_TOC as TOC_DIGEST_ANNOTATION  # noqa: E402

__getattr__, __dir__ = lazy_exports(__name__, {k: f".{v}" for k, v in _LAZY.items()})


__all__ = [
    "FOOTER_MAGIC",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "MAX_FRAME_USIZE",
    "MAX_STRIP_COMPONENTS",
    "MEDIA_TYPE",
    "MIN_DIGEST_PREFIX",
    "OPAQUE_MARKER",
    "REF_HELP",
    "SKIPPABLE_MAGIC",
    "TAR_WHITEOUT_MODES",
    "TOC_DIGEST_ANNOTATION",
    "TOC_VERSION",
    "WHITEOUT_MODES",
    "WHITEOUT_PREFIX",
    "Chunk",
    "Entry",
    "Footer",
    "FooterError",
    "FrameError",
    "Framing",
    "LayerInfo",
    "LayerReader",
    "LayerWriter",
    "ReadStats",
    "TarStream",
    "Toc",
    "TocFormatError",
    "TocVersionError",
    "add_hints",
    "decompress_frame",
    "default_hint",
    "display_path",
    "entry_json",
    "frame_size",
    "human_size",
    "iter_member",
    "iter_members",
    "layer_summary",
    "locate_layer",
    "long_line",
    "member_entry",
    "mode_string",
    "open_layer",
    "pack_layer",
    "pack_tar",
    "pack_to_file",
    "pack_to_store",
    "pack_tree",
    "plan_frames",
    "put_packed",
    "read_member",
    "resolve_digest",
    "unpack_into",
    "unpack_layer",
    "unpack_tar",
    "verify_layer",
    "verify_reader",
    "walk_tree",
]
