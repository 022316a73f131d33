"""Blob uploads to a registry (distribution spec "pushing blobs").

``POST /blobs/uploads/`` opens a session; a blob up to ``chunk_size`` then goes in one
``PUT ?digest=`` with the body (monolithic), a larger one as ``PATCH`` chunks of ``chunk_size``
with ``Content-Range`` and a final ``PUT ?digest=`` (chunked; a chunk that fails is resumed
from the offset the registry reports). The bytes are hashed as they are read; the closing
``PUT`` is sent only if they match ``digest`` (and ``size``), otherwise the session is
cancelled (``DELETE``): the registry never holds a wrong blob, and it checks the digest too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import urllib.parse
from typing import BinaryIO

from envbuild.errors import DigestMismatch, StoreError, StoreUnavailable
from envbuild.store._registry_http import RETRY_STATUS, RegistryClient, _Response
from envbuild.store.base import check_digest, mismatch_on_put


def blob_url(base: str, digest: str) -> str:
    check_digest(digest)
    return f"{base}/blobs/{digest}"


def head_blob(http: RegistryClient, base: str, digest: str) -> int | None:
    """The size of blob ``digest`` in the repository at ``base``, ``None`` if absent."""
    resp = http.request("HEAD", blob_url(base, digest), what=f"stat blob {digest} in")
    if resp.status == 200:
        return int(resp.header("Content-Length", "0"))
    if resp.status == 404:
        return None
    raise http.status_error(resp, f"stat blob {digest} in")


def start_upload(http: RegistryClient, base: str, extra: str = "") -> _Response:
    return http.request("POST", f"{base}/blobs/uploads/{extra}", what="start upload to")


def upload_blob(http: RegistryClient, base: str, digest: str, data: BinaryIO,
                size: int | None, chunk_size: int) -> None:
    """Upload ``data`` as blob ``digest`` (the module docstring); nothing is stored unless it
    hashes to ``digest`` and is ``size`` bytes long (if given)."""
    resp = start_upload(http, base)
    if resp.status != 202 or not resp.header("Location"):
        raise http.status_error(resp, "start upload to")
    session = _Session(urllib.parse.urljoin(resp.url, resp.header("Location")))
    done = False
    try:
        body, actual, count = _send_chunks(http, session, data, size, chunk_size)
        location = session.location
        if actual != digest or (size is not None and count != size):
            raise mismatch_on_put(digest, actual, count, size)
        sep = "&" if urllib.parse.urlsplit(location).query else "?"
        resp = http.request("PUT", f"{location}{sep}digest={digest}", body=body,
                            what=f"upload blob {digest} to")
        if resp.status == 400 and resp.error_code() == "DIGEST_INVALID":
            raise DigestMismatch(f"refusing to store blob {digest}: the registry "
                                 "computed another digest for the bytes it received",
                                 hint="a proxy altered the upload; nothing was stored")
        if resp.status != 201 and head_blob(http, base, digest) is None:
            # (a PUT retried after a dropped answer finds its session closed, but the
            # blob stored: that is success)
            raise http.status_error(resp, f"upload blob {digest} to")
        done = True
    finally:
        if not done:
            try:  # cancel the session: a registry keeps partial uploads otherwise
                http.request("DELETE", session.location, attempts=1, what="cancel upload to")
            except StoreError:
                pass


@dataclasses.dataclass
class _Session:
    """An upload session: where its next request goes (the registry moves it on each PATCH)."""

    location: str


def _send_chunks(http: RegistryClient, session: _Session, data: BinaryIO, size: int | None,
                 chunk_size: int) -> tuple[bytes | None, str, int]:
    """Read ``data`` to its end (at most ``size`` + 1 bytes), PATCHing chunks unless it all
    fits in one: ``(body of the closing PUT, digest read, bytes read)``."""
    h, count, first = hashlib.sha256(), 0, True
    limit = None if size is None else size + 1  # one byte more proves "too long"
    while True:
        want = chunk_size if limit is None else min(chunk_size, limit - count)
        chunk = read_full(data, want) if want > 0 else b""
        h.update(chunk)
        count += len(chunk)
        final = len(chunk) < want or want == 0
        if final and first:
            # small blob: the body goes with the closing PUT (monolithic)
            return chunk, "sha256:" + h.hexdigest(), count
        first = False
        if chunk:
            session.location = _patch(http, session.location, chunk, count - len(chunk))
        if final:
            return None, "sha256:" + h.hexdigest(), count


def _patch(http: RegistryClient, location: str, chunk: bytes, start: int) -> str:
    """Send one chunk at ``start`` of an upload; on failure resume from the offset the
    registry has; returns the next upload location."""
    offset = 0
    for attempt in range(http.attempts):
        piece = chunk[offset:]
        try:
            resp = http.request(
                "PATCH", location, body=piece, attempts=1, what="upload chunk to",
                headers={"Content-Range": f"{start + offset}-{start + len(chunk) - 1}"})
        except StoreUnavailable:
            resp = None
        if resp is not None and resp.status == 202:
            return urllib.parse.urljoin(resp.url, resp.header("Location") or location)
        if resp is not None and resp.status not in RETRY_STATUS:
            raise http.status_error(resp, "upload chunk to")
        if attempt + 1 >= http.attempts:
            break
        http.sleep(attempt + 1)
        location, kept = _upload_status(http, location)
        if not start <= kept <= start + len(chunk):
            raise StoreError(f"upload to {http.url}: the registry holds {kept} bytes of "
                             f"an upload at byte {start}; cannot resume")
        offset = kept - start
        if offset == len(chunk):
            return location
    raise StoreUnavailable(f"upload to {http.url}: a chunk failed {http.attempts} times",
                           hint="the registry or the network is failing; retry later")


def _upload_status(http: RegistryClient, location: str) -> tuple[str, int]:
    """How much of the upload the registry kept: ``(next location, bytes kept)``."""
    status = http.request("GET", location, what="check upload to")
    if status.status != 204:
        raise http.status_error(status, "check upload to")
    location = urllib.parse.urljoin(status.url, status.header("Location") or location)
    have = status.header("Range").rpartition("-")[2]
    return location, int(have) + 1 if have.isdigit() else 0


def read_full(f: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes; fewer only at the end of ``f``."""
    parts, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts) if len(parts) != 1 else parts[0]
