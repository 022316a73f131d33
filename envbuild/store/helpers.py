"""Generic store logic, written once on top of the ``Store`` interface (any backend).

* ``digest_bytes`` / ``digest_file``    — the sha256 digest of bytes or a file
* ``put_bytes`` / ``put_file``          — store and return the digest (file: streamed, two passes)
* ``read_bytes``                        — a whole blob, verified
* ``put_json`` / ``get_json``           — canonical JSON blobs (manifests, configs, TOCs)
* ``copy_blobs``                        — copy the blobs another store lacks (push / pull)
* ``KeyRecord``, ``put_key_record``, ``get_key_record`` — the ``keys/v1/<key-hex>`` records
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

from envbuild.canonical import MAX_JSON_BYTES, load_json
from envbuild.errors import StoreError
from envbuild.store.base import (
    CHUNK_SIZE,
    MEDIA_TYPE_MANIFEST,
    SMALL_BLOB,
    BlobInfo,
    BlobMounter,
    Descriptor,
    Store,
    canonical_json,
    check_digest,
)
from envbuild.store.progress import TransferMeter, track

#: Namespace of key records: layer key -> the layer it produced.
KEY_RECORDS = "keys/v1"

#: ``get_json`` refuses blobs larger than this: JSON documents are small, layers are not.
MAX_JSON_SIZE = MAX_JSON_BYTES


def digest_bytes(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def digest_file(path: str | os.PathLike[str]) -> BlobInfo:
    """Digest and size of a file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            h.update(chunk)
            size += len(chunk)
    return BlobInfo("sha256:" + h.hexdigest(), size)


def put_bytes(store: Store, data: bytes) -> str:
    """Store ``data`` and return its digest."""
    digest = digest_bytes(data)
    store.put(digest, data, size=len(data))
    return digest


def put_file(store: Store, path: str | os.PathLike[str]) -> BlobInfo:
    """Store a file's content, streamed; returns its digest and size.

    The file is read twice (hash, then upload) unless the blob is already stored; if the file
    changes in between, ``put`` refuses it with ``DigestMismatch``.
    """
    info = digest_file(path)
    # small: no look first (a store's put of a stored blob is a no-op; on S3 one conditional
    # PUT instead of a HEAD, then the put's own HEAD, then the PUT)
    if info.size <= SMALL_BLOB or not store.exists(info.digest):
        with open(path, "rb") as f:
            store.put(info.digest, f, size=info.size)
    return info


def read_bytes(store: Store, digest: str) -> bytes:
    """The whole blob, verified against its digest (``DigestMismatch`` if corrupt)."""
    with store.get(digest) as f:
        return f.read()


def put_json(store: Store, obj: Any, *, media_type: str = MEDIA_TYPE_MANIFEST,
             annotations: Mapping[str, str] | None = None) -> Descriptor:
    """Store ``obj`` as a canonical JSON blob; returns its descriptor (for a manifest or ref).

    Canonical (sorted keys, compact, ASCII) so the same document always has the same digest.
    """
    data = canonical_json(obj)
    return Descriptor(media_type, put_bytes(store, data), len(data), dict(annotations or {}))


def get_json(store: Store, digest: str, *, max_size: int = MAX_JSON_SIZE) -> Any:
    """Parse a JSON blob, verified; ``StoreError`` if it is larger than ``max_size``, nested
    too deeply or not JSON."""
    size = store.stat(digest).size
    if size > max_size:
        raise StoreError(f"blob {digest} is {size} bytes, too large for a JSON document",
                         hint="is this a layer digest where a manifest was expected?")
    try:
        return load_json(read_bytes(store, digest), max_bytes=max_size)
    except ValueError as e:
        raise StoreError(f"parse JSON blob {digest}: {e}",
                         hint="is this a layer digest where a manifest was expected?") from e


def copy_blobs(src: Store, dst: Store, digests: Iterable[str],
               meter: TransferMeter | None = None) -> list[str]:
    """Copy each blob ``dst`` lacks from ``src``, streamed; returns the digests copied.

    ``dst.put`` verifies each blob as it arrives, so a corrupt source copy raises
    ``DigestMismatch`` and is not stored. Duplicates in ``digests`` are copied once. A ``dst``
    that can mount blobs from ``src`` (``BlobMounter``: two repositories of one registry)
    mounts them instead; they count as copied. ``meter`` counts the bytes read from ``src``
    (a mounted blob counts whole).
    """
    copied: list[str] = []
    mounter = dst if isinstance(dst, BlobMounter) else None
    for digest in dict.fromkeys(digests):
        if dst.exists(digest):
            continue
        if mounter is not None and mounter.mount(digest, src):
            copied.append(digest)
            if meter is not None:
                meter.add(src.stat(digest).size)
            continue
        size = src.stat(digest).size
        with src.get(digest) as f:
            dst.put(digest, track(meter, f), size=size)
        copied.append(digest)
    return copied


#: Namespace of the records kept beside a layer blob, named by its digest's hex: its import
#: index (``runtime_shim.lazyfs.pyindex``). Copied with the blob (``copy_layer_records``).
PYIMPORT_RECORDS = "lazy-pyimports"
LAYER_RECORDS = (PYIMPORT_RECORDS,)


def copy_layer_records(src: Store, dst: Store, digests: Iterable[str]) -> int:
    """Copy the records kept beside layer blobs (``LAYER_RECORDS``) of ``digests`` that
    ``dst`` lacks; returns how many were copied. They are hints (a lazy sandbox's import
    prediction), so a blob that is not a layer simply has none."""
    copied = 0
    for digest in dict.fromkeys(digests):
        name = check_digest(digest)
        for ns in LAYER_RECORDS:
            if dst.get_record(ns, name) is not None:
                continue
            rec = src.get_record(ns, name)
            if rec is not None:
                dst.put_record(ns, name, rec)
                copied += 1
    return copied


@dataclasses.dataclass(frozen=True)
class KeyRecord:
    """What a layer key produced: the record at ``keys/v1/<key-hex>``.

    ``layer`` is the blob digest of the compressed layer, ``size`` its size in bytes, ``toc``
    the digest of its table of contents, ``diff_id`` the sha256 of the uncompressed tar (OCI
    ``rootfs.diff_ids``), ``built_from`` what the build ran on (for ``envbuild explain``; not
    part of any key). ``extra`` keeps fields written by newer envbuilds so a rewrite does not
    drop them.
    """

    layer: str
    toc: str
    diff_id: str
    size: int
    built_from: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    _FIELDS = ("layer", "toc", "diff_id", "size", "built_from")

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "layer": self.layer, "toc": self.toc, "diff_id": self.diff_id,
                "size": self.size, "built_from": dict(self.built_from)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, where: str = "key record") -> KeyRecord:
        """Parse a stored record; ``StoreError`` naming ``where`` when a field is missing/bad."""
        missing = [f for f in ("layer", "toc", "diff_id", "size") if f not in obj]
        if missing:
            raise StoreError(f"{where} lacks {', '.join(missing)}",
                             hint="delete the record; the layer will be rebuilt")
        for f in ("layer", "toc", "diff_id"):
            check_digest(obj[f])
        size, built_from = obj["size"], obj.get("built_from") or {}
        if not isinstance(size, int) or size < 0 or not isinstance(built_from, dict):
            raise StoreError(f"{where} has a bad size or built_from",
                             hint="delete the record; the layer will be rebuilt")
        extra = {k: v for k, v in obj.items() if k not in cls._FIELDS}
        return cls(obj["layer"], obj["toc"], obj["diff_id"], size, built_from, extra)


def put_key_record(store: Store, key: str, record: KeyRecord) -> None:
    """Record that layer key ``key`` (``sha256:<hex>``) produced ``record``; last writer wins."""
    store.put_record(KEY_RECORDS, check_digest(key), record.to_json())


def get_key_record(store: Store, key: str) -> KeyRecord | None:
    """The record for layer key ``key`` (``sha256:<hex>``), or ``None`` if never built."""
    hex_key = check_digest(key)
    obj = store.get_record(KEY_RECORDS, hex_key)
    return None if obj is None else KeyRecord.from_json(obj, where=f"{KEY_RECORDS}/{hex_key}")
