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
``RangeReader`` (what every store and the lazy daemon's URL reader share), ``TailReader``
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
import dataclasses
import hashlib
import io
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol, runtime_checkable

from envbuild.canonical import canonical_json, load_json
from envbuild.errors import BlobNotFound, DigestMismatch, RefNotFound, StoreError

#: The OCI media types envbuild stores.
MEDIA_TYPE_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_INDEX: Final = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
MEDIA_TYPE_LAYER_ZSTD: Final = "application/vnd.oci.image.layer.v1.tar+zstd"

#: The annotation that names a manifest in an OCI layout's ``index.json``.
REF_NAME_ANNOTATION: Final = "org.opencontainers.image.ref.name"

#: Bytes moved per read when streaming; bounds the memory of put/get/copy.
CHUNK_SIZE: Final = 1 << 20
#: Blobs up to this size are written without asking first whether they are stored: uploading
#: one again costs about what the question does (a put of a stored blob is a no-op).
SMALL_BLOB = 1 << 20

_DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
# The OCI image-layout grammar for ref.name: components of alphanumerics joined by one of
# -._:@+ or "--", separated by "/".
_COMPONENT = r"[A-Za-z0-9]+(?:(?:[-._:@+]|--)[A-Za-z0-9]+)*"
_REF_NAME_RE = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_NAMESPACE_RE = re.compile(r"[a-z0-9][a-z0-9_-]*(?:/[a-z0-9][a-z0-9._-]*)*")
_RECORD_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
# Top-level names of the OCI layout; a record namespace must not shadow them.
_RESERVED_NAMESPACES = frozenset({"blobs", "index.json", "oci-layout"})
_MEDIA_TYPE_PART = r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}"
_MEDIA_TYPE_RE = re.compile(rf"{_MEDIA_TYPE_PART}/{_MEDIA_TYPE_PART}")  # OCI defs-descriptor


class RefConflict(StoreError):
    """``put_ref`` with ``expect=`` found the ref pointing elsewhere (compare-and-swap lost).

    ``current`` is the digest the ref points at now (``None``: the ref does not exist). The usual
    reaction is to re-read the ref, recompute, and try again.
    """

    reference = "ref-conflict"

    def __init__(self, name: str, expected: str | None, current: str | None) -> None:
        self.name = name
        self.expected = expected
        self.current = current
        want = "to not exist" if expected is None else f"at {expected}"
        have = "does not exist" if current is None else f"points at {current}"
        super().__init__(f"ref {name!r} changed concurrently: expected it {want}, but it {have}",
                         hint="re-read the ref and retry")


class _Any:
    """Type of ``ANY``: ``put_ref`` without a compare-and-swap condition."""

    _instance: _Any | None = None

    def __new__(cls) -> _Any:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ANY"


#: ``put_ref(..., expect=ANY)`` (the default): overwrite whatever is there.
ANY: Final = _Any()


@dataclasses.dataclass(frozen=True)
class BlobInfo:
    """What ``stat`` knows about a stored blob.

    ``mtime`` (seconds since the epoch) is when the blob was stored in this store: the local
    file's mtime, S3's ``LastModified``, the time of the ``put`` in memory. ``None`` when the
    backend cannot tell; GC treats an unknown age as "just written" and never deletes such a
    blob. It is metadata, not identity: two ``BlobInfo`` of the same blob compare equal.
    """

    digest: str
    size: int
    mtime: float | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class PartialWrite:
    """A write in progress, or the leftover of one that crashed: a local ``.tmp-*`` file, an
    unfinished S3 multipart upload. ``name`` identifies it to ``delete_partial``."""

    name: str
    size: int
    mtime: float


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what a ref points at.

    ``annotations`` are the caller's; the ref name itself is never among them (the local backend
    adds ``org.opencontainers.image.ref.name`` only inside ``index.json``).
    """

    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_oci(self) -> dict[str, Any]:
        """The descriptor as OCI JSON (``mediaType``, ``digest``, ``size``, ``annotations``)."""
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest,
                               "size": self.size}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        return out

    @classmethod
    def from_oci(cls, obj: Mapping[str, Any]) -> Descriptor:
        """Parse OCI descriptor JSON; raises ``StoreError`` when a field is missing or wrong."""
        try:
            media_type, digest, size = obj["mediaType"], obj["digest"], obj["size"]
            annotations = dict(obj.get("annotations") or {})
        except (KeyError, TypeError, AttributeError) as e:
            raise StoreError(f"parse descriptor: missing or malformed field {e}") from None
        if not isinstance(media_type, str) or not isinstance(size, int) or size < 0:
            raise StoreError(f"parse descriptor: bad mediaType or size in {dict(obj)!r}")
        check_digest(digest)
        return cls(media_type=media_type, digest=digest, size=size, annotations=annotations)


def check_digest(digest: object) -> str:
    """Return the hex part of a ``sha256:<64 lowercase hex>`` digest, or raise ``StoreError``.

    Every backend calls this before turning a digest into a path or key, so a malformed string
    (``sha256:../../etc``, upper-case hex, another algorithm) can never name anything else.
    """
    if not isinstance(digest, str) or not (m := _DIGEST_RE.fullmatch(digest)):
        raise StoreError(f"invalid digest {digest!r}", reference="invalid-digest",
                         hint="a digest is 'sha256:' followed by 64 lower-case hex digits")
    return m.group(1)


def check_ref_name(name: object) -> str:
    """Return ``name`` if it is a valid OCI ref name (``org.opencontainers.image.ref.name``)."""
    if not isinstance(name, str) or len(name) > 255 or not _REF_NAME_RE.fullmatch(name):
        raise StoreError(f"invalid ref name {name!r}", reference="invalid-name",
                         hint="use letters and digits joined by one of - . _ : @ + "
                              "and '/' between components, e.g. 'envs/swe-requests'")
    return name


def check_record_name(namespace: object, name: object) -> tuple[str, str]:
    """Validate a record's namespace (``keys/v1``) and name (``<key-hex>``); return both."""
    if (not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace)
            or namespace.split("/")[0] in _RESERVED_NAMESPACES):
        raise StoreError(f"invalid record namespace {namespace!r}", reference="invalid-name",
                         hint="use lower-case path components such as 'keys/v1'")
    if not isinstance(name, str) or not _RECORD_NAME_RE.fullmatch(name):
        raise StoreError(f"invalid record name {name!r}", reference="invalid-name",
                         hint="use letters, digits, '.', '_' and '-', starting with a letter "
                              "or digit")
    return namespace, name


def check_range(offset: int, length: int) -> None:
    """Refuse negative offsets and lengths (``StoreError``, reference ``invalid-range``)."""
    if offset < 0 or length < 0:
        raise StoreError(f"invalid range: offset {offset}, length {length}",
                         reference="invalid-range")


def range_beyond_end(digest: str, offset: int, size: int) -> StoreError:
    """The error for a ``get_range`` starting after the end of the blob. Raise it."""
    return StoreError(f"range of blob {digest} starts at {offset}, beyond its end at {size}",
                      reference="invalid-range")


def iter_chunks(data: bytes | bytearray | memoryview | BinaryIO) -> Iterator[bytes]:
    """Yield ``data`` (bytes, or a binary stream read to its end) in chunks of ``CHUNK_SIZE``."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for start in range(0, len(view), CHUNK_SIZE):
            yield bytes(view[start:start + CHUNK_SIZE])
        return
    while chunk := data.read(CHUNK_SIZE):
        yield chunk


def mismatch_on_put(digest: str, actual: str, size: int,
                    expected_size: int | None) -> DigestMismatch:
    """The error ``put`` raises when the data it read is not the blob it was told. Raise it."""
    if expected_size is not None and size != expected_size:
        what = f"{size} bytes, expected {expected_size}"
    else:
        what = f"content hashes to {actual}"
    return DigestMismatch(f"refusing to store blob {digest}: {what}",
                          hint="the source changed while it was read, or the digest is wrong; "
                               "nothing was stored")


class VerifyingReader(io.RawIOBase):
    """A read-only stream that hashes what passes through and checks it against ``digest``.

    When the wrapped stream ends (or once ``size`` bytes were read, if given) the sha256 of
    everything read must equal ``digest``, and the count must equal ``size``; otherwise
    ``read`` raises ``DigestMismatch``. A caller that stops early and closes the stream gets no
    verification — only reading to the end proves the content. ``location`` (a path, a URL)
    names the stored copy in the error so a user can delete it.
    """

    def __init__(self, raw: BinaryIO, digest: str, *, size: int | None = None,
                 location: str | None = None) -> None:
        super().__init__()
        self._raw = raw
        self._digest = digest
        self._size = size
        self._location = location
        self._hash = hashlib.sha256()
        self._count = 0
        self._verified = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        raw_readinto = getattr(self._raw, "readinto", None)
        if raw_readinto is not None:
            # straight into the caller's buffer: no allocation and copy per read (slow here)
            n = raw_readinto(view) or 0
            chunk: Any = view[:n]
        else:
            chunk = self._raw.read(len(view))
            n = len(chunk)
            view[:n] = chunk
        if not n:
            self._verify()
            return 0
        self._hash.update(chunk)
        self._count += n
        if self._size is not None and self._count >= self._size:
            # Verify as soon as the promised size arrived: callers that read exactly ``size``
            # bytes never see EOF. A byte beyond it is a mismatch in itself.
            if self._count > self._size:
                raise self._mismatch(f"it is longer than {self._size} bytes")
            self._verify()
        return n

    def proves(self, digest: str) -> bool:
        """Whether reading this stream to its end proves ``digest`` (it raises otherwise): a
        writer that reads it to the end need not hash the bytes a second time."""
        return digest == self._digest

    @property
    def verified(self) -> bool:
        """True once everything was read and matched the digest."""
        return self._verified

    def _verify(self) -> None:
        if self._verified:
            return
        if self._size is not None and self._count != self._size:
            raise self._mismatch(f"read {self._count} bytes, expected {self._size}")
        actual = "sha256:" + self._hash.hexdigest()
        if actual != self._digest:
            raise self._mismatch(f"its content hashes to {actual}")
        self._verified = True

    def _mismatch(self, why: str) -> DigestMismatch:
        where = f" at {self._location}" if self._location else ""
        hint = (f"delete it ({self._location}) and pull or rebuild it again" if self._location
                else "delete the blob and pull or rebuild it again")
        return DigestMismatch(f"blob {self._digest}{where} is corrupt: {why}", hint=hint)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


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
    def list_refs(self) -> list[str]:
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
    def list_records(self, namespace: str) -> list[str]:
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


# -- optional capabilities -------------------------------------------------------------------
#
# ``Store`` is what every backend can do. Some can do more, cheaply, and some callers need it:
# the lazy reader wants a blob's tail in one request, the node cache wants to read a local
# blob file in place, the lazy daemon (another process) wants a presigned URL or a location it
# can open the store from. Each such extra is one small Protocol below (containerd splits its
# content store the same way: Provider, Ingester, Manager, ...). A backend *declares* what it
# implements by listing the protocols among its bases (``class LocalStore(Store,
# LocalBlobPaths, ...)``), the conformance suite checks each declared capability against its
# contract, and a caller asks for the protocol it needs (``isinstance(store, TailReader)``
# where it must branch, the protocol as the parameter type where it must have it). Never probe
# with ``getattr(store, "name", None)``: that silently picks up methods with other contracts.


@runtime_checkable
class RangeReader(Protocol):
    """Reads pieces of blobs by offset: the part of the contract lazy readers need.

    Every ``Store`` is one (``get_range`` and ``stat`` are part of ``Store``, with the contract
    described there); so are stand-ins that serve only some blobs, such as the lazy daemon's
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
        daemon reads ranges this way (``envbuild.store.lazy.HttpRanges``) without loading
        boto3, whose CPU cost per request would dominate its reads.

    ``presigned_put_record_url(namespace, name, expires=3600) -> str``
        A URL that answers a plain ``PUT`` of a record's bytes (``encode_record``) by storing
        them as record ``namespace/name`` (last writer wins, as ``put_record``), for about
        ``expires`` seconds: the lazy daemon saves a recorded profile this way, so it never
        loads boto3 (creating its client holds the daemon's GIL for ~0.4 s, stalling every
        FUSE request of the node). The same bearer-secret rule; ``StoreError`` for a bad name
        or lifetime.

    ``presigned_get_record_url(namespace, name, expires=3600) -> str``
        A URL that answers a plain ``GET`` with record ``namespace/name``'s bytes (``404``
        while it is absent), for about ``expires`` seconds: the lazy daemon reads a layer's
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


#: Every optional capability, for the conformance suite and ``capabilities``.
CAPABILITIES: Final = (TailReader, LocalBlobPaths, Locatable, Presigner, BlobMounter,
                        ConditionalRecords)


def capabilities(store: object) -> frozenset[type]:
    """The optional capabilities ``store``'s class declares (lists among its bases)."""
    mro = type(store).__mro__
    return frozenset(c for c in CAPABILITIES if c in mro)


def check_tail_length(length: int) -> None:
    """Refuse a ``get_tail`` length that is not positive (reference ``invalid-range``)."""
    if length <= 0:
        raise StoreError(f"invalid tail length {length}: it must be positive",
                         reference="invalid-range")


def make_descriptor(media_type: str, digest: str, size: int,
                    annotations: Mapping[str, str] | None) -> Descriptor:
    """Build the descriptor ``put_ref`` stores, refusing what OCI tools would choke on."""
    if not isinstance(media_type, str) or not _MEDIA_TYPE_RE.fullmatch(media_type):
        raise StoreError(f"invalid media type {media_type!r}", reference="invalid-name",
                         hint=f"e.g. {MEDIA_TYPE_MANIFEST}")
    annotations = dict(annotations or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()):
        raise StoreError(f"annotations must map strings to strings: {annotations!r}")
    if REF_NAME_ANNOTATION in annotations:
        raise StoreError(f"annotation {REF_NAME_ANNOTATION} is the ref name; pass it as name=")
    return Descriptor(media_type, digest, size, annotations)


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


def encode_record(obj: Mapping[str, Any]) -> bytes:
    """Canonical JSON bytes of a record; ``StoreError`` if it is not a JSON object."""
    if not isinstance(obj, Mapping):
        raise StoreError(f"a record must be a JSON object, not {type(obj).__name__}")
    try:
        return canonical_json(obj)
    except (TypeError, ValueError) as e:
        raise StoreError(f"encode record: {e}") from e


def decode_record(data: bytes, where: str) -> dict[str, Any]:
    """Parse a stored record; ``StoreError`` naming ``where`` if it is not a JSON object."""
    try:
        obj = load_json(data)
    except ValueError as e:
        raise StoreError(f"parse record {where}: {e}",
                         hint="the record is damaged; delete it and rebuild") from e
    if not isinstance(obj, dict):
        raise StoreError(f"parse record {where}: not a JSON object")
    return obj


def blob_not_found(digest: str) -> BlobNotFound:
    """The error for an absent blob. Raise it."""
    return BlobNotFound(f"blob {digest} is not in the store",
                        hint="build or pull it first (envbuild plan shows what is missing)")


def ref_not_found(name: str) -> RefNotFound:
    """The error for an absent ref. Raise it."""
    return RefNotFound(f"ref {name!r} does not exist",
                       hint="check the name, or build the env that publishes it")
