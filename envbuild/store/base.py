"""The store contract: a tiny interface every backend implements, and the types it speaks.

A store holds three kinds of things:

* **blobs** — immutable bytes named by the ``sha256:<64 lowercase hex>`` digest of their content
  (layers, TOCs, manifests, configs). A blob is either fully present and verified, or absent.
* **refs** — mutable names (``swe-requests``, ``base/debian:2024-06``) pointing at a blob through
  an OCI content descriptor. In the local backend they are the entries of the OCI layout's
  ``index.json``, so ``skopeo copy oci:cache:NAME ...`` resolves them.
* **records** — small JSON objects under a namespace, such as key records ``keys/v1/<key-hex>``
  mapping a layer key to the layer it produced. Records are envbuild's own metadata; they are not
  content-addressed and the last writer wins.

Everything generic (hashing a file, canonical JSON blobs, copying between stores, key records)
lives once in ``envbuild.store.helpers`` on top of this interface; a backend implements only the
abstract methods of ``Store`` below and passes the conformance suite in ``tests/store``.

Optional capabilities are small Protocols next to ``Store`` (see "optional capabilities" below):
``RangeReader`` (what every store and the lazy filler's URL reader share), ``TailReader``
(``get_tail``), ``LocalBlobPaths`` (``blob_path``), ``Locatable`` (``location``, for another
process) and ``Presigner`` (``presigned_get_url``). Backends list the ones they implement among
their bases; ``capabilities(store)`` says which:

================  ===========  ==========  ===============  =========  =========
backend           RangeReader  TailReader  LocalBlobPaths   Locatable  Presigner
================  ===========  ==========  ===============  =========  =========
``MemoryStore``   yes
``LocalStore``    yes          yes         yes              yes
``S3Store``       yes          yes                          yes        yes
================  ===========  ==========  ===============  =========  =========

Errors (all ``envbuild.errors.StoreError`` subclasses, each with a ``reference``):

======================  ==================================================================
``BlobNotFound``        ``get``/``get_range``/``stat`` of a digest that is not stored;
                        ``put_ref`` to a digest that is not stored
``RefNotFound``         ``get_ref`` of a name that does not exist
``DigestMismatch``      bytes do not hash to their digest (on ``put``: nothing is stored;
                        on ``get``: raised by the stream once it has read the whole blob)
``RefConflict``         ``put_ref(..., expect=...)`` saw another value (compare-and-swap lost;
                        defined in this module, re-exported by ``envbuild.store``)
``StoreUnavailable``    the store cannot be opened or reached
``StoreError``          anything else, e.g. ``reference="invalid-digest"`` for a malformed
                        digest string, ``"invalid-name"`` for a bad ref or record name,
                        ``"invalid-range"`` for a range that starts beyond the end,
                        ``"cas-unsupported"`` for ``expect=`` on a store without CAS;
                        registries add ``"unsupported-media-type"`` (a tag holds a manifest
                        envbuild does not read), ``"delete-unsupported"`` (deletes disabled
                        in the registry) and ``sync`` ``"ref-moved"`` (a pinned ref moved)
======================  ==================================================================
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO, Final, Protocol, runtime_checkable

# The types and checks (``_types``) and the optional capabilities (``_capabilities``) live in
# modules of their own; every name callers use is re-exported here.
from envbuild.canonical import canonical_json  # noqa: F401  (re-exported)
from envbuild.errors import BlobNotFound, StoreError  # noqa: F401  (StoreError re-exported)
from envbuild.store._capabilities import (  # noqa: F401  (re-exported)
    ConditionalRecords,
    LocalBlobPaths,
    Locatable,
    Presigner,
    RangeReader,
    StoreLocation,
    TailReader,
)
from envbuild.store._types import (  # noqa: F401  (re-exported)
    ANY,
    CHUNK_SIZE,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_LAYER_ZSTD,
    MEDIA_TYPE_MANIFEST,
    REF_NAME_ANNOTATION,
    SMALL_BLOB,
    BlobInfo,
    Descriptor,
    PartialWrite,
    RefConflict,
    VerifyingReader,
    _Any,
    blob_not_found,
    check_digest,
    check_range,
    check_record_name,
    check_ref_name,
    check_tail_length,
    decode_record,
    encode_record,
    iter_chunks,
    make_descriptor,
    mismatch_on_put,
    range_beyond_end,
    ref_not_found,
)


class Store(abc.ABC):
    """A content-addressed blob store with mutable refs and small JSON records.

    Blobs
    -----
    ``put(digest, data, *, size=None)``
        Store ``data`` (bytes, or a binary stream read to its end in chunks) as blob ``digest``.
        **Idempotent**: a normal return means "the content is stored at ``digest``", not
        "because of this call" — two processes putting the same blob at once both succeed and
        leave one intact copy. The bytes are hashed while they are written and become visible
        only after they proved to hash to ``digest`` (and to be ``size`` bytes long, if given);
        otherwise ``DigestMismatch`` is raised and nothing is visible. If the blob already
        exists a backend may return without reading ``data`` (existing blobs were verified when
        they were written).
    ``get(digest) -> BinaryIO``
        A stream of the blob's bytes, which the caller closes. Raises ``BlobNotFound``. The
        stream verifies as it goes (``VerifyingReader``): reading it to the end raises
        ``DigestMismatch`` if the stored copy is corrupt. Use it in a ``with`` block.
    ``get_range(digest, offset, length) -> bytes``
        ``length`` bytes starting at ``offset``, fewer if the blob ends first; ``b""`` when
        ``offset`` is exactly the size. ``offset`` beyond the size raises ``StoreError``
        (reference ``invalid-range``); ``BlobNotFound`` if absent. Ranges are *not* verified
        against the blob digest (that needs the whole blob); lazy readers verify each chunk
        against the digest in the layer's TOC.
    ``stat(digest) -> BlobInfo``
        Size of a stored blob; ``BlobNotFound`` if absent.
    ``exists(digest) -> bool``
        Never raises for a missing blob.
    ``delete(digest) -> None``
        **Idempotent**: deleting an absent blob is not an error. It does not look at refs or
        records; deciding what is garbage is GC's job, on top of this interface.
    ``list() -> Iterator[str]``
        Digests of all stored blobs, in no particular order. Never yields partial writes.
    ``list_info() -> Iterator[BlobInfo]``
        ``stat`` of every blob ``list`` yields (a backend may get them in the same listing).

    Ages and garbage collection (``envbuild.store.gc``)
    ------------------------------------------------
    ``BlobInfo.mtime`` is when a blob was stored; ``record_mtime(namespace, name)`` when a
    record was last written; ``list_partials()`` / ``delete_partial(p)`` expose unfinished
    writes (temp files, multipart uploads) with their age. All three are optional: the defaults
    say "age unknown" / "no partial writes", which GC reads as "keep". GC deletes a blob only
    if nothing it marks reaches it *and* it is older than a grace period, and a partial write
    only once it is older than the grace period, so the **writer's contract** is: finish what
    you start — put the blobs, then the record or ref that reaches them — within the grace
    period (default 24 h). A writer that skips ``put`` because ``exists`` said the blob is
    there relies on that blob being reachable already (through a key record or a ref): true of
    the build's cached layers; a ``sync`` into a store being collected that reuses an old,
    unreachable blob can lose it between its ``exists`` and its ref (GC re-reads the refs
    before sweeping, which narrows that window; ``envbuild job verify`` finds the hole).

    Refs
    ----
    ``put_ref(name, digest, *, media_type=MEDIA_TYPE_MANIFEST, annotations=None, expect=ANY)``
        Point ``name`` at blob ``digest``, which must already be stored (``BlobNotFound``
        otherwise; its size goes into the descriptor). Returns the ``Descriptor`` written.
        ``expect`` makes the update a compare-and-swap: ``ANY`` (default) overwrites
        unconditionally; ``None`` requires that the ref does not exist yet; a digest requires
        that the ref currently points at it. When the condition fails nothing changes and
        ``RefConflict`` is raised. Backends whose ``supports_cas`` is false raise ``StoreError``
        (reference ``cas-unsupported``) for any ``expect`` other than ``ANY`` rather than
        pretend. An update is atomic: readers see the old or the new value, never a mix.
    ``get_ref(name) -> Descriptor``
        ``RefNotFound`` if absent.
    ``list_refs() -> list[str]``
        Sorted names.
    ``delete_ref(name) -> None``
        **Idempotent**; the blob stays.

    Records
    -------
    ``put_record(namespace, name, obj)``
        Store a JSON object (a ``dict``) as ``<namespace>/<name>`` atomically, replacing any
        previous one (last writer wins). Names follow ``check_record_name``.
    ``get_record(namespace, name) -> dict | None``
        ``None`` when absent: a missing record is an expected answer ("not built yet").
    ``list_records(namespace) -> list[str]``
        Sorted names in the namespace (empty if it has none).
    ``delete_record(namespace, name) -> None``
        **Idempotent**.

    Every method that takes a digest, ref name or record name validates it first
    (``check_digest``, ``check_ref_name``, ``check_record_name``) and raises ``StoreError``
    for a malformed one, so no name can escape the store. Methods are safe to call from several
    threads and, for the local backend, several processes at once.
    """

    #: Whether ``put_ref(..., expect=...)`` is a real compare-and-swap in this backend.
    supports_cas: bool = True

    # -- blobs ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def put(self, digest: str, data: bytes | BinaryIO, *, size: int | None = None) -> None:
        """Store ``data`` as blob ``digest``, verified; idempotent. See the class docstring."""

    @abc.abstractmethod
    def get(self, digest: str) -> BinaryIO:
        """A verifying stream of blob ``digest``; ``BlobNotFound`` if absent."""

    @abc.abstractmethod
    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes at ``offset``; short at the end, error beyond it."""

    @abc.abstractmethod
    def stat(self, digest: str) -> BlobInfo:
        """``BlobInfo`` of a stored blob; ``BlobNotFound`` if absent."""

    @abc.abstractmethod
    def exists(self, digest: str) -> bool:
        """Whether blob ``digest`` is stored."""

    @abc.abstractmethod
    def delete(self, digest: str) -> None:
        """Remove blob ``digest``; idempotent."""

    @abc.abstractmethod
    def list(self) -> Iterator[str]:
        """Digests of all stored blobs, in no particular order."""

    def list_info(self) -> Iterator[BlobInfo]:
        """``BlobInfo`` (with ``mtime`` where known) of every stored blob."""
        for digest in self.list():
            try:
                yield self.stat(digest)
            except BlobNotFound:
                continue  # deleted since the listing

    def list_partials(self) -> Iterator[PartialWrite]:
        """Unfinished writes (see "Ages and garbage collection"); none by default."""
        return iter(())

    def delete_partial(self, partial: PartialWrite) -> None:  # noqa: B027 - optional, no-op default
        """Remove an unfinished write that ``list_partials`` reported; idempotent."""

    def record_mtime(self, namespace: str, name: str) -> float | None:
        """When record ``namespace/name`` was last written; ``None`` if absent or unknown."""
        check_record_name(namespace, name)
        return None

    # -- refs ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def put_ref(self, name: str, digest: str, *, media_type: str = MEDIA_TYPE_MANIFEST,
                annotations: Mapping[str, str] | None = None,
                expect: str | None | _Any = ANY) -> Descriptor:
        """Point ref ``name`` at stored blob ``digest``, optionally compare-and-swap."""

    def put_refs(self, refs: Mapping[str, str], *,
                 media_type: str = MEDIA_TYPE_MANIFEST) -> None:
        """Point several refs at stored blobs (no compare-and-swap), e.g. every env lock of a
        build. Each ref update is atomic on its own; a backend may apply them all in one write
        (the local store rewrites ``index.json`` once instead of once per ref)."""
        for name, digest in refs.items():
            self.put_ref(name, digest, media_type=media_type)

    @abc.abstractmethod
    def get_ref(self, name: str) -> Descriptor:
        """The descriptor ref ``name`` points at; ``RefNotFound`` if absent."""

    @abc.abstractmethod
    def list_refs(self) -> builtins.list[str]:
        """Sorted ref names."""

    @abc.abstractmethod
    def delete_ref(self, name: str) -> None:
        """Remove ref ``name``; idempotent."""

    # -- records -------------------------------------------------------------------------------

    @abc.abstractmethod
    def put_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> None:
        """Store JSON object ``obj`` as ``namespace/name``; last writer wins."""

    @abc.abstractmethod
    def get_record(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The record, or ``None`` if absent."""

    @abc.abstractmethod
    def list_records(self, namespace: str) -> builtins.list[str]:
        """Sorted record names in ``namespace``."""

    @abc.abstractmethod
    def delete_record(self, namespace: str, name: str) -> None:
        """Remove a record; idempotent."""


@runtime_checkable
class BlobMounter(Protocol):
    """A store that can take a blob from another store without its bytes passing through the
    client: an OCI registry's cross-repository mount (``RegistryStore.mount``). ``mount``
    returns True when ``digest`` is now stored here, False when it cannot (other registry,
    missing source blob): then copy it. ``copy_blobs`` tries it first."""

    def mount(self, digest: str, source: Store) -> bool: ...


#: Every optional capability, for the conformance suite and ``capabilities``.
CAPABILITIES: Final = (TailReader, LocalBlobPaths, Locatable, Presigner, BlobMounter,
                        ConditionalRecords)


def capabilities(store: object) -> frozenset[type]:
    """The optional capabilities ``store``'s class declares (lists among its bases)."""
    mro = type(store).__mro__
    return frozenset(c for c in CAPABILITIES if c in mro)


def check_expect(store: Store, expect: object) -> None:
    """Validate a ``put_ref`` ``expect`` argument for ``store``."""
    if expect is ANY:
        return
    if not store.supports_cas:
        raise StoreError(f"{type(store).__name__} cannot compare-and-swap refs",
                         reference="cas-unsupported",
                         hint="call put_ref without expect=, or use a store that supports it")
    if expect is not None:
        check_digest(expect)


