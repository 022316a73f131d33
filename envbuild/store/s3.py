"""``S3Store``: the store in an S3 bucket (or anything that speaks the S3 API), through boto3.

URL: ``s3://BUCKET/PREFIX``. The endpoint comes from ``--s3-endpoint`` / ``endpoint_url=``,
else boto3's own configuration (``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``, the config
file); credentials and region come the standard boto3 way (region defaults to ``us-east-1``).

Key layout under ``PREFIX/`` (store format version 1; the same as ``LocalStore`` where S3 can)::

    envbuild-store.json    {"version": 1}: written when the store is first opened; other
                           versions are refused by name
    oci-layout             {"imageLayoutVersion": "1.0.0"}
    blobs/sha256/<hex>     blob bytes (OCI)
    keys/v1/<key-hex>      key records (any ``<namespace>/<name>`` record lives here)
    refs.d/<ref-name>      one object per ref: its OCI descriptor (with the ref-name annotation).
                           **The source of truth for refs.** (``refs.d`` has a dot, so no record
                           namespace can collide with it.)
    index.json             an OCI image index *derived* from ``refs.d/`` after every ref update,
                           for OCI tools; envbuild itself never reads it

Refs and compare-and-swap: S3 has no rename and no lock, so a ref is one object and an update is
one PUT (atomic per object: readers see the old or the new descriptor). ``put_ref(expect=None)``
is a PUT with ``If-None-Match: *``; ``put_ref(expect=D)`` reads the ref object, checks it points
at ``D`` and PUTs with ``If-Match: <etag it read>``; a 412 (or 409 from a concurrent conditional
write) is a lost race → ``RefConflict``. Servers that ignore conditional PUTs (older MinIO,
s3rver) are detected once per handle — a conditional PUT of the existing ``envbuild-store.json``
must answer 412 — and then ``supports_cas`` is false and ``expect=`` is refused (the contract's
``cas-unsupported``), never faked. ``index.json`` is rewritten with the same If-Match loop after
every ref change, re-reading the ref objects it lists, so concurrent writers converge on the
final refs; if it ever lags (a crash between the two PUTs), the next ref update repairs it.

Blobs: ``put`` HEADs first (present → done, without reading ``data``). Blobs up to
``part_size`` go up in one PUT after being hashed in memory; larger ones as a multipart upload
whose parts are hashed in order while ``concurrency`` of them upload in parallel (memory:
``(concurrency + 1) * part_size``); the upload is completed only if the digest (and size)
matched, otherwise aborted — a half or wrong blob is never visible. Both create with
``If-None-Match: *``: a 412 means a concurrent put stored the same bytes first, which is
success. ``get`` is one streaming GET, verified by ``VerifyingReader`` as it is read; a
connection that breaks mid-body is resumed with a ranged GET pinned to the object's ETag
(``If-Match``), at most ``resume_attempts`` times; blobs of at least ``parallel_get`` bytes
are instead fetched as ``concurrency`` parallel ranged GETs (what S3 is fast at), still
hashed in order. ``get_range`` is one ranged GET — over plain keep-alive HTTP to a presigned
URL rather than through boto3, whose per-request CPU cost dominates lazy reads.

The S3 client, its retries and error mapping: ``envbuild.store._s3_client``; multipart uploads
and the read streams: ``envbuild.store._s3_transfer``.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import io
import json
import random
import time
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from envbuild.canonical import load_json
from envbuild.errors import BlobNotFound, StoreError, StoreUnavailable
from envbuild.oci import is_hex64
from envbuild.store._s3_client import (  # noqa: F401  (parse_url, MiB re-exported)
    BLOBS_DIR,
    CONFLICT,
    NOT_FOUND,
    REFS_DIR,
    MiB,
    S3Objects,
    error_code,
    http_status,
    parse_url,
    timestamp,
)
from envbuild.store._s3_transfer import MultipartUpload, ParallelBody, ResumingBody, read_exact
from envbuild.store.base import (
    ANY,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_MANIFEST,
    REF_NAME_ANNOTATION,
    SMALL_BLOB,
    BlobInfo,
    ConditionalRecords,
    Descriptor,
    Locatable,
    PartialWrite,
    Presigner,
    RefConflict,
    Store,
    StoreLocation,
    TailReader,
    VerifyingReader,
    _Any,
    blob_not_found,
    canonical_json,
    check_digest,
    check_expect,
    check_range,
    check_record_name,
    check_ref_name,
    check_tail_length,
    decode_record,
    encode_record,
    make_descriptor,
    mismatch_on_put,
    range_beyond_end,
    ref_not_found,
)

STORE_VERSION = 1
IMAGE_LAYOUT_VERSION = "1.0.0"
VERSION_KEY = "envbuild-store.json"
LAYOUT_KEY = "oci-layout"
INDEX_KEY = "index.json"
_INDEX_ATTEMPTS = 8


class S3Store(S3Objects, Store, TailReader, Locatable, Presigner, ConditionalRecords):
    """A ``Store`` in ``s3://bucket/prefix``; see the module docstring for layout and semantics.

    Capabilities beyond ``Store``: ``TailReader`` (a suffix-range GET), ``Locatable`` (its URL
    and endpoint) and ``Presigner`` (presigned GET URLs of blobs).

    ``session`` (a ``boto3.Session``) or the default credential chain signs requests. Tuning:
    ``part_size`` (multipart part and single-PUT limit, >= 5 MiB on real S3), ``concurrency``
    (parts, and parallel ranged reads by callers, in flight), ``max_attempts``,
    ``connect_timeout``, ``read_timeout``; ``cas`` forces ``supports_cas`` (default: probe);
    ``fast_ranges`` serves ``get_range`` over plain keep-alive HTTP with a presigned URL;
    blobs of at least ``parallel_get`` bytes are read by ``get`` as ``concurrency`` parallel
    ranged GETs of ``part_size`` (0: always one streaming GET).
    """


    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Store:
        bucket, prefix = parse_url(url)
        return cls(bucket, prefix, **kwargs)


    def location(self) -> StoreLocation:
        return StoreLocation(self.url, self.endpoint)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r})"

    # -- plumbing ------------------------------------------------------------------------------


    def _open(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self._key(VERSION_KEY)
        try:
            resp = self._probe_client.get_object(Bucket=self.bucket, Key=key)
            meta = resp["Body"].read()
        except ClientError as e:
            if error_code(e) not in NOT_FOUND:
                raise self._fail(e, f"open store {self.url}") from e
            meta = None
        except BotoCoreError as e:
            raise self._fail(e, f"open store {self.url}") from e
        if meta is None:  # a new store: write its layout files (a racing opener is harmless)
            self._put_small(self._key(LAYOUT_KEY), canonical_json(
                {"imageLayoutVersion": IMAGE_LAYOUT_VERSION}), IfNoneMatch="*")
            self._put_small(key, canonical_json({"version": STORE_VERSION}), IfNoneMatch="*")
            return
        try:
            found = json.loads(meta).get("version")
        except (ValueError, AttributeError):
            found = None
        if found != STORE_VERSION:
            raise StoreUnavailable(
                f"unsupported envbuild store version {found!r} in {self._where(key)}",
                hint=f"this envbuild reads store version {STORE_VERSION}; use the envbuild "
                     "that wrote it, or another prefix")

    # the base's plain attribute, here a property: probed on first use
    @property
    def supports_cas(self) -> bool:  # type: ignore[override]
        """Whether the server honours conditional PUTs; probed once per handle."""
        if self._cas is None:
            with self._cas_lock:
                if self._cas is None:
                    # envbuild-store.json exists (written on open): a conditional create of it
                    # must be refused. A server that accepts it ignores conditions (it rewrote
                    # the same bytes, which is harmless).
                    self._cas = not self._put_small(
                        self._key(VERSION_KEY), canonical_json({"version": STORE_VERSION}),
                        IfNoneMatch="*")
        return self._cas

    # -- blobs ---------------------------------------------------------------------------------

    def put(self, digest: str, data: bytes | BinaryIO, *, size: int | None = None) -> None:
        key = self._blob_key(digest)
        # A small blob of known size: the conditional PUT (If-None-Match) alone answers
        # "already stored?" (412: success); a HEAD first would be a second round trip.
        if not (size is not None and size <= SMALL_BLOB) and self.exists(digest):
            return
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = io.BytesIO(data)
        first = read_exact(data, self.part_size)
        if len(first) == self.part_size and (size is None or size > len(first)):
            more = data.read(1) if size is None else b"?"
            if more:  # more than one part: multipart (an unsized stream's peeked byte rides along)
                if size is None:
                    first += more
                handover = [first]
                del first  # the upload frees each part once sent: hold no reference here
                return MultipartUpload(self, digest, key).run(data, handover, size)
        actual = "sha256:" + hashlib.sha256(first).hexdigest()
        if actual != digest or (size is not None and len(first) != size):
            raise mismatch_on_put(digest, actual, len(first), size)
        self._put_created(key, first, digest)

    def _put_created(self, key: str, data: bytes | bytearray, digest: str) -> None:
        sha = base64.b64encode(bytes.fromhex(check_digest(digest))).decode()
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*",
                                   ChecksumSHA256=sha)
        except ClientError as e:
            if error_code(e) in CONFLICT or http_status(e) in ("412", "409"):
                return  # stored concurrently by someone else: same bytes, success
            raise self._fail(e, f"write blob {digest} to {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"write blob {digest} to {self._where(key)}") from e


    def get(self, digest: str) -> BinaryIO:
        key = self._blob_key(digest)
        if self.parallel_get and self.concurrency > 1 and self.fast_ranges:
            size = self.stat(digest).size
            if size >= self.parallel_get:
                raw: io.RawIOBase = ParallelBody(self, digest, key, size)
                return VerifyingReader(raw, digest, size=size,  # type: ignore[return-value]
                                       location=self._where(key))
        resp = self._get_object(key)
        if resp is None:
            raise blob_not_found(digest)
        raw = ResumingBody(self, key, resp)
        return VerifyingReader(raw, digest, size=resp["ContentLength"],  # type: ignore[return-value]
                               location=self._where(key))

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        check_range(offset, length)
        key = self._blob_key(digest)
        if length == 0:
            size = self.stat(digest).size
            if offset > size:
                raise range_beyond_end(digest, offset, size)
            return b""
        if self.fast_ranges:
            status, data = self._fast_range(key, offset, length)
            if status == 404:
                raise blob_not_found(digest)
            if status != 416:
                return data
        else:
            status, data = self._boto_range(digest, key, offset, length)
            if status != 416:
                return data
        size = self.stat(digest).size  # 416: at or beyond the end
        if offset > size:
            raise range_beyond_end(digest, offset, size)
        return b""


    def get_tail(self, digest: str, length: int) -> tuple[bytes, int]:
        """The last ``length`` bytes (a suffix range: one request) and the blob's size.

        The ``TailReader`` capability: lazy readers use it to read a layer's footer without a
        HEAD first."""
        check_tail_length(length)
        key = self._blob_key(digest)
        from botocore.exceptions import ClientError

        try:
            resp = self._get_object(key, Range=f"bytes=-{length}")
        except StoreError as e:
            cause = e.__cause__
            if isinstance(cause, ClientError) and error_code(cause) in ("InvalidRange", "416"):
                return b"", self.stat(digest).size  # an empty blob has no suffix to serve
            raise
        if resp is None:
            raise blob_not_found(digest)
        with resp["Body"] as body:
            # bounded: a server that ignores the range must not make us hold the whole blob
            data = self._call(f"read {self._where(key)}", body.read, length + 1)
        if len(data) > length:
            if "ContentRange" in resp:
                raise StoreError(f"read {self._where(key)}: the server answered a {length}-byte "
                                 "suffix range with more bytes")
            size = self.stat(digest).size  # Range ignored (whole object): read the tail again
            return (self.get_range(digest, max(0, size - length), length), size)
        total = resp.get("ContentRange", "").rpartition("/")[2]
        return data, int(total) if total.isdigit() else len(data)

    def stat(self, digest: str) -> BlobInfo:
        key = self._blob_key(digest)
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if error_code(e) in NOT_FOUND:
                raise blob_not_found(digest) from None
            raise self._fail(e, f"stat {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"stat {self._where(key)}") from e
        return BlobInfo(digest, resp["ContentLength"], timestamp(resp.get("LastModified")))

    def exists(self, digest: str) -> bool:
        try:
            self.stat(digest)
        except BlobNotFound:
            return False
        return True

    def delete(self, digest: str) -> None:
        key = self._blob_key(digest)
        self._call(f"delete {self._where(key)}", self.client.delete_object, Bucket=self.bucket,
                   Key=key)

    def list(self) -> Iterator[str]:
        for name in self._list(BLOBS_DIR, delimiter="/"):
            if is_hex64(name):
                yield "sha256:" + name

    def list_info(self) -> Iterator[BlobInfo]:
        """Sizes and ``LastModified`` from the listing itself: no HEAD per blob."""
        full = self._key(BLOBS_DIR)
        paginator = self.client.get_paginator("list_objects_v2")
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/"):
                for obj in page.get("Contents", ()):
                    name = obj["Key"][len(full):]
                    if is_hex64(name):
                        yield BlobInfo("sha256:" + name, obj["Size"],
                                       timestamp(obj.get("LastModified")))
        except (ClientError, BotoCoreError) as e:
            raise self._fail(e, f"list {self._where(full)}") from e

    def list_partials(self) -> Iterator[PartialWrite]:
        """Unfinished multipart uploads of blobs (``name``: ``<key>#<upload id>``)."""
        full = self._key(BLOBS_DIR)
        paginator = self.client.get_paginator("list_multipart_uploads")
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                for up in page.get("Uploads", ()):
                    yield PartialWrite(f"{up['Key']}#{up['UploadId']}", 0,
                                       timestamp(up.get("Initiated")) or 0.0)
        except (ClientError, BotoCoreError) as e:
            raise self._fail(e, f"list uploads under {self._where(full)}") from e

    def delete_partial(self, partial: PartialWrite) -> None:
        key, _, upload_id = partial.name.rpartition("#")
        if not key.startswith(self._key(BLOBS_DIR)) or not upload_id:
            raise StoreError(f"not a partial write of {self}: {partial.name!r}")
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except ClientError as e:
            if error_code(e) not in NOT_FOUND and error_code(e) != "NoSuchUpload":
                raise self._fail(e, f"abort upload to {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"abort upload to {self._where(key)}") from e

    # -- refs ----------------------------------------------------------------------------------


    def _read_ref(self, name: str) -> tuple[dict[str, Any], bytes, str] | None:
        got = self._read_small(self._ref_key(name))
        if got is None:
            return None
        data, etag = got
        try:
            entry = load_json(data)
            Descriptor.from_oci(entry)
        except (ValueError, StoreError) as e:
            raise StoreError(f"parse ref {self._where(self._ref_key(name))}: {e}",
                             hint="the ref is damaged; delete it and push it again") from None
        return entry, data, etag

    def put_ref(self, name: str, digest: str, *, media_type: str = MEDIA_TYPE_MANIFEST,
                annotations: Mapping[str, str] | None = None,
                expect: str | None | _Any = ANY) -> Descriptor:
        check_ref_name(name)
        check_expect(self, expect)
        desc = make_descriptor(media_type, digest, self.stat(digest).size, annotations)
        entry = desc.to_oci()
        entry["annotations"] = {**desc.annotations, REF_NAME_ANNOTATION: name}
        body = canonical_json(entry)
        key = self._ref_key(name)
        if expect is ANY:
            self._put_small(key, body)
        else:
            if expect is None:
                ok = self._put_small(key, body, IfNoneMatch="*")
            else:
                current = self._read_ref(name)
                if current is None or current[0]["digest"] != expect:
                    raise RefConflict(name, expect, current[0]["digest"] if current else None)
                ok = self._put_small(key, body, IfMatch=current[2])
            if not ok:
                now = self._read_ref(name)
                # a retried PUT whose first attempt landed sees its own write: that is success
                if now is None or now[1] != body:
                    raise RefConflict(name, expect, now[0]["digest"] if now else None)
        self._update_index(name)
        return desc

    def get_ref(self, name: str) -> Descriptor:
        current = self._read_ref(name)
        if current is None:
            raise ref_not_found(name)
        desc = Descriptor.from_oci(current[0])
        ann = {k: v for k, v in desc.annotations.items() if k != REF_NAME_ANNOTATION}
        return Descriptor(desc.media_type, desc.digest, desc.size, ann)

    def list_refs(self) -> builtins.list[str]:
        return sorted(n for n in self._list(REFS_DIR) if _valid_ref(n))

    def delete_ref(self, name: str) -> None:
        key = self._ref_key(name)
        self._call(f"delete {self._where(key)}", self.client.delete_object, Bucket=self.bucket,
                   Key=key)
        self._update_index(name)

    def _update_index(self, name: str) -> None:
        """Bring ``name``'s entry of the derived ``index.json`` in line with its ref object."""
        key = self._key(INDEX_KEY)
        for attempt in range(_INDEX_ATTEMPTS):
            got = self._read_small(key)
            index: dict[str, Any] = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_INDEX,
                                     "manifests": []}
            if got is not None:
                try:
                    parsed = load_json(got[0])
                    if isinstance(parsed, dict) and isinstance(parsed.get("manifests"), list):
                        index = parsed
                except ValueError:
                    pass  # a damaged derived file is simply rewritten
            current = self._read_ref(name)  # re-read: the ref object is the truth
            manifests = [m for m in index["manifests"]
                         if not (isinstance(m, dict)
                                 and (m.get("annotations") or {}).get(REF_NAME_ANNOTATION) == name)]
            if current is not None:
                manifests.append(current[0])
            manifests.sort(key=lambda m: str((m.get("annotations") or {})
                                             .get(REF_NAME_ANNOTATION, "")))
            index["manifests"] = manifests
            data = canonical_json(index)
            if got is not None and data == got[0]:
                return
            if not self.supports_cas:
                self._put_small(key, data)
                return
            cond = {"IfMatch": got[1]} if got is not None else {"IfNoneMatch": "*"}
            if self._put_small(key, data, **cond):
                return
            time.sleep(random.uniform(0, 0.05 * (2 ** attempt)))
        # index.json is derived and envbuild never reads it; the next ref update repairs it

    # -- records -------------------------------------------------------------------------------


    def put_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> None:
        key = self._record_key(namespace, name)
        self._put_small(key, encode_record(obj))

    def get_record(self, namespace: str, name: str) -> dict[str, Any] | None:
        key = self._record_key(namespace, name)
        got = self._read_small(key)
        return None if got is None else decode_record(got[0], self._where(key))

    def list_records(self, namespace: str) -> builtins.list[str]:
        check_record_name(namespace, "x")
        return sorted(n for n in self._list(namespace + "/", delimiter="/")
                      if n and not n.startswith("."))

    def record_mtime(self, namespace: str, name: str) -> float | None:
        key = self._record_key(namespace, name)
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if error_code(e) in NOT_FOUND:
                return None
            raise self._fail(e, f"stat {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"stat {self._where(key)}") from e
        return timestamp(resp.get("LastModified"))

    def delete_record(self, namespace: str, name: str) -> None:
        key = self._record_key(namespace, name)
        self._call(f"delete {self._where(key)}", self.client.delete_object, Bucket=self.bucket,
                   Key=key)


    # -- conditional records (ConditionalRecords; tag: the object's ETag) -------------------
    # Conditional PUTs (If-None-Match: *, If-Match: ETag) and a conditional DELETE (If-Match),
    # which AWS S3 honours atomically. On a server that ignores conditions (``supports_cas``
    # false) these would silently be last-writer-wins, so they refuse instead.

    def _need_cas(self, what: str) -> None:
        if not self.supports_cas:
            raise StoreError(f"{self.url}: the server ignores conditional writes, so {what} "
                             "cannot be exclusive", reference="cas-unsupported",
                             hint="use an S3 server that honours If-None-Match/If-Match")

    def get_record_tagged(self, namespace: str, name: str) -> tuple[dict[str, Any], str] | None:
        key = self._record_key(namespace, name)
        got = self._read_small(key)
        return None if got is None else (decode_record(got[0], self._where(key)), got[1])

    def create_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> str | None:
        return self._put_if(namespace, name, obj, IfNoneMatch="*")

    def replace_record(self, namespace: str, name: str, obj: Mapping[str, Any],
                       tag: str) -> str | None:
        return self._put_if(namespace, name, obj, IfMatch=tag)

    def _put_if(self, namespace: str, name: str, obj: Mapping[str, Any], **cond: str) -> str | None:
        """A conditional PUT of a record: its new ETag, or None when the condition failed.
        (A retried PUT whose first attempt landed fails its own condition: the caller sees
        None and finds its own record on the next read, which the lease code checks.)"""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self._record_key(namespace, name)
        self._need_cas("a conditional write")
        try:
            resp = self.client.put_object(Bucket=self.bucket, Key=key, Body=encode_record(obj),
                                          **cond)
        except ClientError as e:
            if error_code(e) in CONFLICT or error_code(e) in NOT_FOUND or http_status(e) in ("412", "409"):
                return None
            raise self._fail(e, f"write {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"write {self._where(key)}") from e
        return str(resp.get("ETag", ""))

    def delete_record_if(self, namespace: str, name: str, tag: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self._record_key(namespace, name)
        self._need_cas("a conditional delete")
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=tag)
        except ClientError as e:
            if error_code(e) in CONFLICT or error_code(e) in NOT_FOUND or http_status(e) in ("412", "409"):
                return False
            raise self._fail(e, f"delete {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"delete {self._where(key)}") from e
        return True


def _valid_ref(name: str) -> bool:
    try:
        check_ref_name(name)
    except StoreError:
        return False
    return True


