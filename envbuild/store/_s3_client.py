"""The S3 side of ``S3Store``: the boto3 clients and their configuration, the key layout
under the store's prefix, error mapping (one line with a hint), small-object reads and
conditional writes, listing, and ranged reads over presigned URLs. ``S3Store``
(``envbuild.store.s3``) builds the store contract on top.

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

import threading
import time
from collections.abc import Iterator
from typing import Any

from envbuild.canonical import MAX_JSON_BYTES
from envbuild.errors import StoreError, StoreUnavailable
from envbuild.store._http import Backoff, RangeClient
from envbuild.store.base import blob_not_found, check_digest, check_record_name, check_ref_name

REFS_DIR = "refs.d/"
BLOBS_DIR = "blobs/sha256/"
MiB = 1 << 20
NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
CONFLICT = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
           "ExpiredToken", "InvalidToken", "AllAccessDisabled"}


def parse_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` → ``(bucket, prefix)`` with ``prefix`` "" or ending in "/"."""
    from envbuild.errors import SettingsError

    rest = url[len("s3://"):] if url.startswith("s3://") else None
    bucket, _, prefix = (rest or "").partition("/")
    if not bucket:
        raise SettingsError(f"bad S3 store URL {url!r}", hint="use s3://BUCKET or s3://BUCKET/PREFIX")
    prefix = "/".join(p for p in prefix.split("/") if p)
    return bucket, (prefix + "/" if prefix else "")


def error_code(e: BaseException) -> str:
    resp = getattr(e, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    status = str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code if code and not code.isdigit() else (status or code)


def http_status(e: BaseException) -> str:
    resp = getattr(e, "response", None) or {}
    return str(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def timestamp(value: Any) -> float | None:
    """Seconds since the epoch of a botocore datetime (``LastModified``, ``Initiated``)."""
    return value.timestamp() if hasattr(value, "timestamp") else None


class S3Objects:
    """Objects under ``s3://bucket/prefix``: the clients, keys and calls ``S3Store`` is made
    of. The constructor's parameters are ``S3Store``'s (its docstring); it ends by calling
    ``_open`` (``S3Store`` checks or writes its layout there)."""

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

    def _open(self) -> None:
        """Check the store once its clients exist (``S3Store``: its version and layout)."""

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _key(self, rel: str) -> str:
        return self.prefix + rel

    def _blob_key(self, digest: str) -> str:
        return self._key(BLOBS_DIR + check_digest(digest))

    def _ref_key(self, name: str) -> str:
        return self._key(REFS_DIR + check_ref_name(name))

    def _record_key(self, namespace: str, name: str) -> str:
        check_record_name(namespace, name)
        return self._key(f"{namespace}/{name}")

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
            code = error_code(e)
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
            if error_code(e) in NOT_FOUND:
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
            code = error_code(e)
            if cond and (code in CONFLICT or http_status(e) in ("412", "409")
                         or (code in NOT_FOUND and "IfMatch" in cond)):
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

    def _boto_range(self, digest: str, key: str, offset: int, length: int) -> tuple[int, bytes]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=key,
                                          Range=f"bytes={offset}-{offset + length - 1}")
            with resp["Body"] as body:
                return 206, body.read()
        except ClientError as e:
            code = error_code(e)
            if code in NOT_FOUND:
                raise blob_not_found(digest) from None
            if code in ("InvalidRange", "416"):
                return 416, b""
            raise self._fail(e, f"read range of {self._where(key)}") from e
        except BotoCoreError as e:
            raise self._fail(e, f"read range of {self._where(key)}") from e
