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

Tag rule (v1; reversible; tags are ``[A-Za-z0-9_][A-Za-z0-9._-]{0,127}``):

====================================  =====================================================
``env/NAME``                          ``NAME``, if NAME matches ``[A-Za-z0-9][A-Za-z0-9.-]*``,
                                      is at most 128 characters and starts with neither
                                      ``envbuild-`` nor ``sha256-`` (reserved)
record ``keys/v1`` / 64 hex digits    ``envbuild-key-<hex>``
any other ref R                       ``envbuild-ref-`` + esc(R)
any other record NS / N               ``envbuild-rec-`` + esc(NS) + ``_n`` + esc(N)
====================================  =====================================================

``esc`` keeps ``A-Za-z0-9.-`` and writes ``_`` as ``__``, ``/`` as ``_s``, ``:`` as ``_c``,
``@`` as ``_a``, ``+`` as ``_p``. A name whose tag would exceed 128 characters is refused
(``invalid-name``). Tags that decode to nothing (``latest`` decodes to ``env/latest``;
``sha256-…`` referrer tags, cosign's ``.sig`` tags do not decode) are ignored by
``list_refs``/``list_records``.

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

Auth: credentials from ``$REGISTRY_AUTH_FILE`` (podman's ``auth.json``), else
``$XDG_RUNTIME_DIR/containers/auth.json``, else ``$DOCKER_CONFIG/config.json`` /
``~/.docker/config.json`` — the ``auths`` entry for ``HOST[:PORT]/REPO`` or ``HOST[:PORT]``
(``auth`` = base64 ``user:password``, or ``username``/``password``). A ``401`` with a
``Basic`` challenge is answered with those credentials; with a ``Bearer`` challenge a token
for the challenge's scope is fetched from its realm (with the credentials, if any) and reused
until the registry asks again. Credential helpers (``credsStore``) are not run.

Failures: connection errors, ``429`` and ``5xx`` are retried ``attempts`` times with bounded
exponential backoff and jitter; a registry that stays down, refuses credentials (``401``),
denies access (``403``) or serves a wrong digest fails with one line naming the registry and
a hint. Opening the store does one ``GET /v2/`` (no retries), so a wrong URL fails at once.

A registry is untrusted input (``envbuild.store._http_guard``): every answer read whole is
read with a limit (``MAX_RESPONSE``; a range its length), a declared ``Content-Length`` over
it refused before reading; ``tags/list`` stops at ``MAX_TAG_PAGES`` pages or ``MAX_TAGS``
tags (one line, ``too-many-tags``); every request, retries included, ends by ``deadline``
seconds (a blob download gets one more second per ``MIN_RATE`` bytes), whatever the server
dribbles; redirects go only to the registry itself or a configured blob host
(``$ENVBUILD_REGISTRY_BLOB_HOSTS``), and any connection off the registry (a blob host, a
token realm) only to public addresses or to the registry's own, checked before connecting.
``Authorization`` is sent to the registry only (a token realm gets the Basic credentials).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import http.client
import io
import ipaddress
import json
import os
import random
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from envbuild.errors import (
    BlobNotFound,
    DigestMismatch,
    SettingsError,
    StoreError,
    StoreUnavailable,
)
from envbuild.store._http_guard import (
    WATCHDOG,
    AddressRefused,
    BodyTooLarge,
    guarded_connect,
    read_body,
    resolve,
)
from envbuild.store.base import (
    ANY,
    MEDIA_TYPE_INDEX,
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
    check_ref_name,
    check_tail_length,
    decode_record,
    encode_record,
    make_descriptor,
    mismatch_on_put,
    range_beyond_end,
    ref_not_found,
)

MiB = 1 << 20

MEDIA_TYPE_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_TYPE_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
#: Manifest media types a tag may hold for envbuild; anything else is refused by name.
MANIFEST_TYPES = (MEDIA_TYPE_MANIFEST, MEDIA_TYPE_INDEX, MEDIA_TYPE_DOCKER_MANIFEST,
                  MEDIA_TYPE_DOCKER_LIST)
MEDIA_TYPE_EMPTY = "application/vnd.oci.empty.v1+json"
EMPTY_JSON = b"{}"
EMPTY_DIGEST = "sha256:" + hashlib.sha256(EMPTY_JSON).hexdigest()
ARTIFACT_REF = "application/vnd.envbuild.ref.v1+json"
ARTIFACT_RECORD = "application/vnd.envbuild.record.v1+json"
_ARTIFACT_PREFIX = "application/vnd.envbuild."
ANN_NAMESPACE = "dev.envbuild.record.namespace"
ANN_NAME = "dev.envbuild.record.name"
ANN_WRITTEN = "dev.envbuild.record.written"
#: Manifests and records are small; refuse to buffer anything larger.
MAX_MANIFEST_SIZE = 4 * MiB
#: The most any answer that is read whole may hold (manifests, tag pages, errors, tokens).
MAX_RESPONSE = MAX_MANIFEST_SIZE
#: A registry that ignores ``Range`` sends whole blobs: read at most this much of one.
MAX_RANGE_FALLBACK = 64 * MiB
#: ``tags/list`` of one repository: at most this many pages and tags, then refuse.
MAX_TAG_PAGES = 1000
MAX_TAGS = 100_000
#: A blob download's deadline grows by one second for this many bytes.
MIN_RATE = 256 << 10
#: The blob hosts public registries redirect blob reads to (their documented CDN hosts),
#: allowed for that registry without configuration; any other is ``blob_hosts``' business.
KNOWN_BLOB_HOSTS = {
    "registry-1.docker.io": frozenset({"production.cloudflare.docker.com"}),
    "ghcr.io": frozenset({"pkg-containers.githubusercontent.com"}),
    **{host: frozenset({"cdn.quay.io", "cdn01.quay.io", "cdn02.quay.io", "cdn03.quay.io"})
       for host in ("quay.io", "registry.redhat.io", "registry.access.redhat.com")},
}

_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_ENV_TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,127}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_REPO_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"  # distribution's path component
_REPO_RE = re.compile(rf"{_REPO_COMPONENT}(?:/{_REPO_COMPONENT})*")
_RESERVED_TAG_PREFIXES = ("envbuild-", "sha256-")
_KEY_PREFIX = "envbuild-key-"
_REF_PREFIX = "envbuild-ref-"
_REC_PREFIX = "envbuild-rec-"
_ESC = {"_": "__", "/": "_s", ":": "_c", "@": "_a", "+": "_p"}
_UNESC = {v[1]: k for k, v in _ESC.items()}
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_ACCEPT = ", ".join(MANIFEST_TYPES)


# -- pure parts: URL, tag rule, credentials, challenges ----------------------------------------


@dataclasses.dataclass(frozen=True)
class RegistryURL:
    """A parsed ``docker://HOST[:PORT]/REPO``; ``host`` keeps the port (``127.0.0.1:5000``)."""

    host: str
    repo: str

    @property
    def hostname(self) -> str:
        return urllib.parse.urlsplit("//" + self.host).hostname or self.host

    def __str__(self) -> str:
        return f"docker://{self.host}/{self.repo}"


def parse_url(url: str) -> RegistryURL:
    """Parse ``docker://HOST[:PORT]/REPO`` (``SettingsError`` with a hint if it is not one)."""
    rest = url[len("docker://"):] if url.startswith("docker://") else ""
    host, _, repo = rest.partition("/")
    hint = "use docker://HOST[:PORT]/REPO, e.g. docker://127.0.0.1:5000/team/envs"
    if not host or not repo:
        raise SettingsError(f"bad registry store URL {url!r}", hint=hint)
    if "@" in repo or ":" in repo:
        raise SettingsError(f"registry store URL {url!r} names a tag or digest",
                            hint="the store is the whole repository: drop ':TAG' / '@DIGEST' "
                                 "(refs become tags: env/NAME is the tag NAME)")
    if not _REPO_RE.fullmatch(repo) or len(repo) > 255:
        raise SettingsError(f"bad repository name {repo!r} in {url!r}",
                            hint="lower-case components of letters and digits joined by . _ - "
                                 "and separated by '/'")
    try:
        split = urllib.parse.urlsplit("//" + host)
        split.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise SettingsError(f"bad registry host {host!r} in {url!r}", hint=hint) from None
    if not split.hostname:
        raise SettingsError(f"bad registry host {host!r} in {url!r}", hint=hint)
    return RegistryURL(host.lower(), repo)


def plain_http(hostname: str, insecure: Iterable[str] = ()) -> bool:
    """Whether to speak plain HTTP to ``hostname``: loopback, or listed as insecure (by host
    name or ``host:port``, compared without the port)."""
    names = {h.strip().lower().rsplit(":", 1)[0] if h.count(":") == 1 else h.strip().lower()
             for h in insecure if h.strip()}
    if hostname.lower() in names:
        return True
    if hostname.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname.strip("[]")).is_loopback
    except ValueError:
        return False


def _esc(s: str) -> str:
    return "".join(_ESC.get(c, c) for c in s)


def _unesc(s: str, stop: str = "") -> tuple[str, str] | None:
    """Decode ``esc`` up to an escape ``_<stop>`` (returns the decoded part and the rest), or
    to the end; ``None`` if ``s`` is not a valid encoding."""
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c != "_":
            out.append(c)
            i += 1
            continue
        nxt = s[i + 1:i + 2]
        if stop and nxt == stop:
            return "".join(out), s[i + 2:]
        if nxt not in _UNESC:
            return None
        out.append(_UNESC[nxt])
        i += 2
    return ("".join(out), "") if not stop else None


def _checked_tag(tag: str, what: str) -> str:
    if not _TAG_RE.fullmatch(tag):
        raise StoreError(f"{what} is too long for a registry tag ({len(tag)} > 128 characters "
                         f"as {tag[:40]}…)", reference="invalid-name",
                         hint="use a shorter name (see 'Registries' in README.md for the "
                              "ref → tag rule)")
    return tag


def ref_to_tag(name: str) -> str:
    """The tag of ref ``name`` (the module docstring's rule); validates ``name``."""
    check_ref_name(name)
    env = name[4:] if name.startswith("env/") else None
    if (env is not None and _ENV_TAG_RE.fullmatch(env)
            and not env.startswith(_RESERVED_TAG_PREFIXES)):
        return env
    return _checked_tag(_REF_PREFIX + _esc(name), f"ref {name!r}")


def record_to_tag(namespace: str, name: str) -> str:
    """The tag of record ``namespace/name``; validates both."""
    check_record_name(namespace, name)
    if namespace == "keys/v1" and _HEX64_RE.fullmatch(name):
        return _KEY_PREFIX + name
    return _checked_tag(_REC_PREFIX + _esc(namespace) + "_n" + _esc(name),
                        f"record {namespace}/{name}")


def tag_to_ref(tag: str) -> str | None:
    """The ref a tag holds, or ``None`` if it is a record tag or not envbuild's."""
    if tag.startswith(_REF_PREFIX):
        got = _unesc(tag[len(_REF_PREFIX):])
        name = got[0] if got else None
        # only the canonical encoding counts, so that ref_to_tag(tag_to_ref(t)) == t
        if name is None or not _valid(check_ref_name, name) or ref_to_tag(name) != tag:
            return None
        return name
    if tag.startswith(_RESERVED_TAG_PREFIXES) or not _ENV_TAG_RE.fullmatch(tag):
        return None
    return "env/" + tag if _valid(check_ref_name, "env/" + tag) else None


def tag_to_record(tag: str) -> tuple[str, str] | None:
    """The ``(namespace, name)`` of a record tag, or ``None``."""
    if tag.startswith(_KEY_PREFIX):
        name = tag[len(_KEY_PREFIX):]
        return ("keys/v1", name) if _HEX64_RE.fullmatch(name) else None
    if not tag.startswith(_REC_PREFIX):
        return None
    got = _unesc(tag[len(_REC_PREFIX):], stop="n")
    if got is None:
        return None
    rest = _unesc(got[1])
    if rest is None or not _valid(check_record_name, got[0], rest[0]):
        return None
    return (got[0], rest[0]) if record_to_tag(got[0], rest[0]) == tag else None


def _valid(check, *args) -> bool:
    try:
        check(*args)
    except StoreError:
        return False
    return True


def auth_files(environ: Mapping[str, str]) -> list[Path]:
    """Where credentials are looked for, in order (podman's order, then Docker's)."""
    out = []
    if environ.get("REGISTRY_AUTH_FILE"):
        out.append(Path(environ["REGISTRY_AUTH_FILE"]))
    if environ.get("XDG_RUNTIME_DIR"):
        out.append(Path(environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    docker_dir = environ.get("DOCKER_CONFIG") or (
        str(Path(environ["HOME"]) / ".docker") if environ.get("HOME") else None)
    if docker_dir:
        out.append(Path(docker_dir) / "config.json")
    return out


def find_credentials(url: RegistryURL, files: Iterable[Path]) -> tuple[str, str] | None:
    """``(user, password)`` for ``url`` from the first auth file that has an entry for
    ``HOST/REPO`` (or a parent path), ``HOST``, or ``https://HOST[/v1/]``; ``None`` if none.
    A file that exists but cannot be parsed is a ``SettingsError`` naming it."""
    parts = url.repo.split("/")
    keys = [f"{url.host}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)]
    keys += [url.host, f"https://{url.host}", f"https://{url.host}/v1/",
             f"http://{url.host}", f"https://{url.host}/v2/"]
    for path in files:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise SettingsError(f"read registry credentials {path}: {e.strerror}") from None
        try:
            auths = json.loads(data).get("auths", {})
            if auths is None:
                auths = {}
            if not isinstance(auths, dict):
                raise ValueError("'auths' is not an object")
        except (ValueError, AttributeError) as e:
            raise SettingsError(f"parse registry credentials {path}: {e}",
                                hint="it must be JSON like {\"auths\": {\"HOST\": {\"auth\": "
                                     "\"base64(user:password)\"}}}") from None
        for key in keys:
            entry = auths.get(key)
            if not isinstance(entry, dict):
                continue
            if entry.get("auth"):
                try:
                    user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
                except (binascii.Error, UnicodeDecodeError, TypeError):
                    sep = ""
                if not sep:
                    raise SettingsError(f"bad 'auth' for {key} in {path}",
                                        hint="it must be base64 of 'user:password'")
                return user, password
            if entry.get("username") and entry.get("password") is not None:
                return str(entry["username"]), str(entry["password"])
    return None


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="…",service="…",scope="…"`` (a ``WWW-Authenticate`` value) →
    ``("bearer", {"realm": …, "service": …, "scope": …})``."""
    scheme, _, rest = header.strip().partition(" ")
    params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
              for m in re.finditer(r'([A-Za-z_]+)\s*=\s*(?:"([^"]*)"|([^,\s]*))', rest)}
    return scheme.lower(), params


def _ref_artifact(desc: Descriptor) -> dict[str, Any]:
    return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST, "artifactType": ARTIFACT_REF,
            "config": {"mediaType": MEDIA_TYPE_EMPTY, "digest": EMPTY_DIGEST, "size": 2,
                       "data": "e30="},
            "layers": [desc.to_oci()]}


def _record_artifact(namespace: str, name: str, data: bytes, written: float) -> dict[str, Any]:
    return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST,
            "artifactType": ARTIFACT_RECORD,
            "config": {"mediaType": MEDIA_TYPE_EMPTY, "digest": EMPTY_DIGEST, "size": 2,
                       "data": "e30="},
            "layers": [{"mediaType": ARTIFACT_RECORD,
                        "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
                        "size": len(data), "data": base64.b64encode(data).decode()}],
            "annotations": {ANN_NAMESPACE: namespace, ANN_NAME: name,
                            ANN_WRITTEN: f"{written:.3f}"}}


def _is_manifest(data: bytes, media_type: str) -> bool:
    """Whether ``data`` is a manifest/index of ``media_type`` that can be tagged as it is."""
    try:
        doc = json.loads(data)
    except ValueError:
        return False
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
        return False
    if doc.get("mediaType", media_type) != media_type:
        return False
    if media_type in (MEDIA_TYPE_MANIFEST, MEDIA_TYPE_DOCKER_MANIFEST):
        return isinstance(doc.get("config"), dict) and isinstance(doc.get("layers"), list)
    return isinstance(doc.get("manifests"), list)


# -- HTTP ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Response:
    status: int
    headers: http.client.HTTPMessage
    body: bytes
    url: str

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default) or default

    def error_code(self) -> str:
        try:
            errors = json.loads(self.body).get("errors") or []
            return str(errors[0].get("code", "")) if errors else ""
        except (ValueError, AttributeError, IndexError, TypeError):
            return ""

    def error_text(self) -> str:
        try:
            err = (json.loads(self.body).get("errors") or [{}])[0]
            return f"{err.get('code', '')}: {err.get('message', '')}".strip(": ")
        except (ValueError, AttributeError, IndexError, TypeError):
            return self.body[:120].decode("utf-8", "replace").strip()


class _Pool:
    """Keep-alive connections per ``(scheme, netloc)``, shared by threads: a request takes one
    (or opens one) and gives it back once its response was read to the end."""

    def __init__(self, timeout: float, connect_timeout: float) -> None:
        self._free: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._ssl: ssl.SSLContext | None = None  # made on first HTTPS use (~20 ms)

    def take(self, scheme: str, netloc: str,
             guard: Callable[..., socket.socket] | None = None) -> http.client.HTTPConnection:
        """A connection to ``netloc``; a new one connects through ``guard`` if given (the
        address check of ``_http_guard.guarded_connect``)."""
        with self._lock:
            free = self._free.get((scheme, netloc))
            if free:
                return free.pop()
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                netloc, timeout=self.connect_timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(netloc, timeout=self.connect_timeout)
        if guard is not None:
            conn._create_connection = guard  # type: ignore[attr-defined]
        return conn

    def give(self, scheme: str, netloc: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            free = self._free.setdefault((scheme, netloc), [])
            if len(free) < 16:
                free.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns = [c for free in self._free.values() for c in free]
            self._free.clear()
        for c in conns:
            c.close()


class _Stream(io.RawIOBase):
    """A response body read as a stream; the connection goes back to the pool once the body is
    read to the end (closed otherwise). If the connection breaks, the rest is fetched with a
    ``Range`` request (pinned to the digest), at most ``resumes`` times. The whole download,
    resumes included, ends by ``deadline`` (monotonic): the connection is shut down then."""

    def __init__(self, store: RegistryStore, url: str, resp: http.client.HTTPResponse,
                 conn: http.client.HTTPConnection, size: int, resumes: int,
                 deadline: float) -> None:
        super().__init__()
        self._store, self._url, self._resp, self._conn = store, url, resp, conn
        self._size, self._pos, self._resumes = size, 0, resumes
        self._deadline = deadline
        self._token = WATCHDOG.arm(deadline, conn)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while True:
            if self._pos >= self._size:
                self._release()
                return 0
            try:
                n = self._resp.readinto(view[:self._size - self._pos])
            except (OSError, http.client.HTTPException) as e:
                self._resume(e)
                continue
            if n == 0:
                self._resume(None)
                continue
            self._pos += n
            if self._pos >= self._size:
                self._release()
            return n

    def _release(self) -> None:
        fired = not WATCHDOG.disarm(self._token)
        if self._conn is not None:
            split = urllib.parse.urlsplit(self._url)
            if self._resp.will_close or fired:
                self._conn.close()
            else:
                self._resp.read()  # nothing left: completes the response for reuse
                self._store._pool.give(split.scheme, split.netloc, self._conn)
            self._conn = None

    def _resume(self, cause: BaseException | None) -> None:
        WATCHDOG.disarm(self._token)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if time.monotonic() >= self._deadline:
            raise self._store._too_slow("read", f"broke off at byte {self._pos} of "
                                                f"{self._size} of {self._url}")
        if self._resumes <= 0:
            why = f"{type(cause).__name__}: {cause}" if cause else "the connection closed early"
            raise StoreUnavailable(f"read {self._url}: broke off at byte {self._pos} of "
                                   f"{self._size} ({why})",
                                   hint="the registry dropped the connection repeatedly; "
                                        "retry later")
        self._resumes -= 1
        time.sleep(random.uniform(0, 0.2))
        resp, conn = self._store._open_stream(
            self._url, {"Range": f"bytes={self._pos}-"}, want=(206,), deadline=self._deadline)
        if conn is None:
            raise StoreError(f"read {self._url}: resuming at byte {self._pos} answered "
                             f"{resp.status} {resp.error_text()}".rstrip())
        self._resp, self._conn = resp, conn
        self._token = WATCHDOG.arm(self._deadline, conn)

    def close(self) -> None:
        WATCHDOG.disarm(self._token)
        if not self.closed and self._conn is not None:
            self._conn.close()  # not read to the end: the connection cannot be reused
            self._conn = None
        super().close()


# -- the store -----------------------------------------------------------------------------


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
        self.insecure = tuple(insecure)
        self.scheme = "http" if plain_http(self.address.hostname, self.insecure) else "https"
        self.chunk_size = chunk_size
        self.attempts = max(1, attempts)
        self.resume_attempts = resume_attempts
        self.backoff = backoff
        environ = os.environ if environ is None else environ
        self.deadline = deadline
        if blob_hosts is None:
            blob_hosts = environ.get("ENVBUILD_REGISTRY_BLOB_HOSTS", "").split(",")
        self.blob_hosts = (frozenset(h.strip().lower() for h in blob_hosts if h.strip())
                           | KNOWN_BLOB_HOSTS.get(self.address.hostname, frozenset()))
        self._guard: Callable[..., socket.socket] | None = None
        files = list(auth_paths) if auth_paths is not None else auth_files(environ)
        self.credentials = (credentials if credentials is not None
                            else find_credentials(self.address, files))
        self._pool = _Pool(timeout, connect_timeout)
        self._auth: str | None = None  # the Authorization header value that works
        self._auth_lock = threading.Lock()
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

    def close(self) -> None:
        self._pool.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _base(self) -> str:
        return f"{self.scheme}://{self.address.host}/v2/{self.address.repo}"

    def _where(self) -> str:
        return f"registry {self.address.host}"

    def _open(self) -> None:
        resp = self._request("GET", f"{self.scheme}://{self.address.host}/v2/",
                             attempts=1, what="open")
        if resp.status == 404:
            raise StoreUnavailable(f"open {self.url}: {self.address.host} is not an OCI "
                                   "registry (GET /v2/ answered 404)",
                                   hint="check the host and port of the store URL")
        if resp.status != 200:
            raise self._status_error(resp, "open")

    def _request(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                 body: bytes | None = None, attempts: int | None = None,
                 what: str = "", give_up_quietly: bool = False,
                 limit: int = MAX_RESPONSE) -> _Response:
        """One request with retries (connection errors, 429, 5xx), the auth dance on 401 and
        redirects followed for GET/HEAD (``_redirect``); the whole response body is read, at
        most ``limit`` bytes, and all of it within ``deadline``. With ``give_up_quietly`` the
        last 429/5xx answer is returned instead of raised."""
        resp, _ = self._send(method, url, headers or {}, body, attempts, what,
                             stream=False, want=(), quiet=give_up_quietly, limit=limit)
        return resp

    def _open_stream(self, url: str, headers: Mapping[str, str], want: tuple[int, ...],
                     deadline: float | None = None) -> tuple[http.client.HTTPResponse, Any]:
        resp, conn = self._send("GET", url, headers, None, None, "read", stream=True, want=want,
                                deadline=deadline)
        return resp, conn  # type: ignore[return-value]

    def _same_registry(self, split: urllib.parse.SplitResult) -> bool:
        return (split.scheme, split.netloc.lower()) == (self.scheme, self.address.host)

    def _connect_guard(self) -> Callable[..., socket.socket]:
        """The connector for every host but the registry: public addresses, or the
        registry's own (``_http_guard.guarded_connect``)."""
        if self._guard is None:
            try:
                own = [a for _, a in resolve(self.address.hostname, 0)]
            except OSError:
                own = []
            self._guard = guarded_connect(own)
        return self._guard

    def _redirect(self, url: str, location: str, what: str) -> str:
        """Where a redirect from ``url`` may go: the registry itself or a blob host."""
        target = urllib.parse.urljoin(url, location)
        split = urllib.parse.urlsplit(target)
        host = (split.hostname or "").lower()
        if self._same_registry(split):
            return target
        if split.scheme in ("http", "https") and (split.netloc.lower() in self.blob_hosts
                                                  or host in self.blob_hosts):
            if split.scheme == "https" or plain_http(host, self.insecure):
                return target
        raise StoreError(f"{what or 'request'} {self.url}: {self._where()} redirected to "
                         f"{target[:120]}, which is neither the registry nor a blob host",
                         reference="redirect-refused",
                         hint="if the registry serves blobs from that host, allow it with "
                              "$ENVBUILD_REGISTRY_BLOB_HOSTS=HOST[:PORT] (plain HTTP also "
                              "needs --registry-insecure)")

    def _too_slow(self, what: str, detail: str = "") -> StoreUnavailable:
        return StoreUnavailable(
            f"{what} {self.url}: {self._where()} did not answer within the request deadline"
            f"{f' ({detail})' if detail else ''}",
            hint=f"the registry is too slow or stalls on purpose; a request may take "
                 f"{self.deadline:.0f} s (a blob download one more second per "
                 f"{MIN_RATE >> 10} KiB)")

    def _send(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None,
              attempts: int | None, what: str, *, stream: bool, want: tuple[int, ...],
              quiet: bool = False, limit: int = MAX_RESPONSE, deadline: float | None = None):
        attempts = attempts or self.attempts
        deadline = deadline if deadline is not None else time.monotonic() + self.deadline
        auth_tries = 0
        redirects = 0
        attempt = 0
        while True:
            split = urllib.parse.urlsplit(url)
            same_host = self._same_registry(split)
            hdrs = {"User-Agent": "envbuild", **headers}
            if body is not None:
                hdrs.setdefault("Content-Type", "application/octet-stream")
                hdrs["Content-Length"] = str(len(body))
            elif method in ("PUT", "POST", "PATCH"):
                hdrs["Content-Length"] = "0"
            if same_host and self._auth:
                hdrs["Authorization"] = self._auth
            path = split.path + (f"?{split.query}" if split.query else "")
            conn = self._pool.take(split.scheme, split.netloc,
                                   None if same_host else self._connect_guard())
            token = WATCHDOG.arm(deadline, conn)
            try:
                if conn.sock is None:
                    conn.connect()
                if time.monotonic() >= deadline:
                    raise TimeoutError("deadline")
                conn.request(method, path, body=body, headers=hdrs)
                if conn.sock is not None:
                    conn.sock.settimeout(self._pool.timeout)
                raw = conn.getresponse()
                status = raw.status
                if stream and status in want:
                    return raw, conn
                if status == 416:
                    # distribution sends the blob's Content-Length with Go's short 416 text:
                    # the body cannot be read in step with the header, so drop the connection
                    conn.close()
                    return _Response(status, raw.headers, b"", url), None
                # (error answers get the limit of small ones; HEAD reads b"" and completes)
                data = read_body(raw, limit if 200 <= status < 300 else MAX_RESPONSE)
            except BodyTooLarge as e:
                conn.close()
                size = f"{e.declared} bytes" if e.declared is not None else "more"
                raise StoreError(f"{what or method.lower()} {self.url}: {self._where()} sent "
                                 f"{size} for an answer of at most {e.limit} bytes",
                                 reference="response-too-large",
                                 hint="the registry is misbehaving or hostile; nothing of the "
                                      "answer was kept") from None
            except AddressRefused as e:
                conn.close()
                raise StoreError(f"{what or method.lower()} {self.url}: refusing to connect "
                                 f"to {split.netloc}: {e}", reference="redirect-refused",
                                 hint="a registry may send clients to public addresses only, "
                                      "or to its own") from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if time.monotonic() >= deadline:
                    raise self._too_slow(what or method.lower()) from None
                attempt += 1
                if attempt >= attempts:
                    raise self._unreachable(e, what, attempts, split.netloc) from None
                self._sleep(attempt, deadline=deadline)
                continue
            finally:
                if not WATCHDOG.disarm(token):
                    conn.close()  # shut down at the deadline: never back to the pool
            resp = _Response(status, raw.headers, data, url)
            if raw.will_close:
                conn.close()
            else:
                self._pool.give(split.scheme, split.netloc, conn)
            if status in _RETRY_STATUS:
                attempt += 1
                if attempt < attempts and time.monotonic() < deadline:
                    self._sleep(attempt, resp.header("Retry-After"), deadline=deadline)
                    continue
                if quiet:
                    return resp, None
                raise StoreUnavailable(
                    f"{what or method.lower()} {self.url}: {self._where()} answered {status} "
                    f"{resp.error_text() or raw.reason} ({attempt} attempts)",
                    hint="the registry is overloaded or failing; retry later")
            if status == 401 and same_host and auth_tries < 2:
                auth_tries += 1
                if self._authenticate(resp.header("WWW-Authenticate"), what):
                    continue
            if status in (301, 302, 303, 307, 308) and method in ("GET", "HEAD") \
                    and redirects < 5 and resp.header("Location"):
                redirects += 1
                url = self._redirect(url, resp.header("Location"), what)
                continue
            if status == 401:
                raise self._denied(resp, what)
            if status == 403:
                right = "push" if method in ("PUT", "POST", "PATCH", "DELETE") else "pull"
                raise StoreUnavailable(
                    f"{what or method.lower()} {self.url}: {self._where()} denied access "
                    f"(403 {resp.error_text()})".rstrip(),
                    hint=f"the account has no {right} permission on {self.address.repo}; "
                         "check it with the registry's administrator")
            return resp, None

    def _sleep(self, attempt: int, retry_after: str = "", *,
               deadline: float = float("inf")) -> None:
        delay = min(2.0, self.backoff * (2 ** (attempt - 1)))
        if retry_after.isdigit():
            delay = min(5.0, float(retry_after))
        delay = min(random.uniform(delay / 2, delay), deadline - time.monotonic())
        if delay > 0:
            time.sleep(delay)

    def _unreachable(self, e: BaseException, what: str, attempts: int,
                     netloc: str) -> StoreUnavailable:
        cause = (e.strerror if isinstance(e, OSError) and e.strerror
                 else str(e) or type(e).__name__)
        # a garbled answer (http.client.BadStatusLine) carries what the server sent: one line
        cause = " ".join(cause.split())[:160]
        if isinstance(e, ssl.SSLError):
            return StoreUnavailable(
                f"{what or 'request'} {self.url}: TLS with {netloc} failed: {cause}",
                hint=f"if {self.address.hostname} serves plain HTTP, pass "
                     f"--registry-insecure {self.address.hostname}")
        if isinstance(e, socket.gaierror):
            return StoreUnavailable(f"{what or 'request'} {self.url}: unknown host {netloc} "
                                    f"({cause})", hint="check the host in the store URL")
        return StoreUnavailable(
            f"{what or 'request'} {self.url}: cannot reach {netloc}: {cause} "
            f"({attempts} attempt{'s' if attempts > 1 else ''})",
            hint="check the store URL and that the registry is up")

    def _denied(self, resp: _Response, what: str) -> StoreUnavailable:
        files = " or ".join(str(p) for p in auth_files(os.environ)) or "~/.docker/config.json"
        if self.credentials is None:
            return StoreUnavailable(
                f"{what or 'request'} {self.url}: {self._where()} requires credentials (401)",
                hint=f"log in (podman login {self.address.host}, or docker login); envbuild "
                     f"reads {files}")
        return StoreUnavailable(
            f"{what or 'request'} {self.url}: {self._where()} refused the credentials of "
            f"{self.credentials[0]!r} (401 {resp.error_text()})".rstrip(),
            hint=f"check the user and password for {self.address.host} in {files}")

    def _authenticate(self, challenge: str, what: str) -> bool:
        """Answer a 401 challenge; True if there is a new Authorization header to try."""
        scheme, params = parse_challenge(challenge)
        basic = None
        if self.credentials is not None:
            basic = "Basic " + base64.b64encode(
                f"{self.credentials[0]}:{self.credentials[1]}".encode()).decode()
        with self._auth_lock:
            if scheme == "basic":
                if basic is None or self._auth == basic:
                    return False
                self._auth = basic
                return True
            if scheme != "bearer" or not params.get("realm"):
                return False
            token = self._fetch_token(params, basic, what)
            new = f"Bearer {token}"
            if new == self._auth:
                return False
            self._auth = new
            return True

    def _fetch_token(self, params: Mapping[str, str], basic: str | None, what: str) -> str:
        query = {k: params[k] for k in ("service", "scope") if params.get(k)}
        if "scope" not in query:
            query["scope"] = f"repository:{self.address.repo}:pull"
        if self.credentials is not None:
            query["account"] = self.credentials[0]
        realm = params["realm"]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        split = urllib.parse.urlsplit(url)
        if split.scheme not in ("http", "https"):
            raise StoreError(f"{what or 'request'} {self.url}: the registry's auth realm "
                             f"{realm[:120]!r} is not an http(s) URL")
        conn = self._pool.take(split.scheme, split.netloc,
                               None if self._same_registry(split) else self._connect_guard())
        headers = {"User-Agent": "envbuild"}
        if basic:
            headers["Authorization"] = basic
        token = WATCHDOG.arm(time.monotonic() + self.deadline, conn)
        try:
            conn.request("GET", split.path + "?" + split.query, headers=headers)
            raw = conn.getresponse()
            data = read_body(raw, MAX_RESPONSE)
        except BodyTooLarge:
            raise StoreError(f"{what or 'request'} {self.url}: the token server "
                             f"{split.netloc} sent an answer over {MAX_RESPONSE} bytes",
                             reference="response-too-large") from None
        except (OSError, http.client.HTTPException) as e:
            raise StoreUnavailable(f"{what or 'request'} {self.url}: cannot reach the token "
                                   f"server {split.netloc}: {e}",
                                   hint="the registry sent clients to this auth realm; "
                                        "check that it is up") from None
        finally:
            WATCHDOG.disarm(token)
            conn.close()
        if raw.status in (401, 403):
            files = " or ".join(str(p) for p in auth_files(os.environ)) or "an auth file"
            who = (f"the credentials of {self.credentials[0]!r}" if self.credentials
                   else "anonymous access")
            raise StoreUnavailable(f"{what or 'request'} {self.url}: the token server "
                                   f"{split.netloc} refused {who} ({raw.status})",
                                   hint=f"log in (podman login {self.address.host}); envbuild "
                                        f"reads {files}")
        try:
            doc = json.loads(data)
            token = doc.get("token") or doc.get("access_token")
            if not isinstance(token, str) or not token:
                raise ValueError("no token in the answer")
        except (ValueError, AttributeError) as e:
            raise StoreUnavailable(f"{what or 'request'} {self.url}: bad answer from the "
                                   f"token server {split.netloc} ({raw.status}: {e})") from None
        return token

    def _status_error(self, resp: _Response, what: str) -> StoreError:
        return StoreError(f"{what} {self.url}: {self._where()} answered {resp.status} "
                          f"{resp.error_text()}".rstrip())

    # -- blobs ---------------------------------------------------------------------------------

    def _blob_url(self, digest: str) -> str:
        check_digest(digest)
        return f"{self._base()}/blobs/{digest}"

    def _head_blob(self, digest: str) -> int | None:
        resp = self._request("HEAD", self._blob_url(digest), what=f"stat blob {digest} in")
        if resp.status == 200:
            return int(resp.header("Content-Length", "0"))
        if resp.status == 404:
            return None
        raise self._status_error(resp, f"stat blob {digest} in")

    def _head_manifest(self, ref: str, *, fallback: bool = False) -> tuple[str, int, str] | None:
        """``(digest, size, media type)`` of manifest ``ref`` (tag or digest), or ``None``.
        ``fallback``: asked because the digest is not a blob — distribution answers 500 for a
        digest it holds as a blob of another repository but cannot parse as a manifest, and
        that means "not a manifest here" (the blob HEAD just before showed the registry up)."""
        resp = self._request("HEAD", f"{self._base()}/manifests/{ref}",
                             headers={"Accept": _ACCEPT}, what=f"stat manifest {ref} in",
                             attempts=1 if fallback else None, give_up_quietly=fallback)
        if resp.status == 404 or (fallback and resp.status >= 500):
            return None
        if resp.status != 200:
            raise self._status_error(resp, f"stat manifest {ref} in")
        return (resp.header("Docker-Content-Digest"), int(resp.header("Content-Length", "0")),
                resp.header("Content-Type").split(";")[0].strip())

    def _get_manifest(self, ref: str, what: str) -> tuple[bytes, str, str] | None:
        """``(bytes, digest, media type)`` of manifest ``ref`` verified against its digest (the
        one asked for, or the registry's ``Docker-Content-Digest``), or ``None`` if absent."""
        resp = self._request("GET", f"{self._base()}/manifests/{ref}",
                             headers={"Accept": _ACCEPT}, what=what)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise self._status_error(resp, what)
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

    def put(self, digest: str, data: bytes | BinaryIO, *, size: int | None = None) -> None:
        url = self._blob_url(digest)
        if self._head_blob(digest) is not None:
            return
        if isinstance(data, (bytes, bytearray, memoryview)):
            data = io.BytesIO(bytes(data))
        self._upload(digest, data, size, url)

    def _start_upload(self, extra: str = "") -> _Response:
        return self._request("POST", f"{self._base()}/blobs/uploads/{extra}",
                             what="start upload to")

    def _upload(self, digest: str, data: BinaryIO, size: int | None, url: str) -> None:
        resp = self._start_upload()
        if resp.status != 202 or not resp.header("Location"):
            raise self._status_error(resp, "start upload to")
        location = urllib.parse.urljoin(resp.url, resp.header("Location"))
        h, count, done = hashlib.sha256(), 0, False
        limit = None if size is None else size + 1  # one byte more proves "too long"
        try:
            first = True
            while True:
                want = self.chunk_size if limit is None else min(self.chunk_size, limit - count)
                chunk = _read_full(data, want) if want > 0 else b""
                h.update(chunk)
                count += len(chunk)
                final = len(chunk) < want or want == 0
                if final and first:
                    break  # small blob: the body goes with the closing PUT (monolithic)
                first = False
                if chunk:
                    location = self._patch(location, chunk, count - len(chunk))
                    chunk = b""
                if final:
                    break
            actual = "sha256:" + h.hexdigest()
            if actual != digest or (size is not None and count != size):
                raise mismatch_on_put(digest, actual, count, size)
            sep = "&" if urllib.parse.urlsplit(location).query else "?"
            resp = self._request("PUT", f"{location}{sep}digest={digest}",
                                 body=chunk if first else None, what=f"upload blob {digest} to")
            if resp.status == 400 and resp.error_code() == "DIGEST_INVALID":
                raise DigestMismatch(f"refusing to store blob {digest}: the registry "
                                     "computed another digest for the bytes it received",
                                     hint="a proxy altered the upload; nothing was stored")
            if resp.status != 201 and self._head_blob(digest) is None:
                # (a PUT retried after a dropped answer finds its session closed, but the
                # blob stored: that is success)
                raise self._status_error(resp, f"upload blob {digest} to")
            done = True
        finally:
            if not done:
                try:  # cancel the session: a registry keeps partial uploads otherwise
                    self._request("DELETE", location, attempts=1, what="cancel upload to")
                except StoreError:
                    pass

    def _patch(self, location: str, chunk: bytes, start: int) -> str:
        """Send one chunk at ``start`` of an upload; on failure resume from the offset the
        registry has; returns the next upload location."""
        offset = 0
        for attempt in range(self.attempts):
            piece = chunk[offset:]
            try:
                resp = self._request(
                    "PATCH", location, body=piece, attempts=1, what="upload chunk to",
                    headers={"Content-Range": f"{start + offset}-{start + len(chunk) - 1}"})
            except StoreUnavailable:
                resp = None
            if resp is not None and resp.status == 202:
                return urllib.parse.urljoin(resp.url, resp.header("Location") or location)
            if resp is not None and resp.status not in _RETRY_STATUS:
                raise self._status_error(resp, "upload chunk to")
            if attempt + 1 >= self.attempts:
                break
            self._sleep(attempt + 1)
            # how much of the upload did the registry keep?
            status = self._request("GET", location, what="check upload to")
            if status.status != 204:
                raise self._status_error(status, "check upload to")
            location = urllib.parse.urljoin(status.url, status.header("Location") or location)
            have = status.header("Range").rpartition("-")[2]
            kept = int(have) + 1 if have.isdigit() else 0
            if not start <= kept <= start + len(chunk):
                raise StoreError(f"upload to {self.url}: the registry holds {kept} bytes of "
                                 f"an upload at byte {start}; cannot resume")
            offset = kept - start
            if offset == len(chunk):
                return location
        raise StoreUnavailable(f"upload to {self.url}: a chunk failed {self.attempts} times",
                               hint="the registry or the network is failing; retry later")

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
        resp = self._start_upload(f"?{query}")
        if resp.status == 201:
            return True
        if resp.status == 202 and resp.header("Location"):  # not mounted: a session opened
            self._request("DELETE", urllib.parse.urljoin(resp.url, resp.header("Location")),
                          attempts=1, what="cancel upload to")
        return False

    def get(self, digest: str) -> BinaryIO:
        url = self._blob_url(digest)
        resp, conn = self._open_stream(url, {}, want=(200,))
        if isinstance(resp, _Response):
            if resp.status == 404:
                got = self._get_manifest(digest, f"read {digest} from")
                if got is None:
                    raise blob_not_found(digest)
                body = io.BytesIO(got[0])
                return VerifyingReader(body, digest, size=len(got[0]))  # type: ignore[return-value]
            raise self._status_error(resp, f"read blob {digest} from")
        size = int(resp.getheader("Content-Length") or -1)
        if size < 0:
            conn.close()
            raise StoreError(f"read blob {digest} from {self.url}: no Content-Length")
        stream = _Stream(self, url, resp, conn, size, self.resume_attempts,
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
        resp = self._request("GET", self._blob_url(digest),
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
        raise self._status_error(resp, f"read blob {digest} from")

    def get_tail(self, digest: str, length: int) -> tuple[bytes, int]:
        """The last ``length`` bytes (one suffix-range GET) and the blob's size; lazy readers
        use it to read a layer's footer without a HEAD first (as with ``S3Store``)."""
        check_tail_length(length)
        resp = self._request("GET", self._blob_url(digest),
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
            raise self._status_error(resp, f"read blob {digest} from")
        total = resp.header("Content-Range").rpartition("/")[2]
        if len(resp.body) > length:
            raise StoreError(f"read blob {digest} from {self.url}: asked for the last {length} "
                             f"bytes, {self._where()} sent {len(resp.body)}")
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
        resp = self._request("DELETE", self._blob_url(digest), what=f"delete blob {digest} in")
        if resp.status in (202, 204, 404):
            return
        raise self._delete_error(resp, f"delete blob {digest} in")

    def _delete_error(self, resp: _Response, what: str) -> StoreError:
        if resp.status == 405 or resp.error_code() == "UNSUPPORTED":
            return StoreError(f"{what} {self.url}: {self._where()} does not allow deletes",
                              reference="delete-unsupported",
                              hint="enable them in the registry's config (distribution: "
                                   "storage: delete: enabled: true)")
        return self._status_error(resp, what)

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
            doc = _json_or_none(got[0])
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
        doc = _json_or_none(data)
        if not isinstance(doc, dict):
            return
        children = list(doc.get("manifests") or [])
        children += [doc["config"]] if isinstance(doc.get("config"), dict) else []
        children += list(doc.get("layers") or [])
        for child in children:
            yield from self._reachable_desc(child, seen)

    def _tags(self) -> list[str]:
        """All tags of REPO (``tags/list``, following ``Link`` pages on the registry); none if
        REPO is new. More than ``MAX_TAG_PAGES`` pages or ``MAX_TAGS`` tags is refused."""
        url = f"{self._base()}/tags/list?n=1000"
        tags: list[str] = []
        for _ in range(MAX_TAG_PAGES):
            resp = self._request("GET", url, what="list tags of")
            if resp.status == 404:
                return tags  # NAME_UNKNOWN: nothing was pushed yet
            if resp.status != 200:
                raise self._status_error(resp, "list tags of")
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
            if not self._same_registry(urllib.parse.urlsplit(url)):
                raise StoreError(f"list tags of {self.url}: the next page is on another host "
                                 f"({url[:120]})", hint="the registry is misbehaving or hostile")
        raise StoreError(f"list tags of {self.url}: more than {MAX_TAGS} tags or "
                         f"{MAX_TAG_PAGES} pages", reference="too-many-tags",
                         hint="the registry is misbehaving, or the repository holds more tags "
                              "than envbuild lists; use a repository of its own for the store")

    # -- manifests and tags --------------------------------------------------------------------

    def _ensure_empty(self) -> None:
        if not self._empty_uploaded:
            self.put(EMPTY_DIGEST, EMPTY_JSON)
            self._empty_uploaded = True

    def _put_manifest(self, tag: str, body: bytes, media_type: str, what: str) -> str:
        for attempt in range(1, self.attempts + 1):
            resp = self._request("PUT", f"{self._base()}/manifests/{tag}", body=body,
                                 headers={"Content-Type": media_type}, what=what)
            # distribution 2.8 answers DIGEST_INVALID to one of two concurrent PUTs of
            # different manifests to one tag (its filesystem writes are not atomic): the
            # bytes are ours, so try again; a persistent one is reported below
            if resp.status == 201 or resp.error_code() != "DIGEST_INVALID":
                break
            if attempt < self.attempts:
                self._sleep(attempt)
        if resp.status != 201:
            code = resp.error_code()
            hint = None
            if code == "MANIFEST_BLOB_UNKNOWN":
                hint = "push the blobs a manifest names before the manifest (envbuild push does)"
            elif code in ("MANIFEST_INVALID", "UNSUPPORTED"):
                hint = f"the registry does not accept {media_type} manifests"
            raise StoreError(f"{what} {self.url}: {self._where()} refused the manifest "
                             f"({resp.status} {resp.error_text()})", hint=hint)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        got = resp.header("Docker-Content-Digest")
        if got and got != digest:
            raise DigestMismatch(f"{what} {self.url}: the registry stored the manifest as "
                                 f"{got}, not {digest}",
                                 hint="a proxy altered the manifest; check the registry")
        return digest

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
        resp = self._request("DELETE", f"{self._base()}/manifests/{digest}", what=what)
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
            if _is_manifest(data, media_type):
                self._put_manifest(tag, data, media_type, f"publish ref {name} in")
                return desc
        self._ensure_empty()
        self._put_manifest(tag, canonical_json(_ref_artifact(desc)), MEDIA_TYPE_MANIFEST,
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
            if isinstance(kind, str) and kind.startswith(_ARTIFACT_PREFIX):
                raise StoreError(f"ref {name} in {self.url} is an envbuild artifact of type "
                                 f"{kind!r}, which this envbuild does not know",
                                 reference="unsupported-format",
                                 hint="it was written by another envbuild version; upgrade")
        return Descriptor(media_type, digest, len(body), {})

    def list_refs(self) -> list[str]:
        return sorted(r for r in map(tag_to_ref, self._tags()) if r is not None)

    def delete_ref(self, name: str) -> None:
        self._delete_tag(ref_to_tag(name), f"delete ref {name} in")

    # -- records -------------------------------------------------------------------------------

    def put_record(self, namespace: str, name: str, obj: Mapping[str, Any]) -> None:
        tag = record_to_tag(namespace, name)
        data = encode_record(obj)
        self.put("sha256:" + hashlib.sha256(data).hexdigest(), data)
        self._ensure_empty()
        manifest = _record_artifact(namespace, name, data, time.time())
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

    def list_records(self, namespace: str) -> list[str]:
        check_record_name(namespace, "x")
        return sorted(rec[1] for rec in map(tag_to_record, self._tags())
                      if rec is not None and rec[0] == namespace)

    def delete_record(self, namespace: str, name: str) -> None:
        tag = record_to_tag(namespace, name)
        self._delete_tag(tag, f"delete record {namespace}/{name} in")


def _json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _read_full(f: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes; fewer only at the end of ``f``."""
    parts, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts) if len(parts) != 1 else parts[0]
