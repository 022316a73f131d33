"""``RegistryStore``: the store in a repository of an OCI registry (distribution spec v1.1).

URL: ``docker://HOST[:PORT]/REPO`` — the transport syntax of skopeo and podman, without a tag
(a tag names one image; the store is the whole repository). Plain HTTP is used for loopback
registries (``localhost``, ``127.0.0.0/8``, ``::1``, as Docker treats them) and for hosts named
with ``--registry-insecure HOST`` / ``$ENVBUILD_REGISTRY_INSECURE`` (comma-separated); every
other host is HTTPS with certificate verification.

How the ``Store`` contract maps onto a registry (store format version 1; every envbuild media
type below carries ``v1`` and readers refuse other versions by name):

* **blobs** are registry blobs of REPO: ``put`` = ``HEAD`` (present → done), then ``POST
  /blobs/uploads/`` and either one ``PUT ?digest=`` with the body (blobs up to ``chunk_size``:
  a monolithic upload) or ``PATCH`` chunks of ``chunk_size`` with ``Content-Range`` and a final
  ``PUT ?digest=`` (a chunked upload; a chunk that fails is resumed from the offset the
  registry reports). The bytes are hashed as they are read; the closing ``PUT`` is sent only
  if they match ``digest`` (and ``size``), otherwise the upload session is cancelled
  (``DELETE``) — the registry never holds a wrong blob, and it checks the digest itself too.
  ``get`` is one streaming ``GET`` verified by ``VerifyingReader`` (a connection that breaks is
  resumed with a ``Range`` request, at most ``resume_attempts`` times); ``get_range`` and
  ``get_tail`` are ``GET`` with ``Range`` (what the lazy layer reader uses). A digest that is
  not a blob but a manifest of REPO (pushed by skopeo, podman, …) is read through
  ``/manifests/<digest>`` instead, verified the same way.
* **refs** are tags (the rule below). A ref whose blob is an OCI image manifest or index (an
  env lock) and that has no annotations is that manifest, tagged: ``skopeo inspect
  docker://HOST/REPO:NAME`` and ``podman pull`` read it. Any other ref (a blob that is not a
  manifest, or a ref with annotations) is tagged as a small *ref artifact*: an OCI image
  manifest with ``artifactType: application/vnd.envbuild.ref.v1+json`` whose one layer is the
  ref's descriptor.
* **records** (key records ``keys/v1/<hex>`` and any other ``namespace/name``) are OCI
  artifacts: an image manifest with ``artifactType: application/vnd.envbuild.record.v1+json``,
  the empty config, and one layer — the record's canonical JSON, also inlined in the
  descriptor's ``data`` so a read is one request — annotated with its namespace, name and the
  time it was written (``record_mtime``). So ``--cache-from docker://…`` works like BuildKit's
  registry cache, and generic OCI tools (``oras``, ``skopeo``) can copy a cache.

The tag rule is ``envbuild.store._registry_format``'s docstring.

What a registry cannot do, and what this backend does instead:

* **Compare-and-swap** (``put_ref(expect=…)``): distribution has no conditional manifest PUT
  (it ignores ``If-Match``), so a check-then-PUT would race with another writer and only
  pretend. ``supports_cas`` is false and ``expect=`` raises ``cas-unsupported`` (the
  contract's answer); nothing in envbuild needs CAS on a registry today.
* **Listing blobs**: the distribution API lists tags, not blobs. ``list()`` yields every blob a
  tag reaches (its manifest, config and layers; an index's manifests recursively) — blobs that
  no tag reaches are invisible to it. ``stat`` gives no ``mtime``, so ``envbuild gc`` never
  deletes a blob from a registry; space is reclaimed by the registry's own collector
  (``registry garbage-collect --delete-untagged CONFIG``).
* **Deleting**: ``delete(digest)`` is ``DELETE /blobs/<digest>`` — it unlinks the blob from
  REPO (distribution frees the bytes in its own GC). Distribution 2.8 cannot delete a *tag*,
  only a manifest by digest, which removes **every** tag pointing at it. So ``delete_ref`` and
  ``delete_record`` read the tag's manifest, find the other ref tags pointing at the same
  manifest (one ``HEAD`` per ref tag), delete the manifest by digest and put it back under
  those other tags: between the two they are briefly absent (a concurrent reader may see
  ``RefNotFound``). Deletes need ``storage.delete.enabled: true`` in the registry's config;
  without it they fail with one line saying so.

Auth, retries, deadlines and the bounds on what a registry may send (it is untrusted input):
``envbuild.store._registry_http``. Opening the store does one ``GET /v2/`` (no retries), so a
wrong URL fails at once. ``tags/list`` stops at ``MAX_TAG_PAGES`` pages or ``MAX_TAGS`` tags
(one line, ``too-many-tags``).
"""

from __future__ import annotations

import base64
import binascii
import builtins
import hashlib
import io
import json
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from envbuild.errors import (
    BlobNotFound,
    DigestMismatch,
    StoreError,
    StoreUnavailable,
)
from envbuild.oci import TASK_ARTIFACT_TYPE
from envbuild.store._registry_auth import (  # noqa: F401  (re-exported: tests, callers)
    auth_files,
    find_credentials,
    parse_challenge,
)
from envbuild.store._registry_format import (  # noqa: F401  (some re-exported)
    ANN_NAME,
    ANN_NAMESPACE,
    ANN_WRITTEN,
    ARTIFACT_PREFIX,
    ARTIFACT_RECORD,
    ARTIFACT_REF,
    EMPTY_DIGEST,
    EMPTY_JSON,
    MANIFEST_TYPES,
    MAX_MANIFEST_SIZE,
    MEDIA_TYPE_DOCKER_LIST,
    MEDIA_TYPE_DOCKER_MANIFEST,
    MEDIA_TYPE_EMPTY,
    MiB,
    RegistryURL,
    _valid,
    is_manifest,
    json_or_none,
    parse_url,
    plain_http,
    record_artifact,
    record_to_tag,
    ref_artifact,
    ref_to_tag,
    tag_to_record,
    tag_to_ref,
)
from envbuild.store._registry_http import (  # noqa: F401  (some re-exported)
    KNOWN_BLOB_HOSTS,
    MAX_RESPONSE,
    MIN_RATE,
    BlobStream,
    RegistryClient,
    _Response,
)
from envbuild.store._registry_manifests import MAX_TAG_PAGES, MAX_TAGS, Manifests  # noqa: F401
from envbuild.store._registry_upload import blob_url, head_blob, start_upload, upload_blob
from envbuild.store.base import (
    ANY,
    MEDIA_TYPE_MANIFEST,
    BlobInfo,
    BlobMounter,
    Descriptor,
    Locatable,
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
    check_tail_length,
    decode_record,
    encode_record,
    make_descriptor,
    range_beyond_end,
    ref_not_found,
)

#: A registry that ignores ``Range`` sends whole blobs: read at most this much of one.
MAX_RANGE_FALLBACK = 64 * MiB


class RegistryStore(Store, TailReader, Locatable, BlobMounter):
    """A ``Store`` in repository REPO of an OCI registry; see the module docstring.

    ``insecure``: host names spoken to over plain HTTP although not loopback.
    ``credentials``: ``(user, password)``, default: found in ``auth_files`` (default: from
    ``environ``, see ``auth_files``). Tuning: ``chunk_size`` (blobs up to it are one PUT,
    larger ones PATCH chunks of it; memory per upload), ``attempts`` (tries per request on
    connection errors, 429 and 5xx), ``timeout`` (seconds per socket read), ``resume_attempts``
    (a broken blob download is resumed this often), ``deadline`` (seconds one request may take
    in all, retries included; a blob download gets one more second per ``MIN_RATE`` bytes).

    ``blob_hosts``: hosts (``HOST`` or ``HOST:PORT``) besides the registry that it may redirect
    a read to (a CDN or object store serving its blobs), default from
    ``$ENVBUILD_REGISTRY_BLOB_HOSTS`` (comma-separated), plus the ``KNOWN_BLOB_HOSTS`` of a
    public registry (Docker Hub's, GHCR's and Quay's CDNs). A redirect anywhere else is refused;
    so is any connection off the registry to a non-public address the registry is not at
    (``_http_guard``), and the ``Authorization`` header never leaves the registry.
    """

    supports_cas = False

    def __init__(self, url: str | RegistryURL, *, insecure: Iterable[str] = (),
                 credentials: tuple[str, str] | None = None,
                 auth_paths: Iterable[Path] | None = None,
                 environ: Mapping[str, str] | None = None, chunk_size: int = 16 * MiB,
                 attempts: int = 4, timeout: float = 30.0, connect_timeout: float = 5.0,
                 resume_attempts: int = 3, backoff: float = 0.1, deadline: float = 300.0,
                 blob_hosts: Iterable[str] | None = None) -> None:
        self.address = url if isinstance(url, RegistryURL) else parse_url(url)
        self._http = RegistryClient(
            self.address, insecure=insecure, credentials=credentials, auth_paths=auth_paths,
            environ=environ, attempts=attempts, timeout=timeout,
            connect_timeout=connect_timeout, backoff=backoff, deadline=deadline,
            blob_hosts=blob_hosts)
        self.insecure = self._http.insecure
        self.scheme = self._http.scheme
        self.chunk_size = chunk_size
        self.attempts = self._http.attempts
        self.resume_attempts = resume_attempts
        self.deadline = deadline
        self._manifests = Manifests(self._http, self._base())
        self._empty_uploaded = False
        self._open()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RegistryStore:
        return cls(url, **kwargs)

    @property
    def url(self) -> str:
        return str(self.address)

    def location(self) -> StoreLocation:
        """``docker://HOST/REPO``: another process reopens it with ``open_store`` (a non-loopback
        plain-HTTP host also needs ``--registry-insecure`` there)."""
        return StoreLocation(self.url)

    def __repr__(self) -> str:
        return f"RegistryStore({self.url!r})"

    @property
    def credentials(self) -> tuple[str, str] | None:
        return self._http.credentials

    def close(self) -> None:
        self._http.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _base(self) -> str:
        return f"{self.scheme}://{self.address.host}/v2/{self.address.repo}"

    # thin names the rest of this class (and tests) use for the repository's manifests
    def _head_manifest(self, ref: str, *, fallback: bool = False) -> tuple[str, int, str] | None:
        return self._manifests.head_manifest(ref, fallback=fallback)

    def _get_manifest(self, ref: str, what: str) -> tuple[bytes, str, str] | None:
        return self._manifests.get_manifest(ref, what)

    def _put_manifest(self, tag: str, body: bytes, media_type: str, what: str) -> str:
        return self._manifests.put_manifest(tag, body, media_type, what)

    def _tags(self) -> list[str]:
        return self._manifests.list_tags()

    def _open(self) -> None:
        resp = self._http.request("GET", f"{self.scheme}://{self.address.host}/v2/",
                             attempts=1, what="open")
        if resp.status == 404:
            raise StoreUnavailable(f"open {self.url}: {self.address.host} is not an OCI "
                                   "registry (GET /v2/ answered 404)",
                                   hint="check the host and port of the store URL")
        if resp.status != 200:
            raise self._http.status_error(resp, "open")

    # -- blobs ---------------------------------------------------------------------------------

    def _blob_url(self, digest: str) -> str:
        return blob_url(self._base(), digest)

    def _head_blob(self, digest: str) -> int | None:
        return head_blob(self._http, self._base(), digest)


    def put(self, digest: str, data: bytes | BinaryIO, *, size: int | None = None) -> None:
        if self._head_blob(digest) is not None:  # (validates the digest)
            return
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = io.BytesIO(bytes(data))
        upload_blob(self._http, self._base(), digest, data, size, self.chunk_size)


    def mount(self, digest: str, source: Store) -> bool:
        """Cross-repository blob mount (``POST /blobs/uploads/?mount=…&from=…``): make blob
        ``digest`` of ``source`` (another repository of the same registry) part of this one
        without moving its bytes. True if mounted; False if this registry or ``source``
        cannot (then copy it)."""
        check_digest(digest)
        if (not isinstance(source, RegistryStore) or source.address.host != self.address.host
                or source.address.repo == self.address.repo):
            return False
        query = urllib.parse.urlencode({"mount": digest, "from": source.address.repo})
        resp = start_upload(self._http, self._base(), f"?{query}")
        if resp.status == 201:
            return True
        if resp.status == 202 and resp.header("Location"):  # not mounted: a session opened
            self._http.request("DELETE", urllib.parse.urljoin(resp.url, resp.header("Location")),
                          attempts=1, what="cancel upload to")
        return False

    def get(self, digest: str) -> BinaryIO:
        url = self._blob_url(digest)
        opened = self._http.open_stream(url, {}, want=(200,))
        if opened[1] is None:
            answer = opened[0]
            if answer.status == 404:
                got = self._get_manifest(digest, f"read {digest} from")
                if got is None:
                    raise blob_not_found(digest)
                body = io.BytesIO(got[0])
                return VerifyingReader(body, digest, size=len(got[0]))  # type: ignore[return-value]
            raise self._http.status_error(answer, f"read blob {digest} from")
        resp, conn = opened
        size = int(resp.getheader("Content-Length") or -1)
        if size < 0:
            conn.close()
            raise StoreError(f"read blob {digest} from {self.url}: no Content-Length")
        stream = BlobStream(self._http, url, resp, conn, size, self.resume_attempts,
                         time.monotonic() + self.deadline + size / MIN_RATE)
        return VerifyingReader(stream, digest, size=size,  # type: ignore[return-value]
                               location=f"{self.url}@{digest}")

    def get_range(self, digest: str, offset: int, length: int) -> bytes:
        check_digest(digest)
        check_range(offset, length)
        if length == 0:
            if offset > self.stat(digest).size:
                raise range_beyond_end(digest, offset, self.stat(digest).size)
            return b""
        # a registry that ignores Range answers the whole blob: read at most so much of it
        resp = self._http.request("GET", self._blob_url(digest),
                             headers={"Range": f"bytes={offset}-{offset + length - 1}"},
                             what=f"read blob {digest} from",
                             limit=max(length, min(offset + length, MAX_RANGE_FALLBACK)))
        if resp.status == 206:
            return resp.body[:length]
        if resp.status == 200:  # a registry that ignores Range: the whole blob
            return resp.body[offset:offset + length]
        if resp.status == 416:
            size = self.stat(digest).size
            if offset == size:
                return b""
            raise range_beyond_end(digest, offset, size)
        if resp.status == 404:
            got = self._get_manifest(digest, f"read {digest} from")
            if got is None:
                raise blob_not_found(digest)
            if offset > len(got[0]):
                raise range_beyond_end(digest, offset, len(got[0]))
            return got[0][offset:offset + length]
        raise self._http.status_error(resp, f"read blob {digest} from")

    def get_tail(self, digest: str, length: int) -> tuple[bytes, int]:
        """The last ``length`` bytes (one suffix-range GET) and the blob's size; lazy readers
        use it to read a layer's footer without a HEAD first (as with ``S3Store``)."""
        check_tail_length(length)
        resp = self._http.request("GET", self._blob_url(digest),
                             headers={"Range": f"bytes=-{length}"},
                             what=f"read blob {digest} from",
                             limit=max(length, MAX_RANGE_FALLBACK))
        if resp.status == 404:
            raise blob_not_found(digest)
        if resp.status == 200:
            return resp.body[-length:] if length else b"", len(resp.body)
        if resp.status == 416 and self._head_blob(digest) == 0:  # no suffix of an empty blob
            return b"", 0
        if resp.status != 206:
            raise self._http.status_error(resp, f"read blob {digest} from")
        total = resp.header("Content-Range").rpartition("/")[2]
        if len(resp.body) > length:
            raise StoreError(f"read blob {digest} from {self.url}: asked for the last {length} "
                             f"bytes, {self._http.where()} sent {len(resp.body)}")
        return resp.body, int(total) if total.isdigit() else len(resp.body)

    def stat(self, digest: str) -> BlobInfo:
        size = self._head_blob(digest)
        if size is None:
            got = self._head_manifest(digest, fallback=True)
            if got is None:
                raise blob_not_found(digest)
            size = got[1]
        return BlobInfo(digest, size, None)

    def exists(self, digest: str) -> bool:
        try:
            self.stat(digest)
        except BlobNotFound:
            return False
        return True

    def delete(self, digest: str) -> None:
        resp = self._http.request("DELETE", self._blob_url(digest), what=f"delete blob {digest} in")
        if resp.status in (202, 204, 404):
            return
        raise self._delete_error(resp, f"delete blob {digest} in")

    def _delete_error(self, resp: _Response, what: str) -> StoreError:
        if resp.status == 405 or resp.error_code() == "UNSUPPORTED":
            return StoreError(f"{what} {self.url}: {self._http.where()} does not allow deletes",
                              reference="delete-unsupported",
                              hint="enable them in the registry's config (distribution: "
                                   "storage: delete: enabled: true)")
        return self._http.status_error(resp, what)

    def list(self) -> Iterator[str]:
        """Every blob a ref tag reaches (see the module docstring: a registry cannot enumerate
        blobs no tag reaches). The blobs that make up envbuild's own artifacts (a record's JSON,
        the empty config) are representation, not store blobs, and are not listed; a ref
        artifact's target is."""
        seen: set[str] = set()
        for tag in self._tags():
            if tag_to_ref(tag) is None:
                continue
            got = self._get_manifest(tag, f"list {tag} in")
            if got is None:
                continue
            doc = json_or_none(got[0])
            if isinstance(doc, dict) and doc.get("artifactType") == ARTIFACT_REF:
                target = (doc.get("layers") or [{}])[0]
                yield from self._reachable_desc(target, seen)
            else:
                yield from self._reachable(got[0], got[1], seen)

    def _reachable_desc(self, desc: Any, seen: set[str]) -> Iterator[str]:
        d = desc.get("digest") if isinstance(desc, dict) else None
        if not isinstance(d, str) or not _valid(check_digest, d) or d in seen:
            return
        if desc.get("mediaType") in MANIFEST_TYPES:
            got = self._get_manifest(d, f"list {d} in")
            if got is not None:
                yield from self._reachable(got[0], d, seen)
                return
        seen.add(d)
        yield d

    def _reachable(self, data: bytes, digest: str, seen: set[str]) -> Iterator[str]:
        if digest in seen:
            return
        seen.add(digest)
        yield digest
        doc = json_or_none(data)
        if not isinstance(doc, dict):
            return
        children = list(doc.get("manifests") or [])
        children += [doc["config"]] if isinstance(doc.get("config"), dict) else []
        children += list(doc.get("layers") or [])
        for child in children:
            yield from self._reachable_desc(child, seen)


    # -- manifests and tags --------------------------------------------------------------------

    def _ensure_empty(self) -> None:
        if not self._empty_uploaded:
            self.put(EMPTY_DIGEST, EMPTY_JSON)
            self._empty_uploaded = True


    def _delete_tag(self, tag: str, what: str) -> None:
        """Remove ``tag``; keep every other ref tag pointing at the same manifest (distribution
        2.8 deletes manifests by digest only, which drops all their tags)."""
        got = self._get_manifest(tag, what)
        if got is None:
            return
        body, digest, media_type = got
        siblings = []
        for other in self._tags():
            if other == tag or tag_to_ref(other) is None:
                continue  # record manifests are unique to their tag (name annotations)
            head = self._head_manifest(other)
            if head is not None and head[0] == digest:
                siblings.append(other)
        resp = self._http.request("DELETE", f"{self._base()}/manifests/{digest}", what=what)
        if resp.status not in (202, 204, 404):
            raise self._delete_error(resp, what)
        for other in siblings:
            self._put_manifest(other, body, media_type, f"re-tag {other} in")

    # -- refs ----------------------------------------------------------------------------------

    def put_ref(self, name: str, digest: str, *, media_type: str = MEDIA_TYPE_MANIFEST,
                annotations: Mapping[str, str] | None = None,
                expect: str | None | _Any = ANY) -> Descriptor:
        tag = ref_to_tag(name)
        check_digest(digest)
        check_expect(self, expect)
        size = self.stat(digest).size
        desc = make_descriptor(media_type, digest, size, annotations)
        if media_type in MANIFEST_TYPES and not desc.annotations and size <= MAX_MANIFEST_SIZE:
            with self.get(digest) as f:
                data = f.read()
            if is_manifest(data, media_type):
                self._put_manifest(tag, data, media_type, f"publish ref {name} in")
                return desc
        self._ensure_empty()
        self._put_manifest(tag, canonical_json(ref_artifact(desc)), MEDIA_TYPE_MANIFEST,
                           f"publish ref {name} in")
        return desc

    def get_ref(self, name: str) -> Descriptor:
        tag = ref_to_tag(name)
        got = self._get_manifest(tag, f"read ref {name} from")
        if got is None:
            raise ref_not_found(name)
        body, digest, media_type = got
        if media_type not in MANIFEST_TYPES:
            raise StoreError(f"ref {name} (tag {tag}) in {self.url} is a manifest of media "
                             f"type {media_type or 'none'!r}, which envbuild does not read",
                             reference="unsupported-media-type",
                             hint="envbuild reads OCI image manifests and indexes; convert it "
                                  f"(skopeo copy --format oci docker://{self.address.host}/"
                                  f"{self.address.repo}:{tag} …) or push the lock again")
        if media_type == MEDIA_TYPE_MANIFEST:
            try:
                doc = json.loads(body)
            except ValueError:
                raise StoreError(f"ref {name} in {self.url}: the manifest is not JSON") from None
            kind = doc.get("artifactType") if isinstance(doc, dict) else None
            if kind == ARTIFACT_REF:
                layers = doc.get("layers") or [{}]
                return Descriptor.from_oci(layers[0])
            if isinstance(kind, str) and kind.startswith(ARTIFACT_PREFIX) \
                    and kind != TASK_ARTIFACT_TYPE:  # a task lock is a lock (tasklock)
                raise StoreError(f"ref {name} in {self.url} is an envbuild artifact of type "
                                 f"{kind!r}, which this envbuild does not know",
                                 reference="unsupported-format",
                                 hint="it was written by another envbuild version; upgrade")
        return Descriptor(media_type, digest, len(body), {})

    def list_refs(self) -> builtins.list[str]:
        return sorted(r for r in map(tag_to_ref, self._tags()) if r is not None)

    def delete_ref(self, name: str) -> None:
        self._delete_tag(ref_to_tag(name), f"delete ref {name} in")

    # -- records -------------------------------------------------------------------------------

    def put_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> None:
        tag = record_to_tag(namespace, name)
        data = encode_record(obj)
        self.put("sha256:" + hashlib.sha256(data).hexdigest(), data)
        self._ensure_empty()
        manifest = record_artifact(namespace, name, data, time.time())
        self._put_manifest(tag, canonical_json(manifest), MEDIA_TYPE_MANIFEST,
                           f"write record {namespace}/{name} to")

    def _read_record(self, namespace: str, name: str) -> tuple[dict[str, Any], bytes] | None:
        tag = record_to_tag(namespace, name)
        where = f"{self.url}:{tag}"
        got = self._get_manifest(tag, f"read record {namespace}/{name} from")
        if got is None:
            return None
        try:
            doc = json.loads(got[0])
            kind = doc.get("artifactType")
            layer = (doc.get("layers") or [None])[0]
            ann = doc.get("annotations") or {}
        except (ValueError, AttributeError) as e:
            raise StoreError(f"parse record {where}: {e}",
                             hint="the record is damaged; delete it and rebuild") from None
        if kind != ARTIFACT_RECORD:
            raise StoreError(f"record {where} has artifactType {kind!r}, not {ARTIFACT_RECORD}",
                             reference="unsupported-format",
                             hint="written by another envbuild version or another tool; "
                                  "delete the tag or upgrade envbuild")
        if (ann.get(ANN_NAMESPACE), ann.get(ANN_NAME)) != (namespace, name):
            raise StoreError(f"record {where} names {ann.get(ANN_NAMESPACE)}/{ann.get(ANN_NAME)}",
                             hint="the tag was overwritten by hand; delete it and rebuild")
        desc = Descriptor.from_oci(layer if isinstance(layer, dict) else {})
        inline = layer.get("data")
        if isinstance(inline, str):
            try:
                data = base64.b64decode(inline, validate=True)
            except binascii.Error:
                data = b""
            if "sha256:" + hashlib.sha256(data).hexdigest() != desc.digest:
                raise DigestMismatch(f"record {where} is corrupt: its inline data does not "
                                     f"hash to {desc.digest}",
                                     hint="delete the record; the layer will be rebuilt")
        else:
            with self.get(desc.digest) as f:
                data = f.read()
        return decode_record(data, where), got[0]

    def get_record(self, namespace: str, name: str) -> dict[str, Any] | None:
        got = self._read_record(namespace, name)
        return None if got is None else got[0]

    def record_mtime(self, namespace: str, name: str) -> float | None:
        got = self._read_record(namespace, name)
        if got is None:
            return None
        written = (json.loads(got[1]).get("annotations") or {}).get(ANN_WRITTEN, "")
        try:
            return float(written)
        except ValueError:
            return None

    def list_records(self, namespace: str) -> builtins.list[str]:
        check_record_name(namespace, "x")
        return sorted(rec[1] for rec in map(tag_to_record, self._tags())
                      if rec is not None and rec[0] == namespace)

    def delete_record(self, namespace: str, name: str) -> None:
        tag = record_to_tag(namespace, name)
        self._delete_tag(tag, f"delete record {namespace}/{name} in")


