"""Copying between stores: ``push`` / ``pull`` of locks, and the remote build cache.

One function does both directions, ``sync(src, dst, refs=..., keys=...)``:

1. **blobs** — for each ref, the blob it points at and everything below it (an image manifest's
   config and layers; an index's manifests, recursively; a task lock's env lock, named by its
   annotation ``org.envbuild.task.env.lock``, and what that reaches), copied with ``copy_blobs``: only what
   ``dst`` lacks, verified by ``dst.put`` as it arrives, several blobs at once;
2. **key records** — for each layer key (from ``keys``, and from the ``org.envbuild.key``
   annotation of every layer a lock lists) whose record ``dst`` lacks: the record's layer blob
   is copied first, then the record;
3. **refs**, last — each pointed at the digest it had in ``src`` when the sync started.

That order is the safety argument (as in ``envbuild.build.engine``): a crash or a dropped
connection at any point leaves ``dst`` with, at worst, unreferenced blobs for GC — never a ref
or key record pointing at a blob it does not have. Rerunning the same sync finishes the job
(everything already present is skipped after one ``exists`` check). Two syncs of the same things
at once both succeed: blob puts are idempotent and refs get the same value.

``compression="gzip"`` or ``"none"`` (``envbuild push --compression``) publishes each lock
with its layers re-encoded (``envbuild.store.recompress``: new layer digests, the same config)
for tools that cannot read zstd; the key records are not copied then (their layers are the
zstd ones: a build cache is pushed with ``zstd``).

Records already in ``dst`` are left alone (another machine built that key; both layers are
valid); refs are overwritten (``push`` means publish).

The remote build cache is the same thing keyed by layer keys: ``pull_cached`` takes the layers
``dst`` is missing from a remote store before a build plans, ``sync(local, remote, keys=built,
refs=locks)`` pushes after it (``envbuild build --cache-from/--cache-to``, wired in
``envbuild.build.engine.build``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Iterable, Mapping, Sequence

from envbuild.errors import RefNotFound, StoreError
from envbuild.oci import ANNOTATION_KEY, ANNOTATION_TASK_ENV, MEDIA_TYPE_INDEX, MEDIA_TYPE_MANIFEST
from envbuild.store.base import Descriptor, Store, check_digest
from envbuild.store.helpers import (
    KEY_RECORDS,
    copy_blobs,
    copy_layer_records,
    digest_bytes,
    get_json,
    get_key_record,
    put_key_record,
)
from envbuild.store.progress import TransferMeter, track
from envbuild.store.recompress import (
    check_compression,
    lock_parts,
    manifest_bytes,
    reencode,
    reencoded_descriptor,
    require_image_manifest,
    spool,
)

_MANIFESTS = {MEDIA_TYPE_MANIFEST, MEDIA_TYPE_INDEX,
              "application/vnd.docker.distribution.manifest.v2+json",
              "application/vnd.docker.distribution.manifest.list.v2+json"}


@dataclasses.dataclass
class SyncReport:
    """What a sync did. ``blobs_copied`` and ``records_copied`` list only what ``dst`` lacked."""

    refs: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> digest published
    blobs_copied: list[str] = dataclasses.field(default_factory=list)
    bytes_copied: int = 0
    blobs_present: int = 0
    records_copied: list[str] = dataclasses.field(default_factory=list)
    compression: str = "zstd"
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False,
                                              compare=False)

    def summary(self) -> str:
        text = (f"{len(self.refs)} ref(s), {len(self.blobs_copied)} blob(s) copied "
                f"({self.bytes_copied / 1e6:.1f} MB), {self.blobs_present} already there, "
                f"{len(self.records_copied)} key record(s)")
        if self.compression != "zstd":
            text += (f"; layers re-encoded as "
                     f"{'plain tar' if self.compression == 'none' else 'gzip'} (new digests, "
                     "no envbuild TOC; key records not pushed)")
        return text

    def count(self, digest: str, size: int, copied: bool) -> None:
        with self._lock:
            if copied:
                self.blobs_copied.append(digest)
                self.bytes_copied += size
            else:
                self.blobs_present += 1


def split_pin(arg: str) -> tuple[str, str | None]:
    """``NAME@sha256:<hex>`` → ``(NAME, digest)``: a ref pinned to the digest it must still
    have (``envbuild push/pull``); anything else → ``(arg, None)``."""
    name, sep, digest = arg.rpartition("@")
    if sep and name and digest.startswith("sha256:") and len(digest) == 71:
        check_digest(digest)
        return name, digest
    return arg, None


def resolve_ref(store: Store, name: str) -> str:
    """The ref ``name`` names in ``store``: ``name`` itself, else ``env/<name>``, else
    ``task/<name>`` (names are unique across kinds: an env and a task never share one)."""
    candidates = [name] if "/" in name else [name, f"env/{name}", f"task/{name}"]
    for c in candidates:
        try:
            store.get_ref(c)
            return c
        except RefNotFound:
            continue
    refs = ", ".join(store.list_refs()[:10]) or "none"
    raise RefNotFound(f"no ref {name!r} in {store!r}", hint=f"refs there: {refs}")


def walk(store: Store, desc: Descriptor | dict) -> tuple[list[tuple[str, bool]], list[str]]:
    """Blobs below (and including) a descriptor as ``(digest, is_manifest)``, children before
    parents, and the layer keys the layers are annotated with."""
    if isinstance(desc, Descriptor):
        desc = desc.to_oci()
    blobs: list[tuple[str, bool]] = []
    keys: list[str] = []
    media_type, digest = desc.get("mediaType"), desc["digest"]
    check_digest(digest)
    if media_type in _MANIFESTS:
        doc = get_json(store, digest)
        if not isinstance(doc, dict):
            raise StoreError(f"{digest} is not a manifest or index")
        children = list(doc.get("manifests") or [])
        if doc.get("config"):
            children.append(doc["config"])
        children.extend(doc.get("layers") or [])
        env_lock = (doc.get("annotations") or {}).get(ANNOTATION_TASK_ENV)
        if isinstance(env_lock, str):  # a task lock: the env lock goes with it, pushed first
            children.insert(0, {"mediaType": MEDIA_TYPE_MANIFEST, "digest": env_lock})
        for child in children:
            b, k = walk(store, child)
            blobs.extend(b)
            keys.extend(k)
    key = (desc.get("annotations") or {}).get(ANNOTATION_KEY)
    if key:
        keys.append(key)
    blobs.append((digest, media_type in _MANIFESTS))
    return blobs, keys


def sync(src: Store, dst: Store, refs: Iterable[str] = (), keys: Iterable[str] = (), *,
         jobs: int = 4, progress=lambda msg: None,
         pins: Mapping[str, str] | None = None, compression: str = "zstd",
         meter: TransferMeter | None = None) -> SyncReport:
    """Copy ``refs`` (and all they point to) and the key records ``keys`` from ``src`` to ``dst``;
    see the module docstring for the order. Refs are names as they exist in ``src``. ``pins``
    maps a ref to the digest it must have in ``src`` (read once: what is copied is what was
    checked); a ref that moved fails with ``ref-moved`` before anything is copied.
    ``compression``: ``zstd`` copies as is, ``gzip``/``none`` re-encode the locks' layers (the
    module docstring). ``meter`` counts the bytes read from ``src``."""
    report = SyncReport(compression=check_compression(compression))
    descs = _pinned_refs(src, refs, pins)
    if compression != "zstd":
        for name, desc in descs.items():
            require_image_manifest(desc.media_type, name, "push --compression")
        return _publish(dst, descs, report, progress, {
            name: _recompress(src, dst, name, desc, report, jobs, meter)
            for name, desc in descs.items()})
    leaves: list[str] = []     # layers, configs: copied in parallel
    manifests: list[str] = []  # children before parents, copied after all leaves, in order
    all_keys = list(keys)
    for desc in descs.values():
        below, k = walk(src, desc)
        for digest, is_manifest in below:
            (manifests if is_manifest else leaves).append(digest)
        all_keys.extend(k)
    records = _missing_records(src, dst, all_keys)
    # layers of records come first (they are usually the big ones), then the lock blobs
    blobs = list(dict.fromkeys([r.layer for r in records.values()] + leaves))
    _copy_all(src, dst, blobs, report, jobs, progress, meter)
    # what is kept beside a layer (its import index) goes with it, before the refs name it
    copy_layer_records(src, dst, blobs)
    _copy_all(src, dst, list(dict.fromkeys(manifests)), report, 1, progress, meter)
    for key, rec in records.items():
        put_key_record(dst, key, rec)
        report.records_copied.append(key)
    return _publish(dst, descs, report, progress, {n: d.digest for n, d in descs.items()})


def _pinned_refs(src: Store, refs: Iterable[str],
                 pins: Mapping[str, str] | None) -> dict[str, Descriptor]:
    """The descriptors of ``refs`` in ``src``, read once; ``ref-moved`` if a pin moved."""
    descs = {name: src.get_ref(name) for name in dict.fromkeys(refs)}
    for name, want in (pins or {}).items():
        have = descs[name].digest if name in descs else src.get_ref(name).digest
        if have != want:
            raise StoreError(f"ref {name} in {src!r} moved: it points at {have} now, not at "
                             f"{want}", reference="ref-moved",
                             hint=f"it was published again since {want[:19]}… was read; "
                                  "drop @DIGEST to take the new one, or find out who moved it")
    return descs


def _missing_records(src: Store, dst: Store, keys: Iterable[str]) -> dict:
    """The key records of ``keys`` that ``dst`` lacks and ``src`` has."""
    records = {}
    for key in dict.fromkeys(keys):
        hex_key = check_digest(key)
        if dst.get_record(KEY_RECORDS, hex_key) is not None:
            continue
        rec = get_key_record(src, key)
        if rec is not None:
            records[key] = rec
    return records


def _publish(dst: Store, descs: Mapping[str, Descriptor], report: SyncReport, progress,
             digests: Mapping[str, str]) -> SyncReport:
    """Point each ref at its digest in ``dst`` (last: everything below it is there)."""
    for name, desc in descs.items():
        digest = digests[name]
        same = digest == desc.digest
        dst.put_ref(name, digest, media_type=desc.media_type,
                    annotations=desc.annotations if same else None)
        report.refs[name] = digest
        progress(f"ref {name} -> {digest}")
    return report


def _recompress(src: Store, dst: Store, name: str, desc: Descriptor, report: SyncReport,
                jobs: int, meter: TransferMeter | None) -> str:
    """Put lock ``name`` into ``dst`` with its layers re-encoded as ``report.compression``
    (layers and config first, ``jobs`` layers at once); the digest of the manifest written."""
    manifest = get_json(src, desc.digest)
    config_digest = (manifest.get("config") or {}).get("digest", "")
    parts = lock_parts(manifest, get_json(src, config_digest), name)
    if meter is not None:
        meter.expect(sum(int(layer.get("size", 0)) for layer, _ in parts))

    def one(part: tuple[dict, str]) -> dict:
        layer, diff_id = part
        with src.get(layer["digest"]) as f:
            out, digest, size = spool(reencode(track(meter, f), report.compression, diff_id,
                                               layer["digest"]))
        with out:
            present = dst.exists(digest)
            if not present:
                dst.put(digest, out, size=size)
        report.count(digest, size, not present)
        return reencoded_descriptor(layer, report.compression, digest, size)

    with concurrent.futures.ThreadPoolExecutor(max(1, jobs), thread_name_prefix="sync") as pool:
        layers = list(pool.map(one, parts))
    for d in copy_blobs(src, dst, [config_digest]):
        report.count(d, src.stat(d).size, True)
    body = manifest_bytes(manifest, layers)
    digest = digest_bytes(body)
    if not dst.exists(digest):
        dst.put(digest, body, size=len(body))
    return digest


def _copy_all(src: Store, dst: Store, digests: Sequence[str], report: SyncReport, jobs: int,
              progress, meter: TransferMeter | None) -> None:
    """Copy the blobs ``dst`` lacks, ``jobs`` at a time (one at a time keeps their order):
    first which are missing and their sizes (``meter`` learns the total), then the bytes."""

    def missing(d: str) -> tuple[str, int] | None:
        if dst.exists(d):
            report.count(d, 0, False)
            return None
        return d, src.stat(d).size

    def one(item: tuple[str, int]) -> None:
        d, size = item
        copied = copy_blobs(src, dst, [d], meter)  # re-checks: a concurrent sync may have won
        report.count(d, size, bool(copied))
        if copied:
            progress(f"copied {d} ({size} bytes)")

    if jobs <= 1 or len(digests) <= 1:
        todo = [m for m in map(missing, digests) if m is not None]
        if meter is not None:
            meter.expect(sum(size for _, size in todo))
        for item in todo:
            one(item)
        return
    with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="sync") as pool:
        todo = [m for m in pool.map(missing, digests) if m is not None]
        if meter is not None:
            meter.expect(sum(size for _, size in todo))
        for f in [pool.submit(one, item) for item in todo]:
            f.result()


def pull_cached(remote: Store, local: Store, keys: Iterable[str], *, jobs: int = 4) -> list[str]:
    """Take from ``remote`` each layer key's record and layer that ``local`` lacks (layer first);
    return the keys now present in ``local`` thanks to this call."""
    keys = [k for k in dict.fromkeys(keys) if get_key_record(local, k) is None]
    report = sync(remote, local, keys=keys, jobs=jobs)
    return report.records_copied
