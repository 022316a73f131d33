"""How a ``RegistryStore`` names and represents refs and records in an OCI registry: the store's
URL, the tag rule, and the small OCI artifacts that hold ref descriptors and records (store
format version 1; see ``envbuild.store.registry`` for the whole mapping). Pure: no I/O.

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
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import ipaddress
import json
import re
import urllib.parse
from collections.abc import Iterable
from typing import Any

from envbuild.errors import SettingsError, StoreError
from envbuild.oci import is_hex64
from envbuild.store.base import (
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_MANIFEST,
    Descriptor,
    check_record_name,
    check_ref_name,
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
ARTIFACT_PREFIX = "application/vnd.envbuild."
ANN_NAMESPACE = "dev.envbuild.record.namespace"
ANN_NAME = "dev.envbuild.record.name"
ANN_WRITTEN = "dev.envbuild.record.written"
#: Manifests and records are small; refuse to buffer anything larger.
MAX_MANIFEST_SIZE = 4 * MiB

_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_ENV_TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,127}")
_REPO_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"  # distribution's path component
_REPO_RE = re.compile(rf"{_REPO_COMPONENT}(?:/{_REPO_COMPONENT})*")
_RESERVED_TAG_PREFIXES = ("envbuild-", "sha256-")
_KEY_PREFIX = "envbuild-key-"
_REF_PREFIX = "envbuild-ref-"
_REC_PREFIX = "envbuild-rec-"
_ESC = {"_": "__", "/": "_s", ":": "_c", "@": "_a", "+": "_p"}
_UNESC = {v[1]: k for k, v in _ESC.items()}


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
    if namespace == "keys/v1" and is_hex64(name):
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
        return ("keys/v1", name) if is_hex64(name) else None
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


def ref_artifact(desc: Descriptor) -> dict[str, Any]:
    return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST, "artifactType": ARTIFACT_REF,
            "config": {"mediaType": MEDIA_TYPE_EMPTY, "digest": EMPTY_DIGEST, "size": 2,
                       "data": "e30="},
            "layers": [desc.to_oci()]}


def record_artifact(namespace: str, name: str, data: bytes, written: float) -> dict[str, Any]:
    return {"schemaVersion": 2, "mediaType": MEDIA_TYPE_MANIFEST,
            "artifactType": ARTIFACT_RECORD,
            "config": {"mediaType": MEDIA_TYPE_EMPTY, "digest": EMPTY_DIGEST, "size": 2,
                       "data": "e30="},
            "layers": [{"mediaType": ARTIFACT_RECORD,
                        "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
                        "size": len(data), "data": base64.b64encode(data).decode()}],
            "annotations": {ANN_NAMESPACE: namespace, ANN_NAME: name,
                            ANN_WRITTEN: f"{written:.3f}"}}


def is_manifest(data: bytes, media_type: str) -> bool:
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


def json_or_none(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None
