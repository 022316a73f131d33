"""Layers in another compression, for tools that do not read zstd: ``envbuild export`` and
``envbuild push`` with ``--compression gzip|none``.

``zstd`` (the default) copies a lock byte for byte. ``gzip`` and ``none`` re-encode every
layer of the lock's image manifest: the zstd stream is decompressed (envbuild's skippable TOC
and footer frames are skipped by the decoder), the tar is checked against the config's
``rootfs.diff_ids`` entry for the layer, and written as gzip or as the plain tar. Gzip is
deterministic (``zlib`` level 6 with a fixed header: mtime 0, no file name), so the same lock
re-encodes to the same digests every time and a second push uploads nothing. The config is
unchanged (``diff_ids`` are digests of the tar, which did not change); the manifest gets the
new layer digests, sizes and media types (``…tar+gzip`` / ``…tar``) and loses the
``org.envbuild.toc.digest`` annotations, since a gzip or plain layer has no TOC: envbuild
reads such layers only by full unpack, never lazily. This is what Debian's docker 20.10
(``docker pull``, ``FROM``) and umoci 0.4.7 need.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from envbuild.errors import DigestMismatch, SettingsError, StoreError
from envbuild.oci import (
    ANNOTATION_TOC,
    MEDIA_TYPE_LAYER,
    MEDIA_TYPE_LAYER_GZIP,
    MEDIA_TYPE_LAYER_ZSTD,
    MEDIA_TYPE_MANIFEST,
)

COMPRESSIONS = ("zstd", "gzip", "none")
#: The layer media type of each compression.
LAYER_TYPES = {"zstd": MEDIA_TYPE_LAYER_ZSTD, "gzip": MEDIA_TYPE_LAYER_GZIP,
               "none": MEDIA_TYPE_LAYER}
_CHUNK = 1 << 20


def check_compression(value: str) -> str:
    """``value`` if it is one of ``COMPRESSIONS``; a one-line ``SettingsError`` otherwise."""
    if value not in COMPRESSIONS:
        raise SettingsError(f"unknown compression {value!r}",
                            hint="use one of " + ", ".join(COMPRESSIONS))
    return value


def lock_parts(manifest: Mapping[str, Any], config: Mapping[str, Any],
               what: str) -> list[tuple[dict[str, Any], str]]:
    """The ``(layer descriptor, diff_id)`` pairs of an image manifest and its config;
    ``StoreError`` if they do not pair up."""
    diff_ids = list((config.get("rootfs") or {}).get("diff_ids") or [])
    layers = list(manifest.get("layers") or [])
    if len(diff_ids) != len(layers):
        raise StoreError(f"lock {what}: {len(layers)} layers but {len(diff_ids)} "
                         "rootfs.diff_ids in its config", hint="the lock is corrupt; rebuild it")
    return list(zip(layers, diff_ids))


def reencode(src: BinaryIO, compression: str, diff_id: str, digest: str) -> Iterator[bytes]:
    """The layer's tar (``src``: a zstd layer), checked against ``diff_id``, as gzip or as is
    (``compression``: ``gzip`` or ``none``)."""
    import zstandard

    h = hashlib.sha256()
    gz = zlib.compressobj(6, zlib.DEFLATED, 31) if compression == "gzip" else None
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(src, read_across_frames=True)
        while True:
            data = reader.read(_CHUNK)
            if not data:
                break
            h.update(data)
            out = gz.compress(data) if gz else data
            if out:
                yield out
    except zstandard.ZstdError as e:
        raise StoreError(f"layer {digest}: cannot decompress: {e}",
                         hint="only zstd layers can be re-encoded") from None
    if "sha256:" + h.hexdigest() != diff_id:
        raise DigestMismatch(f"layer {digest}: its tar hashes to sha256:{h.hexdigest()}, not "
                             f"its config's diff_id {diff_id}", hint="the lock is corrupt")
    if gz:
        yield gz.flush()


def reencoded_descriptor(layer: Mapping[str, Any], compression: str, digest: str,
                         size: int) -> dict[str, Any]:
    """``layer``'s descriptor for its re-encoded blob: new media type, digest and size, and
    no TOC annotation (the other annotations stay)."""
    new = {**layer, "mediaType": LAYER_TYPES[compression], "digest": digest, "size": size}
    ann = {k: v for k, v in (layer.get("annotations") or {}).items() if k != ANNOTATION_TOC}
    new.pop("annotations", None)
    if ann:
        new["annotations"] = ann
    return new


def manifest_bytes(manifest: Mapping[str, Any], layers: list[dict[str, Any]]) -> bytes:
    """The manifest with ``layers`` in place of its own, as deterministic JSON."""
    return json.dumps({**manifest, "layers": layers}, sort_keys=True,
                      separators=(",", ":")).encode()


def spool(chunks: Iterator[bytes]) -> tuple[BinaryIO, str, int]:
    """``chunks`` written to an anonymous temporary file: ``(file at offset 0, digest,
    size)``, so a re-encoded layer can be put with its digest known first."""
    f = tempfile.TemporaryFile(prefix="envbuild-layer-")
    h, size = hashlib.sha256(), 0
    try:
        for chunk in chunks:
            h.update(chunk)
            f.write(chunk)
            size += len(chunk)
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f, "sha256:" + h.hexdigest(), size


def require_image_manifest(media_type: str, ref: str, verb: str) -> None:
    if media_type != MEDIA_TYPE_MANIFEST:
        raise StoreError(f"{ref} is a {media_type}, not an image manifest",
                         hint=f"{verb} re-encodes env locks (env/NAME) only; use "
                              "--compression zstd for anything else")
