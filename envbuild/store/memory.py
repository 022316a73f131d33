"""``MemoryStore``: the in-process fake for tests (``memory://``).

It follows the ``Store`` contract exactly (the conformance suite runs against it) and counts
calls, so a test can assert "put once, then a cache hit"::

    store = MemoryStore()
    build(store); build(store)
    assert store.calls["put"] == 1
"""

from __future__ import annotations

import builtins
import collections
import hashlib
import io
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from envbuild.store.base import (
    ANY,
    MEDIA_TYPE_MANIFEST,
    BlobInfo,
    ConditionalRecords,
    Descriptor,
    RefConflict,
    Store,
    VerifyingReader,
    _Any,
    blob_not_found,
    check_digest,
    check_expect,
    check_range,
    check_record_name,
    check_ref_name,
    decode_record,
    encode_record,
    iter_chunks,
    make_descriptor,
    mismatch_on_put,
    range_beyond_end,
    ref_not_found,
)


class MemoryStore(Store, ConditionalRecords):
    """A ``Store`` in a few dicts. ``calls`` counts every public method call by name.

    ``blobs`` maps digest to bytes and is public so tests can corrupt a blob on purpose;
    ``mtimes`` (digest -> time of the ``put``) and ``record_mtimes`` are public so tests can age
    a blob or record for GC. A blob without an entry in ``mtimes`` has an unknown age.
    """

    supports_cas = True

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.mtimes: dict[str, float] = {}
        self.record_mtimes: dict[tuple[str, str], float] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self._refs: dict[str, Descriptor] = {}
        self._records: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MemoryStore({len(self.blobs)} blobs, {len(self._refs)} refs)"

    # -- blobs ---------------------------------------------------------------------------------

    def put(self, digest: str, data: bytes | BinaryIO, *, size: int | None = None) -> None:
        self.calls["put"] += 1
        check_digest(digest)
        if digest in self.blobs:
            return
        h, parts, count = hashlib.sha256(), [], 0
        for chunk in iter_chunks(data):
            h.update(chunk)
            parts.append(chunk)
            count += len(chunk)
        actual = "sha256:" + h.hexdigest()
        if actual != digest or (size is not None and count != size):
            raise mismatch_on_put(digest, actual, count, size)
        with self._lock:
            if digest not in self.blobs:
                self.blobs[digest] = b"".join(parts)
                self.mtimes[digest] = time.time()

    def get(self, digest: str) -> BinaryIO:
        self.calls["get"] += 1
        data = self._blob(digest)
        return VerifyingReader(io.BytesIO(data), digest, size=len(data),
                               location=f"memory://{digest}")  # type: ignore[return-value]

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        self.calls["get_range"] += 1
        check_range(offset, length)
        data = self._blob(digest)
        if offset > len(data):
            raise range_beyond_end(digest, offset, len(data))
        return data[offset:offset + length]

    def stat(self, digest: str) -> BlobInfo:
        self.calls["stat"] += 1
        return BlobInfo(digest, len(self._blob(digest)), self.mtimes.get(digest))

    def exists(self, digest: str) -> bool:
        self.calls["exists"] += 1
        check_digest(digest)
        return digest in self.blobs

    def delete(self, digest: str) -> None:
        self.calls["delete"] += 1
        check_digest(digest)
        self.blobs.pop(digest, None)
        self.mtimes.pop(digest, None)

    def list(self) -> Iterator[str]:
        self.calls["list"] += 1
        return iter(list(self.blobs))

    def _blob(self, digest: str) -> bytes:
        check_digest(digest)
        try:
            return self.blobs[digest]
        except KeyError:
            raise blob_not_found(digest) from None

    # -- refs ----------------------------------------------------------------------------------

    def put_ref(self, name: str, digest: str, *, media_type: str = MEDIA_TYPE_MANIFEST,
                annotations: Mapping[str, str] | None = None,
                expect: str | None | _Any = ANY) -> Descriptor:
        self.calls["put_ref"] += 1
        check_ref_name(name)
        check_expect(self, expect)
        desc = make_descriptor(media_type, digest, len(self._blob(digest)), annotations)
        with self._lock:
            if expect is not ANY:
                current = self._refs.get(name)
                current_digest = current.digest if current else None
                if current_digest != expect:
                    raise RefConflict(name, expect, current_digest)
            self._refs[name] = desc
        return desc

    def get_ref(self, name: str) -> Descriptor:
        self.calls["get_ref"] += 1
        check_ref_name(name)
        try:
            return self._refs[name]
        except KeyError:
            raise ref_not_found(name) from None

    def list_refs(self) -> builtins.list[str]:
        self.calls["list_refs"] += 1
        return sorted(self._refs)

    def delete_ref(self, name: str) -> None:
        self.calls["delete_ref"] += 1
        check_ref_name(name)
        self._refs.pop(name, None)

    # -- records -------------------------------------------------------------------------------

    def put_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> None:
        self.calls["put_record"] += 1
        key = check_record_name(namespace, name)
        self._records[key] = encode_record(obj)
        self.record_mtimes[key] = time.time()

    def get_record(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls["get_record"] += 1
        key = check_record_name(namespace, name)
        data = self._records.get(key)
        return None if data is None else decode_record(data, f"{namespace}/{name}")

    def list_records(self, namespace: str) -> builtins.list[str]:
        self.calls["list_records"] += 1
        check_record_name(namespace, "x")
        return sorted(n for ns, n in self._records if ns == namespace)

    def delete_record(self, namespace: str, name: str) -> None:
        self.calls["delete_record"] += 1
        key = check_record_name(namespace, name)
        self._records.pop(key, None)
        self.record_mtimes.pop(key, None)

    def record_mtime(self, namespace: str, name: str) -> float | None:
        key = check_record_name(namespace, name)
        return self.record_mtimes.get(key) if key in self._records else None

    # -- conditional records (ConditionalRecords; tag: sha256 of the bytes) -----------------

    def get_record_tagged(self, namespace: str, name: str) -> tuple[dict[str, Any], str] | None:
        key = check_record_name(namespace, name)
        with self._lock:
            data = self._records.get(key)
        if data is None:
            return None
        return decode_record(data, f"{namespace}/{name}"), hashlib.sha256(data).hexdigest()

    def create_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> str | None:
        key = check_record_name(namespace, name)
        data = encode_record(obj)
        with self._lock:
            if key in self._records:
                return None
            self._records[key] = data
            self.record_mtimes[key] = time.time()
        return hashlib.sha256(data).hexdigest()

    def replace_record(self, namespace: str, name: str, obj: Mapping[str, Any],
                       tag: str) -> str | None:
        key = check_record_name(namespace, name)
        data = encode_record(obj)
        with self._lock:
            current = self._records.get(key)
            if current is None or hashlib.sha256(current).hexdigest() != tag:
                return None
            self._records[key] = data
            self.record_mtimes[key] = time.time()
        return hashlib.sha256(data).hexdigest()

    def delete_record_if(self, namespace: str, name: str, tag: str) -> bool:
        key = check_record_name(namespace, name)
        with self._lock:
            current = self._records.get(key)
            if current is None or hashlib.sha256(current).hexdigest() != tag:
                return False
            del self._records[key]
            self.record_mtimes.pop(key, None)
        return True
