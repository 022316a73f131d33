"""The types the store contract speaks (``envbuild.store.base``) and the checks every backend
runs on what it is given: digests, ref and record names, ranges, descriptors, records; and
``VerifyingReader``, the stream every ``get`` returns. Re-exported by ``envbuild.store.base``
and ``envbuild.store``; import them from there."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, Final

from envbuild.canonical import canonical_json, load_json
from envbuild.errors import BlobNotFound, DigestMismatch, RefNotFound, StoreError
from envbuild.oci import digest_hex

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


class _Any(enum.Enum):
    """Type of ``ANY``: ``put_ref`` without a compare-and-swap condition. A one-member enum,
    so ``expect is ANY`` narrows ``expect`` for the type checker."""

    ANY = "ANY"

    def __repr__(self) -> str:
        return "ANY"


#: ``put_ref(..., expect=ANY)`` (the default): overwrite whatever is there.
ANY: Final = _Any.ANY


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
    if (hexpart := digest_hex(digest)) is None:
        raise StoreError(f"invalid digest {digest!r}", reference="invalid-digest",
                         hint="a digest is 'sha256:' followed by 64 lower-case hex digits")
    return hexpart


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

    def __init__(self, raw: BinaryIO | io.RawIOBase, digest: str, *, size: int | None = None,
                 location: str | None = None) -> None:
        super().__init__()
        self._raw = raw
        self._digest = digest
        self._size = size
        self._location = location
        self._hash = hashlib.sha256()
        self._count = 0
        self._verified = False
        self._watchers: list[Callable[[int], None]] = []

    def watch(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(n)`` with the number of bytes of each read from now on (progress
        meters: ``envbuild.store.progress.TransferMeter``)."""
        self._watchers.append(callback)

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
        for watcher in self._watchers:
            watcher(n)
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
