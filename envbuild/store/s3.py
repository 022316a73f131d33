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

Failures: botocore retries transient errors (5xx, throttling, timeouts, connection resets) in
"standard" mode — ``max_attempts`` tries with exponential backoff and full jitter, capped by
the connect and read timeouts, so an operation gives up after a bounded time (defaults: 4
attempts, 3 s connect, 30 s read). Opening the store checks the bucket once with a client that
does not retry, so a bad endpoint, unknown host, missing bucket or refused credentials fail at
once with ``StoreUnavailable`` (one line naming the endpoint or bucket, and a hint); an
unreachable endpoint fails well within 15 s. Permanent errors (403, NoSuchBucket) are never
retried.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import io
import json
import random
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from envbuild.canonical import MAX_JSON_BYTES, load_json
from envbuild.errors import BlobNotFound, StoreError, StoreUnavailable
from envbuild.store._http import Backoff, RangeClient
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
REFS_DIR = "refs.d/"
BLOBS_DIR = "blobs/sha256/"
MiB = 1 << 20
_HEX = frozenset("0123456789abcdef")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_CONFLICT = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
           "ExpiredToken", "InvalidToken", "AllAccessDisabled"}
_INDEX_ATTEMPTS = 8


def parse_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` → ``(bucket, prefix)`` with ``prefix`` "" or ending in "/"."""
    from envbuild.errors import SettingsError

    rest = url[len("s3://"):] if url.startswith("s3://") else None
    bucket, _, prefix = (rest or "").partition("/")
    if not bucket:
        raise SettingsError(f"bad S3 store URL {url!r}", hint="use s3://BUCKET or s3://BUCKET/PREFIX")
    prefix = "/".join(p for p in prefix.split("/") if p)
    return bucket, (prefix + "/" if prefix else "")


def _code(e: BaseException) -> str:
    resp = getattr(e, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    status = str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code if code and not code.isdigit() else (status or code)


def _status(e: BaseException) -> str:
    resp = getattr(e, "response", None) or {}
    return str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


class S3Store(Store, TailReader, Locatable, Presigner, ConditionalRecords):
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

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 session: Any = None, part_size: int = 16 * MiB, concurrency: int = 8,
                 max_attempts: int = 4, connect_timeout: float = 3.0,
                 read_timeout: float = 30.0, resume_attempts: int = 3,
                 cas: bool | None = None, fast_ranges: bool = True,
                 parallel_get: int = 64 * MiB) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self.part_size = part_size
        self.concurrency = concurrency
        self.resume_attempts = resume_attempts
        self.max_attempts = max_attempts
        self.read_timeout = read_timeout
        self.connect_timeout = connect_timeout
        self.fast_ranges = fast_ranges
        self.parallel_get = parallel_get
        self._presigned: dict[str, tuple[str, float]] = {}
        # ranged reads (the hot path of lazy layers) bypass boto3: see _presign
        self._ranges = RangeClient(attempts=max_attempts, connect_timeout=connect_timeout,
                                   read_timeout=read_timeout, backoff=Backoff(0.5, 10.0))
        self._cas = cas
        self._cas_lock = threading.Lock()
        session = session or boto3.session.Session()
        common = dict(
            signature_version="s3v4",
            s3={"addressing_style": "path"} if endpoint_url else {},
            # we verify sha256 ourselves on every read; CRC trailers (aws-chunked bodies) are not
            # understood by every S3 implementation
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            connect_timeout=connect_timeout,
            max_pool_connections=max(10, concurrency * 2 + 2),
        )
        region = session.region_name or "us-east-1"
        self.client = session.client(
            "s3", endpoint_url=endpoint_url, region_name=region,
            config=Config(retries={"max_attempts": max_attempts, "mode": "standard"},
                          read_timeout=read_timeout, **common))
        # opening: no retries and a short read timeout, so a wrong endpoint fails at once
        self._probe_client = session.client(
            "s3", endpoint_url=endpoint_url, region_name=region,
            config=Config(retries={"max_attempts": 1, "mode": "standard"},
                          read_timeout=min(read_timeout, 5.0), **common))
        self.endpoint = self.client.meta.endpoint_url
        self._open()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Store:
        bucket, prefix = parse_url(url)
        return cls(bucket, prefix, **kwargs)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def location(self) -> StoreLocation:
        return StoreLocation(self.url, self.endpoint)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r})"

    # -- plumbing ------------------------------------------------------------------------------

    def _key(self, rel: str) -> str:
        return self.prefix + rel

    def _blob_key(self, digest: str) -> str:
        return self._key(BLOBS_DIR + check_digest(digest))

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _fail(self, e: BaseException, what: str) -> StoreError:
        """Map a boto/botocore exception to the store's errors (one line, with a hint)."""
        from botocore.exceptions import (
            ClientError,
            ConnectionError,
            HTTPClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )

        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return StoreUnavailable(f"{what}: no usable AWS credentials for {self.url}",
                                    hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                                         "AWS_PROFILE")
        if isinstance(e, ClientError):
            code = _code(e)
            msg = (e.response.get("Error", {}).get("Message") or "").strip()
            if code == "NoSuchBucket":
                return StoreUnavailable(f"{what}: bucket {self.bucket!r} does not exist at "
                                        f"{self.endpoint}",
                                        hint="create it, or check the store URL and "
                                             "--s3-endpoint / AWS_ENDPOINT_URL")
            if code in _DENIED:
                return StoreUnavailable(f"{what}: access denied to {self.url} ({code})",
                                        hint="check the credentials (AWS_ACCESS_KEY_ID, "
                                             "AWS_PROFILE) and the bucket policy")
            return StoreError(f"{what}: S3 error {code}" + (f": {msg}" if msg else ""))
        if isinstance(e, (ConnectionError, HTTPClientError)):
            cause = str(e).splitlines()[0] if str(e) else type(e).__name__
            return StoreUnavailable(f"{what}: cannot reach S3 endpoint {self.endpoint}: {cause}",
                                    hint="check --s3-endpoint / AWS_ENDPOINT_URL and that the "
                                         "server is up; retried with backoff before giving up")
        return StoreError(f"{what}: {type(e).__name__}: {e}")

    def _call(self, what: str, fn, /, *args, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except (ClientError, BotoCoreError) as e:
            raise self._fail(e, what) from e

    def _get_object(self, key: str, **kwargs) -> dict | None:
        """GET, or ``None`` if the key does not exist."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=key, **kwargs)
        except ClientError as e:
            if _code(e) in _NOT_FOUND:
                return None
            raise self._fail(e, f"read {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"read {self._where(key)}") from e

    def _read_small(self, key: str) -> tuple[bytes, str] | None:
        """Bytes and ETag of a small object (a ref, record or index: JSON), or ``None`` if
        absent; at most ``MAX_JSON_BYTES + 1`` bytes are read (``load_json`` refuses more)."""
        resp = self._get_object(key)
        if resp is None:
            return None
        with resp["Body"] as body:
            data = self._call(f"read {self._where(key)}", body.read, MAX_JSON_BYTES + 1)
        return data, resp.get("ETag", "")

    def _put_small(self, key: str, data: bytes, **cond) -> bool:
        """PUT; with a condition (``IfMatch``/``IfNoneMatch``) return False on 412/409/404."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **cond)
            return True
        except ClientError as e:
            code = _code(e)
            if cond and (code in _CONFLICT or _status(e) in ("412", "409")
                         or (code in _NOT_FOUND and "IfMatch" in cond)):
                return False
            raise self._fail(e, f"write {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"write {self._where(key)}") from e

    def _list(self, rel_prefix: str, delimiter: str | None = None) -> Iterator[str]:
        """Keys (relative to ``rel_prefix``) under ``PREFIX/rel_prefix``."""
        full = self._key(rel_prefix)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        paginator = self.client.get_paginator("list_objects_v2")
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in paginator.paginate(**kwargs):
                for obj in page.get("Contents", ()):
                    yield obj["Key"][len(full):]
        except (ClientError, BotoCoreError) as e:
            raise self._fail(e, f"list {self._where(full)}") from e

    def _open(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self._key(VERSION_KEY)
        try:
            resp = self._probe_client.get_object(Bucket=self.bucket, Key=key)
            meta = resp["Body"].read()
        except ClientError as e:
            if _code(e) not in _NOT_FOUND:
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

    @property  # type: ignore[override]
    def supports_cas(self) -> bool:
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
        first = _read_exact(data, self.part_size)
        if len(first) == self.part_size and (size is None or size > len(first)):
            more = data.read(1) if size is None else b"?"
            if more:  # more than one part: multipart (an unsized stream's peeked byte rides along)
                if size is None:
                    first += more
                handover = [first]
                del first  # the upload frees each part once sent: hold no reference here
                return self._put_multipart(digest, key, data, handover, size)
        actual = "sha256:" + hashlib.sha256(first).hexdigest()
        if actual != digest or (size is not None and len(first) != size):
            raise mismatch_on_put(digest, actual, len(first), size)
        self._put_created(key, first, digest)

    def _put_created(self, key: str, data: bytes, digest: str) -> None:
        sha = base64.b64encode(bytes.fromhex(check_digest(digest))).decode()
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*",
                                   ChecksumSHA256=sha)
        except ClientError as e:
            if _code(e) in _CONFLICT or _status(e) in ("412", "409"):
                return  # stored concurrently by someone else: same bytes, success
            raise self._fail(e, f"write blob {digest} to {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"write blob {digest} to {self._where(key)}") from e

    def _put_multipart(self, digest: str, key: str, data: BinaryIO, handover: list[bytearray],
                       size: int | None) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        what = f"upload blob {digest} to {self._where(key)}"
        upload_id = self._call(what, self.client.create_multipart_upload, Bucket=self.bucket,
                               Key=key)["UploadId"]
        h, count = hashlib.sha256(), 0
        parts: dict[int, str] = {}
        slots = threading.BoundedSemaphore(self.concurrency)
        futures: list[concurrent.futures.Future] = []
        completed = False

        def upload(number: int, body: bytes) -> None:
            try:
                resp = self._call(what, self.client.upload_part, Bucket=self.bucket, Key=key,
                                  UploadId=upload_id, PartNumber=number, Body=body)
                parts[number] = resp["ETag"]
            finally:
                slots.release()

        pool = concurrent.futures.ThreadPoolExecutor(self.concurrency,
                                                     thread_name_prefix="s3-put")
        slots.acquire()  # the slot of the part being read (``first``)
        try:
            number, body, peeked = 1, handover.pop(), b""
            if len(body) > self.part_size:  # an unsized stream's peeked byte starts part 2
                peeked = bytes(body[self.part_size:])
                del body[self.part_size:]
            while body:
                # hashed in order before it is handed over (parts may upload out of order)
                h.update(body)
                count += len(body)
                futures.append(pool.submit(upload, number, body))
                number += 1
                del body  # the pool holds the only reference: freed once uploaded
                # a slot is taken before the next part is read: at most ``concurrency`` parts
                # exist at once, including the one being read
                slots.acquire()
                for f in futures:
                    if f.done() and f.exception():
                        slots.release()
                        raise f.exception()  # type: ignore[misc]
                if peeked:
                    body = bytearray(peeked) + _read_exact(data, self.part_size - len(peeked))
                    peeked = b""
                else:
                    body = _read_exact(data, self.part_size)
            slots.release()
            for f in futures:
                f.result()
            actual = "sha256:" + h.hexdigest()
            if actual != digest or (size is not None and count != size):
                raise mismatch_on_put(digest, actual, count, size)
            try:
                self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, IfNoneMatch="*",
                    MultipartUpload={"Parts": [{"PartNumber": n, "ETag": parts[n]}
                                               for n in sorted(parts)]})
                completed = True
            except ClientError as e:
                if not (_code(e) in _CONFLICT or _status(e) in ("412", "409")):
                    raise self._fail(e, what) from e
                # stored concurrently by someone else: success (our upload is aborted below)
            except BotoCoreError as e:
                raise self._fail(e, what) from e
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if not completed:
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                       UploadId=upload_id)
                except Exception:  # noqa: BLE001 - best effort; lifecycle rules clean up
                    pass

    def get(self, digest: str) -> BinaryIO:
        key = self._blob_key(digest)
        if self.parallel_get and self.concurrency > 1 and self.fast_ranges:
            size = self.stat(digest).size
            if size >= self.parallel_get:
                raw: io.RawIOBase = _ParallelBody(self, digest, key, size)
                return VerifyingReader(raw, digest, size=size,  # type: ignore[return-value]
                                       location=self._where(key))
        resp = self._get_object(key)
        if resp is None:
            raise blob_not_found(digest)
        raw = _ResumingBody(self, key, resp)
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

    def _boto_range(self, digest: str, key: str, offset: int, length: int) -> tuple[int, bytes]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=key,
                                          Range=f"bytes={offset}-{offset + length - 1}")
            with resp["Body"] as body:
                return 206, body.read()
        except ClientError as e:
            code = _code(e)
            if code in _NOT_FOUND:
                raise blob_not_found(digest) from None
            if code in ("InvalidRange", "416"):
                return 416, b""
            raise self._fail(e, f"read range of {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"read range of {self._where(key)}") from e

    # Ranged reads are the hot path of lazy layers: boto3 spends ~2.4 ms of CPU per request
    # (MACHINE-NOTES), plain http.client ~0.5 ms. So ranges go through envbuild.store._http
    # (keep-alive connections per thread) to a presigned URL of the object (the signature
    # covers the host, not the Range header; one URL serves every range of a blob until shortly
    # before it expires), with the same bounded retries as botocore's standard mode.
    _PRESIGN_SECONDS = 900

    def _presign(self, key: str) -> str:
        now = time.monotonic()
        got = self._presigned.get(key)
        if got is None or got[1] < now:
            url = self.client.generate_presigned_url(
                "get_object", Params={"Bucket": self.bucket, "Key": key},
                ExpiresIn=self._PRESIGN_SECONDS)
            got = (url, now + self._PRESIGN_SECONDS - 60)
            if len(self._presigned) > 4096:
                self._presigned.clear()
            self._presigned[key] = got
        return got[0]

    def presigned_get_url(self, digest: str, expires: int = 12 * 3600) -> str:
        """A presigned GET URL of blob ``digest``, valid ``expires`` seconds (less if the
        credentials expire sooner): lets another process read ranges without boto3
        (``envbuild.store.lazy.HttpRanges``). The ``Presigner`` capability."""
        if expires <= 0:
            raise StoreError(f"presigned URL lifetime must be positive, not {expires}")
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._blob_key(digest)},
            ExpiresIn=expires)

    def presigned_get_record_url(self, namespace: str, name: str, expires: int = 3600) -> str:
        """A presigned GET URL of record ``namespace/name`` (the ``Presigner`` capability):
        answers the record's bytes (``404`` while it is absent)."""
        if expires <= 0:
            raise StoreError(f"presigned URL lifetime must be positive, not {expires}")
        return self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket,
                                  "Key": self._record_key(namespace, name)},
            ExpiresIn=expires)

    def presigned_put_record_url(self, namespace: str, name: str, expires: int = 3600) -> str:
        """A presigned PUT URL of record ``namespace/name`` (the ``Presigner`` capability):
        its body is the record's bytes, stored as ``put_record`` stores them."""
        if expires <= 0:
            raise StoreError(f"presigned URL lifetime must be positive, not {expires}")
        return self.client.generate_presigned_url(
            "put_object", Params={"Bucket": self.bucket,
                                  "Key": self._record_key(namespace, name)},
            ExpiresIn=expires)

    def _fast_range(self, key: str, offset: int, length: int) -> tuple[int, bytes]:
        """``(status, body)`` of a ranged GET: 206/200 with the bytes, 404, or 416."""
        resp = self._ranges.get(self._presign(key), offset, length)
        if resp.status == 403:
            self._presigned.pop(key, None)  # expired or clock skew: sign again, once
            resp = self._ranges.get(self._presign(key), offset, length)
        if resp.ok or resp.status in (404, 416):
            return resp.status, resp.body
        if resp.status == 403:
            raise StoreUnavailable(f"read range of {self._where(key)}: access denied "
                                   "(HTTP 403)", hint="check the credentials and the bucket "
                                                      "policy")
        if resp.status == 0:
            raise StoreUnavailable(f"read range of {self._where(key)}: cannot reach S3 endpoint "
                                   f"{self.endpoint}: {resp.error}",
                                   hint="check --s3-endpoint / AWS_ENDPOINT_URL and that the "
                                        "server is up")
        raise StoreError(f"read range of {self._where(key)}: HTTP {resp.status} "
                         f"{resp.error or resp.body[:200].decode('utf-8', 'replace')}")

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
            if isinstance(cause, ClientError) and _code(cause) in ("InvalidRange", "416"):
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
            if _code(e) in _NOT_FOUND:
                raise blob_not_found(digest) from None
            raise self._fail(e, f"stat {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"stat {self._where(key)}") from e
        return BlobInfo(digest, resp["ContentLength"], _timestamp(resp.get("LastModified")))

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
            if len(name) == 64 and _HEX.issuperset(name):
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
                    if len(name) == 64 and _HEX.issuperset(name):
                        yield BlobInfo("sha256:" + name, obj["Size"],
                                       _timestamp(obj.get("LastModified")))
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
                                       _timestamp(up.get("Initiated")) or 0.0)
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
            if _code(e) not in _NOT_FOUND and _code(e) != "NoSuchUpload":
                raise self._fail(e, f"abort upload to {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"abort upload to {self._where(key)}") from e

    # -- refs ----------------------------------------------------------------------------------

    def _ref_key(self, name: str) -> str:
        return self._key(REFS_DIR + check_ref_name(name))

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
                    raise RefConflict(name, expect,  # type: ignore[arg-type]
                                      now[0]["digest"] if now else None)
        self._update_index(name)
        return desc

    def get_ref(self, name: str) -> Descriptor:
        current = self._read_ref(name)
        if current is None:
            raise ref_not_found(name)
        desc = Descriptor.from_oci(current[0])
        ann = {k: v for k, v in desc.annotations.items() if k != REF_NAME_ANNOTATION}
        return Descriptor(desc.media_type, desc.digest, desc.size, ann)

    def list_refs(self) -> list[str]:
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

    def _record_key(self, namespace: str, name: str) -> str:
        check_record_name(namespace, name)
        return self._key(f"{namespace}/{name}")

    def put_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> None:
        key = self._record_key(namespace, name)
        self._put_small(key, encode_record(obj))

    def get_record(self, namespace: str, name: str) -> dict[str, Any] | None:
        key = self._record_key(namespace, name)
        got = self._read_small(key)
        return None if got is None else decode_record(got[0], self._where(key))

    def list_records(self, namespace: str) -> list[str]:
        check_record_name(namespace, "x")
        return sorted(n for n in self._list(namespace + "/", delimiter="/")
                      if n and not n.startswith("."))

    def record_mtime(self, namespace: str, name: str) -> float | None:
        key = self._record_key(namespace, name)
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if _code(e) in _NOT_FOUND:
                return None
            raise self._fail(e, f"stat {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"stat {self._where(key)}") from e
        return _timestamp(resp.get("LastModified"))

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
            if _code(e) in _CONFLICT or _code(e) in _NOT_FOUND or _status(e) in ("412", "409"):
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
            if _code(e) in _CONFLICT or _code(e) in _NOT_FOUND or _status(e) in ("412", "409"):
                return False
            raise self._fail(e, f"delete {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"delete {self._where(key)}") from e
        return True

def _timestamp(value: Any) -> float | None:
    """Seconds since the epoch of a botocore datetime (``LastModified``, ``Initiated``)."""
    return value.timestamp() if hasattr(value, "timestamp") else None


def _valid_ref(name: str) -> bool:
    try:
        check_ref_name(name)
    except StoreError:
        return False
    return True


def _read_exact(f: BinaryIO, n: int) -> bytearray:
    """Up to ``n`` bytes into one buffer (no intermediate copies); fewer only at the end."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    readinto = getattr(f, "readinto", None)
    while got < n:
        if readinto is not None:
            k = readinto(view[got:])
        else:
            chunk = f.read(n - got)
            k = len(chunk)
            view[got:got + k] = chunk
        if not k:
            break
        got += k
    view.release()
    if got < n:
        del buf[got:]
    return buf


class _ParallelBody(io.RawIOBase):
    """A large blob read as parallel ranged GETs of ``part_size``, returned in order; at most
    ``concurrency`` ranges are in flight or buffered (memory: ``concurrency * part_size``)."""

    def __init__(self, store: S3Store, digest: str, key: str, size: int) -> None:
        super().__init__()
        self._store, self._digest, self._key, self._size = store, digest, key, size
        self._pool = concurrent.futures.ThreadPoolExecutor(store.concurrency,
                                                           thread_name_prefix="s3-get")
        self._next = 0  # next range offset to request
        self._pending: list[concurrent.futures.Future] = []
        self._buf = memoryview(b"")
        self._fill()

    def _fetch(self, offset: int) -> bytes:
        length = min(self._store.part_size, self._size - offset)
        status, data = self._store._fast_range(self._key, offset, length)
        if status == 404:
            raise blob_not_found(self._digest)
        return data  # short if the object changed under us: VerifyingReader reports it

    def _fill(self) -> None:
        while self._next < self._size and len(self._pending) < self._store.concurrency:
            self._pending.append(self._pool.submit(self._fetch, self._next))
            self._next += self._store.part_size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while not self._buf:
            if not self._pending:
                return 0
            self._buf = memoryview(self._pending.pop(0).result())
            self._fill()
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            for f in self._pending:
                f.cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pending.clear()
            self._buf = memoryview(b"")
        super().close()


class _ResumingBody(io.RawIOBase):
    """An object's body that resumes with a ranged GET (pinned by ETag) if the connection breaks.

    botocore retries requests, not a body half read; this covers that case, at most
    ``store.resume_attempts`` times per stream."""

    def __init__(self, store: S3Store, key: str, resp: dict) -> None:
        super().__init__()
        self._store = store
        self._key = key
        self._body = resp["Body"]
        self._etag = resp.get("ETag")
        self._size = resp["ContentLength"]
        self._pos = 0
        self._resumes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        from botocore.exceptions import BotoCoreError
        from urllib3.exceptions import HTTPError as Urllib3Error

        view = memoryview(buffer).cast("B")
        while True:
            try:
                chunk = self._body.read(len(view))
            except (BotoCoreError, Urllib3Error, OSError) as e:
                self._resume(e)
                continue
            if not chunk and self._pos < self._size:
                self._resume(None)  # closed early without an error
                continue
            n = len(chunk)
            view[:n] = chunk
            self._pos += n
            return n

    def _resume(self, cause: BaseException | None) -> None:
        store = self._store
        where = store._where(self._key)
        if self._resumes >= store.resume_attempts:
            why = f"{type(cause).__name__}: {cause}" if cause else "the connection closed early"
            raise StoreUnavailable(f"read {where}: broke off at byte {self._pos} of "
                                   f"{self._size} ({why})",
                                   hint="the S3 endpoint dropped the connection repeatedly; "
                                        "retry later")
        self._resumes += 1
        time.sleep(random.uniform(0, 0.2 * (2 ** self._resumes)))
        try:
            self._body.close()
        except Exception:  # noqa: BLE001
            pass
        extra = {"IfMatch": self._etag} if self._etag else {}
        resp = store._get_object(self._key, Range=f"bytes={self._pos}-", **extra)
        if resp is None:
            raise StoreError(f"read {where}: the object disappeared while it was read")
        self._body = resp["Body"]

    def close(self) -> None:
        if not self.closed:
            try:
                self._body.close()
            except Exception:  # noqa: BLE001
                pass
        super().close()
