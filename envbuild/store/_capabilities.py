"""The optional capabilities of a store: small Protocols next to ``Store``
(``envbuild.store.base``, which re-exports them; import them from there).

``Store`` is what every backend can do. Some can do more, cheaply, and some callers need it:
the lazy reader wants a blob's tail in one request, the node cache wants to read a local
blob file in place, the lazy filler (another process) wants a presigned URL or a location it
can open the store from. Each such extra is one small Protocol below (containerd splits its
content store the same way: Provider, Ingester, Manager, ...). A backend *declares* what it
implements by listing the protocols among its bases (``class LocalStore(Store,
LocalBlobPaths, ...)``), the conformance suite checks each declared capability against its
contract, and a caller asks for the protocol it needs (``isinstance(store, TailReader)``
where it must branch, the protocol as the parameter type where it must have it). Never probe
with ``getattr(store, "name", None)``: that silently picks up methods with other contracts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from envbuild.store._types import BlobInfo


@runtime_checkable
class RangeReader(Protocol):
    """Reads pieces of blobs by offset: the part of the contract lazy readers need.

    Every ``Store`` is one (``get_range`` and ``stat`` are part of ``Store``, with the contract
    described there); so are stand-ins that serve only some blobs, such as the lazy filler's
    presigned-URL reader ``envbuild.store.lazy.HttpRanges``. The contract, restated:

    ``get_range(digest, offset, length) -> bytes``
        ``length`` bytes at ``offset``, fewer only where the blob ends; ``b""`` when ``offset``
        is exactly its size; ``StoreError`` (reference ``invalid-range``) when ``offset`` is
        beyond it or either number is negative; ``BlobNotFound`` when the blob is absent. The
        bytes are **not verified** (only a whole blob can be): verify them against something
        that is (a TOC entry's digest) before use.
    ``stat(digest) -> BlobInfo``
        Its size; ``BlobNotFound`` when absent.
    """

    def get_range(self, digest: str, offset: int, length: int) -> bytes: ...

    def stat(self, digest: str) -> BlobInfo: ...


@runtime_checkable
class TailReader(Protocol):
    """Reads the end of a blob without knowing its size: one request instead of two.

    ``get_tail(digest, length) -> (bytes, size)``
        The last ``length`` bytes of the blob (all of it when it is shorter) and the blob's
        total size, read in **one** request (an HTTP suffix range ``bytes=-N``), which is the
        point: a layer's footer is its last 80 bytes, so a lazy reader that is not told the
        size opens a layer with two reads (tail, TOC) instead of three (stat, footer, TOC).
        ``length`` must be positive (``StoreError``, reference ``invalid-range``, otherwise);
        ``BlobNotFound`` when the blob is absent. Like ``get_range``, the bytes are not
        verified.
    """

    def get_tail(self, digest: str, length: int) -> tuple[bytes, int]: ...


@runtime_checkable
class LocalBlobPaths(Protocol):
    """Blobs that are files on this host, which a caller may open and read in place.

    ``blob_path(digest) -> pathlib.Path``
        Where blob ``digest`` is (or would be) stored. The file exists exactly when the blob is
        stored (a write in progress is elsewhere until it is complete and verified, then
        renamed there), so ``blob_path(d).is_file()`` is a valid ``exists`` check. It raises
        ``StoreError`` (reference ``invalid-digest``) for a malformed digest, never for an
        absent blob. Callers only **read** the file (``LayerReader.open_file``, ``mmap``,
        ``shutil.copyfile``): writing, renaming or deleting it bypasses the store's
        verification and GC. Its bytes were verified when they were stored, but disk damage
        after that is only caught by whatever the reader verifies (a layer's TOC and file
        digests, or hashing the whole file), as with ``get_range``.
    """

    def blob_path(self, digest: str) -> Path: ...


@dataclasses.dataclass(frozen=True)
class StoreLocation:
    """Where another process finds a store: ``open_store(url, s3_endpoint=s3_endpoint)``."""

    url: str
    s3_endpoint: str | None = None


@runtime_checkable
class Locatable(Protocol):
    """A store another process on this host can open by URL.

    ``location() -> StoreLocation``
        A ``url`` (an absolute directory path, ``s3://BUCKET/PREFIX``) and an ``s3_endpoint``
        (``None``: the default) such that ``envbuild.store.open_store(url,
        s3_endpoint=s3_endpoint)`` in another process opens **the same store**: what one
        handle writes, the other reads. Credentials are not part of it; the other process
        finds them in its environment as this one did. The lazy layer daemon is such a
        process. A ``MemoryStore`` is not locatable: its contents live in this process only.
    """

    def location(self) -> StoreLocation: ...


@runtime_checkable
class Presigner(Protocol):
    """Hands out URLs that read a blob over plain HTTP, without credentials or this library.

    ``presigned_get_url(digest, expires=43200) -> str``
        An ``http(s)://`` URL that answers a plain ``GET`` — including ranged ones (``Range:
        bytes=A-B`` → ``206``) — with blob ``digest``'s bytes, for about ``expires`` seconds
        (less if the signing credentials expire sooner; ``StoreError`` when ``expires`` is
        not positive). The URL is a bearer secret: whoever holds it can read that blob until
        it expires, so hand it only to processes allowed to read the store. Making one sends
        no request and does not check that the blob exists: a ``GET`` of an absent blob
        answers ``404``. Readers handle ``403`` (expired) by going back to the store; the lazy
        filler reads ranges this way (``envbuild.store.lazy.HttpRanges``) without loading
        boto3, whose CPU cost per request would dominate its reads.

    ``presigned_put_record_url(namespace, name, expires=3600) -> str``
        A URL that answers a plain ``PUT`` of a record's bytes (``encode_record``) by storing
        them as record ``namespace/name`` (last writer wins, as ``put_record``), for about
        ``expires`` seconds: a process that must not load boto3 can save a record this way
        (the removed FUSE daemon saved its lazy profiles so; no reader of envbuild's uses it
        now). The same bearer-secret rule; ``StoreError`` for a bad name
        or lifetime.

    ``presigned_get_record_url(namespace, name, expires=3600) -> str``
        A URL that answers a plain ``GET`` with record ``namespace/name``'s bytes (``404``
        while it is absent), for about ``expires`` seconds: the lazy filler reads a layer's
        import index (``runtime_shim.lazyfs.pyindex``) this way. The same rules.
    """

    def presigned_get_url(self, digest: str, expires: int = 12 * 3600) -> str: ...

    def presigned_get_record_url(self, namespace: str, name: str,
                                 expires: int = 3600) -> str: ...

    def presigned_put_record_url(self, namespace: str, name: str,
                                 expires: int = 3600) -> str: ...


@runtime_checkable
class ConditionalRecords(Protocol):
    """Records written only if they are as the caller last saw them: what build leases need
    (``envbuild.store.lease``). A *tag* names one version of a record (S3's ETag; the digest
    of the bytes elsewhere); it is opaque to callers and only ever compared by the store.

    ``get_record_tagged(namespace, name) -> (obj, tag) | None``
        The record and its tag, ``None`` if absent.
    ``create_record(namespace, name, obj) -> str | None``
        Store the record if no record by that name exists, atomically (of two racing
        creators exactly one succeeds); its tag, or ``None`` if one exists. A reader never
        sees it half written.
    ``replace_record(namespace, name, obj, tag) -> str | None``
        Overwrite the record only if its current tag is ``tag``; the new tag, or ``None``
        if it changed or vanished meanwhile.
    ``delete_record_if(namespace, name, tag) -> bool``
        Remove the record only if its current tag is ``tag``; False otherwise.

    Plain ``put_record``/``delete_record`` still work on such records (last writer wins).
    """

    def get_record_tagged(self, namespace: str, name: str) -> tuple[dict[str, Any], str] | None: ...

    def create_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> str | None: ...

    def replace_record(self, namespace: str, name: str, obj: Mapping[str, Any],
                       tag: str) -> str | None: ...

    def delete_record_if(self, namespace: str, name: str, tag: str) -> bool: ...
