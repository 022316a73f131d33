"""Manifests and tags of one registry repository (distribution spec "pulling manifests",
"pushing manifests", "listing tags"), verified against their digests; the layer between
``RegistryClient`` (HTTP) and ``RegistryStore`` (the store contract)."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse

from envbuild.errors import DigestMismatch, StoreError
from envbuild.store._registry_format import MANIFEST_TYPES, MAX_MANIFEST_SIZE
from envbuild.store._registry_http import RegistryClient

#: ``tags/list`` of one repository: at most this many pages and tags, then refuse.
MAX_TAG_PAGES = 1000
MAX_TAGS = 100_000
_ACCEPT = ", ".join(MANIFEST_TYPES)


class Manifests:
    """The manifests and tags of the repository at ``base`` (``…/v2/REPO``) through ``http``."""

    def __init__(self, http: RegistryClient, base: str) -> None:
        self.http = http
        self.base = base

    @property
    def url(self) -> str:
        return self.http.url

    def head_manifest(self, ref: str, *, fallback: bool = False) -> tuple[str, int, str] | None:
        """``(digest, size, media type)`` of manifest ``ref`` (tag or digest), or ``None``.
        ``fallback``: asked because the digest is not a blob — distribution answers 500 for a
        digest it holds as a blob of another repository but cannot parse as a manifest, and
        that means "not a manifest here" (the blob HEAD just before showed the registry up)."""
        resp = self.http.request("HEAD", f"{self.base}/manifests/{ref}",
                             headers={"Accept": _ACCEPT}, what=f"stat manifest {ref} in",
                             attempts=1 if fallback else None, give_up_quietly=fallback)
        if resp.status == 404 or (fallback and resp.status >= 500):
            return None
        if resp.status != 200:
            raise self.http.status_error(resp, f"stat manifest {ref} in")
        return (resp.header("Docker-Content-Digest"), int(resp.header("Content-Length", "0")),
                resp.header("Content-Type").split(";")[0].strip())

    def get_manifest(self, ref: str, what: str) -> tuple[bytes, str, str] | None:
        """``(bytes, digest, media type)`` of manifest ``ref`` verified against its digest (the
        one asked for, or the registry's ``Docker-Content-Digest``), or ``None`` if absent."""
        resp = self.http.request("GET", f"{self.base}/manifests/{ref}",
                             headers={"Accept": _ACCEPT}, what=what)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise self.http.status_error(resp, what)
        if len(resp.body) > MAX_MANIFEST_SIZE:
            raise StoreError(f"{what} {self.url}: manifest {ref} is {len(resp.body)} bytes, "
                             "too large for a manifest")
        actual = "sha256:" + hashlib.sha256(resp.body).hexdigest()
        claimed = ref if ref.startswith("sha256:") else resp.header("Docker-Content-Digest")
        if claimed and claimed != actual:
            raise DigestMismatch(f"{what} {self.url}: manifest {ref} is corrupt: the registry "
                                 f"says {claimed} but its content hashes to {actual}",
                                 hint="a proxy or the registry's storage altered it; check "
                                      "the registry and push it again")
        return resp.body, actual, resp.header("Content-Type").split(";")[0].strip()

    def put_manifest(self, tag: str, body: bytes, media_type: str, what: str) -> str:
        for attempt in range(1, self.http.attempts + 1):
            resp = self.http.request("PUT", f"{self.base}/manifests/{tag}", body=body,
                                 headers={"Content-Type": media_type}, what=what)
            # distribution 2.8 answers DIGEST_INVALID to one of two concurrent PUTs of
            # different manifests to one tag (its filesystem writes are not atomic): the
            # bytes are ours, so try again; a persistent one is reported below
            if resp.status == 201 or resp.error_code() != "DIGEST_INVALID":
                break
            if attempt < self.http.attempts:
                self.http.sleep(attempt)
        if resp.status != 201:
            code = resp.error_code()
            hint = None
            if code == "MANIFEST_BLOB_UNKNOWN":
                hint = "push the blobs a manifest names before the manifest (envbuild push does)"
            elif code in ("MANIFEST_INVALID", "UNSUPPORTED"):
                hint = f"the registry does not accept {media_type} manifests"
            raise StoreError(f"{what} {self.url}: {self.http.where()} refused the manifest "
                             f"({resp.status} {resp.error_text()})", hint=hint)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        got = resp.header("Docker-Content-Digest")
        if got and got != digest:
            raise DigestMismatch(f"{what} {self.url}: the registry stored the manifest as "
                                 f"{got}, not {digest}",
                                 hint="a proxy altered the manifest; check the registry")
        return digest

    def list_tags(self) -> list[str]:
        """All tags of REPO (``tags/list``, following ``Link`` pages on the registry); none if
        REPO is new. More than ``MAX_TAG_PAGES`` pages or ``MAX_TAGS`` tags is refused."""
        url = f"{self.base}/tags/list?n=1000"
        tags: list[str] = []
        for _ in range(MAX_TAG_PAGES):
            resp = self.http.request("GET", url, what="list tags of")
            if resp.status == 404:
                return tags  # NAME_UNKNOWN: nothing was pushed yet
            if resp.status != 200:
                raise self.http.status_error(resp, "list tags of")
            try:
                tags += [t for t in json.loads(resp.body).get("tags") or []
                         if isinstance(t, str)]
            except (ValueError, AttributeError) as e:
                raise StoreError(f"list tags of {self.url}: bad answer: {e}") from None
            if len(tags) > MAX_TAGS:
                break
            link = re.match(r"\s*<([^>]+)>\s*;\s*rel=\"?next\"?", resp.header("Link"))
            if not link:
                return tags
            url = urllib.parse.urljoin(url, link.group(1))
            if not self.http.same_registry(urllib.parse.urlsplit(url)):
                raise StoreError(f"list tags of {self.url}: the next page is on another host "
                                 f"({url[:120]})", hint="the registry is misbehaving or hostile")
        raise StoreError(f"list tags of {self.url}: more than {MAX_TAGS} tags or "
                         f"{MAX_TAG_PAGES} pages", reference="too-many-tags",
                         hint="the registry is misbehaving, or the repository holds more tags "
                              "than envbuild lists; use a repository of its own for the store")
