"""envbuild.store: content-addressed blobs, refs and key records.

The contract is ``Store`` (``envbuild.store.base``); backends are ``LocalStore`` (a directory,
an OCI image layout) and ``MemoryStore`` (tests); generic logic is in ``envbuild.store.helpers``.
Open one from a ``--store`` / ``ENVBUILD_STORE`` value with ``open_store``.
"""

from __future__ import annotations

from envbuild.errors import SettingsError, StoreUnavailable
from envbuild.store.base import (
    ANY,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_LAYER_ZSTD,
    MEDIA_TYPE_MANIFEST,
    BlobInfo,
    Descriptor,
    RefConflict,
    Store,
    VerifyingReader,
    canonical_json,
    check_digest,
)
from envbuild.store.helpers import (
    KEY_RECORDS,
    KeyRecord,
    copy_blobs,
    digest_bytes,
    digest_file,
    get_json,
    get_key_record,
    put_bytes,
    put_file,
    put_json,
    put_key_record,
    read_bytes,
)
from envbuild.store.local import LocalStore
from envbuild.store.memory import MemoryStore

__all__ = [
    "ANY",
    "BlobInfo",
    "Descriptor",
    "KEY_RECORDS",
    "KeyRecord",
    "LocalStore",
    "MEDIA_TYPE_CONFIG",
    "MEDIA_TYPE_INDEX",
    "MEDIA_TYPE_LAYER_ZSTD",
    "MEDIA_TYPE_MANIFEST",
    "MemoryStore",
    "RefConflict",
    "Store",
    "VerifyingReader",
    "canonical_json",
    "check_digest",
    "copy_blobs",
    "digest_bytes",
    "digest_file",
    "get_json",
    "get_key_record",
    "open_store",
    "put_bytes",
    "put_file",
    "put_json",
    "put_key_record",
    "read_bytes",
]


def open_store(url: str) -> Store:
    """Open the store a ``--store`` / ``ENVBUILD_STORE`` value names.

    * a path (``cache``, ``/srv/envbuild``) → ``LocalStore``, created if missing
    * ``memory://`` → a new, empty ``MemoryStore`` (tests)
    * ``s3://BUCKET/PREFIX`` → ``StoreUnavailable`` until the S3 backend lands

    Anything else with a ``scheme://`` is a ``SettingsError``.
    """
    if not url:
        raise SettingsError("the store location is empty",
                            hint="pass --store DIR or set ENVBUILD_STORE (default: cache)")
    scheme, sep, _ = url.partition("://")
    if not sep:
        return LocalStore(url)
    if scheme == "memory":
        return MemoryStore()
    if scheme == "s3":
        raise StoreUnavailable(f"S3 stores are not supported yet: {url}",
                               hint="use a local directory for now (--store DIR or "
                                    "ENVBUILD_STORE=DIR); S3 support comes with the S3 issue")
    raise SettingsError(f"unknown store URL scheme {scheme!r} in {url!r}",
                        hint="use a directory path, or s3://BUCKET/PREFIX")
