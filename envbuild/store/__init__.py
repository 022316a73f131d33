"""envbuild.store: content-addressed blobs, refs and key records.

The contract is ``Store`` (``envbuild.store.base``), with optional capabilities as small
protocols beside it (``RangeReader``, ``TailReader``, ``LocalBlobPaths``, ``Locatable``,
``Presigner``, ``BlobMounter``, ``ConditionalRecords``; ``capabilities(store)`` lists what a
backend declares);
backends are ``LocalStore`` (a directory, an OCI image layout), ``S3Store``
(``envbuild.store.s3``, imported on demand: it needs boto3), ``RegistryStore``
(``envbuild.store.registry``: a repository of an OCI registry) and ``MemoryStore`` (tests);
generic logic is in ``envbuild.store.helpers``, push/pull between
stores in ``envbuild.store.sync``, lazy layer reads in ``envbuild.store.lazy``. Open one from a
``--store`` / ``ENVBUILD_STORE`` value with ``open_store``.
"""

from __future__ import annotations

from envbuild.errors import SettingsError
from envbuild.store.base import (
    ANY,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_LAYER_ZSTD,
    MEDIA_TYPE_MANIFEST,
    BlobInfo,
    ConditionalRecords,
    Descriptor,
    LocalBlobPaths,
    Locatable,
    PartialWrite,
    Presigner,
    RangeReader,
    RefConflict,
    Store,
    StoreLocation,
    TailReader,
    VerifyingReader,
    canonical_json,
    capabilities,
    check_digest,
)
from envbuild.store.helpers import (
    KEY_RECORDS,
    LAYER_RECORDS,
    PYIMPORT_RECORDS,
    KeyRecord,
    copy_blobs,
    copy_layer_records,
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
    "ConditionalRecords",
    "Descriptor",
    "KEY_RECORDS",
    "KeyRecord",
    "LAYER_RECORDS",
    "LocalBlobPaths",
    "LocalStore",
    "Locatable",
    "MEDIA_TYPE_CONFIG",
    "MEDIA_TYPE_INDEX",
    "MEDIA_TYPE_LAYER_ZSTD",
    "MEDIA_TYPE_MANIFEST",
    "MemoryStore",
    "PYIMPORT_RECORDS",
    "PartialWrite",
    "Presigner",
    "RangeReader",
    "RefConflict",
    "Store",
    "StoreLocation",
    "TailReader",
    "VerifyingReader",
    "canonical_json",
    "capabilities",
    "check_digest",
    "copy_blobs",
    "copy_layer_records",
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


def open_store(url: str, *, s3_endpoint: str | None = None,
               registry_insecure: tuple[str, ...] = (), create: bool = True) -> Store:
    """Open the store a ``--store`` / ``ENVBUILD_STORE`` value names.

    * a path (``cache``, ``/srv/envbuild``) → ``LocalStore``, created if missing (unless
      ``create=False``: a reader's ``StoreUnavailable``)
    * ``memory://`` → a new, empty ``MemoryStore`` (tests)
    * ``s3://BUCKET/PREFIX`` → ``S3Store`` at ``s3_endpoint`` (``--s3-endpoint``), else the
      endpoint boto3 is configured with (``AWS_ENDPOINT_URL``, or AWS itself)
    * ``docker://HOST[:PORT]/REPO`` → ``RegistryStore`` (plain HTTP for loopback hosts and
      those in ``registry_insecure``, ``--registry-insecure``; HTTPS otherwise)

    Anything else with a ``scheme://`` is a ``SettingsError``.
    """
    if not url:
        raise SettingsError("the store location is empty",
                            hint="pass --store DIR or set ENVBUILD_STORE (default: cache)")
    scheme, sep, _ = url.partition("://")
    if not sep:
        return LocalStore(url, create=create)
    if scheme == "memory":
        return MemoryStore()
    if scheme == "s3":
        from envbuild.store.s3 import S3Store

        return S3Store.from_url(url, endpoint_url=s3_endpoint or None)
    if scheme == "docker":
        from envbuild.store.registry import RegistryStore

        return RegistryStore.from_url(url, insecure=registry_insecure)
    raise SettingsError(f"unknown store URL scheme {scheme!r} in {url!r}",
                        hint="use a directory path, s3://BUCKET/PREFIX or "
                             "docker://HOST[:PORT]/REPO")
