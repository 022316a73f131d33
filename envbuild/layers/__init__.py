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

Errors (all ``LayerError``, one line, starting with ``layer NAME:``): ``CorruptLayerError`` for
truncated, tampered or inconsistent blobs, ``UnsupportedFormatError`` for unknown versions,
``UnsafeLayerError`` for members that would escape the destination or are refused by policy.
"""

from typing import TYPE_CHECKING

from envbuild._lazy import lazy_exports

# The names below are imported on first use (PEP 562), so a program that only reads a TOC
# (``envbuild layer ls``) does not import the writer, the unpacker and the verifier: CLI
# start-up, issue 12. Type checkers see ordinary imports.
if TYPE_CHECKING:
    from envbuild.layers._footer import FOOTER_SIZE, FORMAT_VERSION, SKIPPABLE_MAGIC, Footer
    from envbuild.layers._plan import Framing, plan_frames
    from envbuild.layers._reader import LayerReader, ReadStats
    from envbuild.layers._toc import TOC_VERSION, Chunk, Entry, LayerInfo, Toc
    from envbuild.layers._unpack import unpack_layer
    from envbuild.layers._verify import verify_layer
    from envbuild.layers._writer import LayerWriter, pack_tar, pack_tree

_LAZY = {
    "FOOTER_SIZE": "_footer", "FORMAT_VERSION": "_footer", "SKIPPABLE_MAGIC": "_footer",
    "Footer": "_footer",
    "Framing": "_plan", "plan_frames": "_plan",
    "LayerReader": "_reader", "ReadStats": "_reader",
    "TOC_VERSION": "_toc", "Chunk": "_toc", "Entry": "_toc", "LayerInfo": "_toc", "Toc": "_toc",
    "unpack_layer": "_unpack",
    "verify_layer": "_verify",
    "LayerWriter": "_writer", "pack_tar": "_writer", "pack_tree": "_writer",
}

MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
# The descriptor annotation that carries ``LayerInfo.toc_digest`` (one name for writer and
# readers: envbuild.oci).
from envbuild.oci import ANNOTATION_TOC as TOC_DIGEST_ANNOTATION  # noqa: E402

__getattr__, __dir__ = lazy_exports(__name__, {k: f".{v}" for k, v in _LAZY.items()})


__all__ = [
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "MEDIA_TYPE",
    "SKIPPABLE_MAGIC",
    "TOC_DIGEST_ANNOTATION",
    "TOC_VERSION",
    "Chunk",
    "Entry",
    "Footer",
    "Framing",
    "LayerInfo",
    "LayerReader",
    "LayerWriter",
    "ReadStats",
    "Toc",
    "pack_tar",
    "pack_tree",
    "plan_frames",
    "unpack_layer",
    "verify_layer",
]
