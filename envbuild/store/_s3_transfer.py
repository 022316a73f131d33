"""Moving blob bytes to and from S3 for ``S3Store``: the parallel multipart upload of a large
blob (hashed in order while ``concurrency`` parts upload; completed only if the digest
matched, aborted otherwise), and the two read streams: one GET resumed with a ranged GET
pinned to the ETag when its connection breaks, and parallel ranged GETs of a large blob
returned in order."""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import random
import threading
import time
from typing import Any, BinaryIO

from envbuild.errors import StoreError, StoreUnavailable
from envbuild.store._s3_client import CONFLICT, S3Objects, error_code, http_status
from envbuild.store.base import blob_not_found, mismatch_on_put


def read_exact(f: BinaryIO, n: int) -> bytearray:
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


class ParallelBody(io.RawIOBase):
    """A large blob read as parallel ranged GETs of ``part_size``, returned in order; at most
    ``concurrency`` ranges are in flight or buffered (memory: ``concurrency * part_size``)."""

    def __init__(self, store: S3Objects, digest: str, key: str, size: int) -> None:
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


class ResumingBody(io.RawIOBase):
    """An object's body that resumes with a ranged GET (pinned by ETag) if the connection breaks.

    botocore retries requests, not a body half read; this covers that case, at most
    ``store.resume_attempts`` times per stream."""

    def __init__(self, store: S3Objects, key: str, resp: dict) -> None:
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


class MultipartUpload:
    """One multipart upload of blob ``digest`` to ``key``: parts are hashed in order before
    they are handed to ``concurrency`` uploading threads (memory: ``(concurrency + 1) *
    part_size``); ``run`` completes the upload only if the digest (and size) matched, and
    aborts it otherwise or on any failure, so a half or wrong blob is never visible."""

    def __init__(self, objs: S3Objects, digest: str, key: str) -> None:
        self.objs, self.digest, self.key = objs, digest, key
        self.what = f"upload blob {digest} to {objs._where(key)}"
        self.upload_id = objs._call(self.what, objs.client.create_multipart_upload,
                                    Bucket=objs.bucket, Key=key)["UploadId"]
        self.hash, self.count = hashlib.sha256(), 0
        self.parts: dict[int, str] = {}
        self.slots = threading.BoundedSemaphore(objs.concurrency)
        self.futures: list[concurrent.futures.Future] = []

    def run(self, data: BinaryIO, handover: list[bytearray], size: int | None) -> None:
        """Upload ``handover``'s one part (taken from the list: the caller keeps no
        reference) and the rest of ``data``."""
        objs, completed = self.objs, False
        pool = concurrent.futures.ThreadPoolExecutor(objs.concurrency,
                                                     thread_name_prefix="s3-put")
        self.slots.acquire()  # the slot of the part being read (``first``)
        try:
            self._send_parts(pool, data, handover)
            self.slots.release()
            for f in self.futures:
                f.result()
            actual = "sha256:" + self.hash.hexdigest()
            if actual != self.digest or (size is not None and self.count != size):
                raise mismatch_on_put(self.digest, actual, self.count, size)
            completed = self._complete()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if not completed:
                try:
                    objs.client.abort_multipart_upload(Bucket=objs.bucket, Key=self.key,
                                                       UploadId=self.upload_id)
                except Exception:  # noqa: BLE001 - best effort; lifecycle rules clean up
                    pass

    def _upload(self, number: int, body: bytes | bytearray) -> None:
        objs = self.objs
        try:
            resp = objs._call(self.what, objs.client.upload_part, Bucket=objs.bucket,
                              Key=self.key, UploadId=self.upload_id, PartNumber=number,
                              Body=body)
            self.parts[number] = resp["ETag"]
        finally:
            self.slots.release()

    def _send_parts(self, pool: concurrent.futures.ThreadPoolExecutor, data: BinaryIO,
                    handover: list[bytearray]) -> None:
        part_size = self.objs.part_size
        number, body, peeked = 1, handover.pop(), b""
        if len(body) > part_size:  # an unsized stream's peeked byte starts part 2
            peeked = bytes(body[part_size:])
            del body[part_size:]
        while body:
            # hashed in order before it is handed over (parts may upload out of order)
            self.hash.update(body)
            self.count += len(body)
            self.futures.append(pool.submit(self._upload, number, body))
            number += 1
            del body  # the pool holds the only reference: freed once uploaded
            # a slot is taken before the next part is read: at most ``concurrency`` parts
            # exist at once, including the one being read
            self.slots.acquire()
            for f in self.futures:
                if f.done() and f.exception():
                    self.slots.release()
                    raise f.exception()  # type: ignore[misc]
            if peeked:
                body = bytearray(peeked) + read_exact(data, part_size - len(peeked))
                peeked = b""
            else:
                body = read_exact(data, part_size)

    def _complete(self) -> bool:
        """Complete the upload; False if a concurrent put stored the blob first (success:
        ours is aborted)."""
        from botocore.exceptions import BotoCoreError, ClientError

        objs = self.objs
        try:
            objs.client.complete_multipart_upload(
                Bucket=objs.bucket, Key=self.key, UploadId=self.upload_id, IfNoneMatch="*",
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": self.parts[n]}
                                           for n in sorted(self.parts)]})
            return True
        except ClientError as e:
            if not (error_code(e) in CONFLICT or http_status(e) in ("412", "409")):
                raise objs._fail(e, self.what) from e
            return False
        except BotoCoreError as e:
            raise objs._fail(e, self.what) from e
