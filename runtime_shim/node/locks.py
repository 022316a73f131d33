"""Reading locks from a store: a ref or digest → the layers and runtime config to launch.

A lock is an OCI image manifest + config written by ``envbuild lock`` (see
``envbuild.plan.lockspec`` for the format and ``envbuild.oci`` for the annotation keys). This
side only reads; it verifies every blob it reads (the store does) and refuses a manifest that
is not an image manifest or whose layers are not ``tar``, ``tar+gzip`` or ``tar+zstd``
(foreign layers, not in envbuild's format, run through the node cache's full unpack).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from envbuild.canonical import load_json
from envbuild.errors import (
    BlobNotFound,
    DigestMismatch,
    LockNotFound,
    RefNotFound,
    RuntimeShimError,
    StoreError,
    StoreUnavailable,
)
from envbuild.oci import (
    ANNOTATION_KEY,
    ANNOTATION_NAME,
    ANNOTATION_ROLE,
    ANNOTATION_TOC,
    LABEL_HOSTNAME,
    MEDIA_TYPE_LAYER_ZSTD,
    MEDIA_TYPE_MANIFEST,
    is_digest,
)
from envbuild.store import Store, get_json
from envbuild.store.sync import resolve_ref
from runtime_shim.node.tasklock import is_task_manifest, task_env_lock

#: what ``runtime_shim.node.nodecache.LAYER_MEDIA_TYPES`` unpacks (issue 16: foreign layers)
_LAYER_TYPES = frozenset({"application/vnd.oci.image.layer.v1.tar",
                          "application/vnd.oci.image.layer.v1.tar+gzip", MEDIA_TYPE_LAYER_ZSTD,
                          "application/vnd.docker.image.rootfs.diff.tar.gzip"})


@dataclasses.dataclass(frozen=True)
class LayerRef:
    digest: str
    size: int
    diff_id: str
    name: str
    role: str
    toc_digest: str
    key: str
    #: the descriptor's mediaType; a foreign (non-envbuild) layer is unpacked in full
    media_type: str = MEDIA_TYPE_LAYER_ZSTD


@dataclasses.dataclass(frozen=True)
class ResolvedLock:
    """What a sandbox is made of: layers bottom to top and the runtime config."""

    digest: str
    layers: tuple[LayerRef, ...]
    env: Mapping[str, str]
    workdir: str
    user: str
    cmd: tuple[str, ...] | None
    hostname: str | None
    manifest: Mapping[str, Any] = dataclasses.field(repr=False)
    config: Mapping[str, Any] = dataclasses.field(repr=False)


def lock_digest(store: Store, ref_or_digest: str) -> str:
    """``sha256:…`` as is; ``env/NAME``, ``snap/NAME`` or a bare env name through the store's
    refs — the same rule as ``envbuild.store.sync.resolve_ref`` (the name itself, then
    ``env/NAME``), so push, job resolve and sandboxes agree on what a name means."""
    if is_digest(ref_or_digest):
        return ref_or_digest
    try:
        return store.get_ref(resolve_ref(store, ref_or_digest)).digest
    except RefNotFound:
        pass
    refs = ", ".join(store.list_refs()[:10]) or "none"
    raise LockNotFound(f"no lock named {ref_or_digest!r} in {store!r}",
                       hint=f"refs there: {refs}; build and lock it with `envbuild build`")


#: A lock's manifest and config are KBs (a manifest of 200 layers is ~100 KB): a bigger blob
#: named as a lock is refused before it is read, not parsed into memory.
MAX_LOCK_JSON = 4 << 20


def resolve(store: Store, ref_or_digest: str, *, via_task: bool = False) -> ResolvedLock:
    """The lock ``ref_or_digest`` names, read and checked: its manifest and config are at most
    ``MAX_LOCK_JSON`` bytes each and of the OCI shape, or one ``RuntimeShimError``
    (``LockNotFound`` when the store has no such ref or manifest). A task lock
    (``runtime_shim.node.tasklock``) resolves to the env lock it names (``via_task``: this is
    that env lock, which must not be a task again)."""
    digest = lock_digest(store, ref_or_digest)
    try:
        manifest = _lock_json(store, digest)
    except BlobNotFound:
        raise LockNotFound(f"no lock {digest} in {store!r}",
                           hint="envbuild lock prints the digest of a built env") from None
    if is_task_manifest(manifest):  # a task's ref gives the agent's env, never its hidden layer
        env_lock = task_env_lock(manifest)
        if env_lock is None or via_task:
            raise RuntimeShimError(f"task lock {digest} names no env lock",
                                   hint="re-lock the task: envbuild lock TASK")
        return resolve(store, env_lock, via_task=True)
    if (not isinstance(manifest, dict) or manifest.get("mediaType") != MEDIA_TYPE_MANIFEST
            or not isinstance(manifest.get("config"), dict)):
        raise RuntimeShimError(f"{digest} is not an OCI image manifest",
                               hint="pass a lock digest or ref (envbuild lock prints it)")
    config_digest = manifest["config"].get("digest")
    if not is_digest(config_digest):
        raise RuntimeShimError(f"lock {digest}: its config digest {config_digest!r} is not a "
                               "sha256 digest")
    config = _lock_json(store, config_digest)
    try:
        return _parse(digest, manifest, config)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        # the store verified the bytes; their shape is what is wrong (a hand-made lock)
        raise RuntimeShimError(f"lock {digest}: manifest or config is not of the OCI shape "
                               f"({type(e).__name__}: {e})",
                               hint="rebuild and lock it with `envbuild build`") from None


def _lock_json(store: Store, digest: str) -> Any:
    """A lock's manifest or config, parsed: ``get_json``'s checks (at most ``MAX_LOCK_JSON``
    bytes, the digest verified, ``load_json``'s bounds, the same errors) in **one** ranged
    read of ``MAX_LOCK_JSON + 1`` bytes — what comes back tells the size — instead of a
    ``stat`` and a ``get``: over a link every request is a round trip, and a sandbox's create
    reads two of these before anything else (half of a lazy create's time before its mounts).
    Only for an ``S3Store`` with plain-HTTP ranges (its bodies are bounded by the range);
    other stores keep ``get_json`` (a registry may answer a range with the whole blob), and so
    does a ranged read that gets no answer (boto3's retries then decide)."""
    if getattr(store, "fast_ranges", False) is not True or not digest.startswith("sha256:"):
        return get_json(store, digest, max_size=MAX_LOCK_JSON)
    try:
        data = store.get_range(digest, 0, MAX_LOCK_JSON + 1)
    except StoreUnavailable:  # no answer over plain HTTP: the store's own client retries
        return get_json(store, digest, max_size=MAX_LOCK_JSON)
    if len(data) > MAX_LOCK_JSON:
        raise StoreError(f"blob {digest} is over {MAX_LOCK_JSON} bytes, too large for a JSON "
                         "document", hint="is this a layer digest where a manifest was expected?")
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise DigestMismatch(f"blob {digest}: its bytes do not match its digest (corrupt in "
                             "the store)", hint="rebuild or re-push the lock")
    try:
        return load_json(data, max_bytes=MAX_LOCK_JSON)
    except ValueError as e:
        raise StoreError(f"parse JSON blob {digest}: {e}",
                         hint="is this a layer digest where a manifest was expected?") from e


def _parse(digest: str, manifest: dict[str, Any], config: Any) -> ResolvedLock:
    diff_ids = config.get("rootfs", {}).get("diff_ids", [])
    descs = manifest.get("layers", [])
    if len(diff_ids) != len(descs):
        raise RuntimeShimError(f"lock {digest}: {len(descs)} layers but {len(diff_ids)} diff_ids")
    layers = []
    for desc, diff_id in zip(descs, diff_ids):
        if desc.get("mediaType") not in _LAYER_TYPES:
            raise RuntimeShimError(f"lock {digest}: layer {desc.get('digest')} has media type "
                                   f"{desc.get('mediaType')!r}; envbuild runs tar, tar+gzip "
                                   "and tar+zstd layers")
        ann = desc.get("annotations") or {}
        layers.append(LayerRef(digest=desc["digest"], size=desc["size"], diff_id=diff_id,
                               name=ann.get(ANNOTATION_NAME, ""), role=ann.get(ANNOTATION_ROLE, ""),
                               toc_digest=ann.get(ANNOTATION_TOC, ""), key=ann.get(ANNOTATION_KEY, ""),
                               media_type=desc["mediaType"]))
    c = config.get("config") or {}
    env = dict(item.partition("=")[::2] for item in c.get("Env") or [])
    return ResolvedLock(digest=digest, layers=tuple(layers), env=env,
                        workdir=c.get("WorkingDir") or "/", user=c.get("User") or "0:0",
                        cmd=tuple(c["Cmd"]) if c.get("Cmd") else None,
                        hostname=(c.get("Labels") or {}).get(LABEL_HOSTNAME),
                        manifest=manifest, config=config)
