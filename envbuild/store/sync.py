"""Copying between stores: ``push`` / ``pull`` of locks, and the remote build cache.

One function does both directions, ``sync(src, dst, refs=..., keys=...)``:

1. **blobs** — for each ref, the blob it points at and everything below it (an image manifest's
   config and layers; an index's manifests, recursively), copied with ``copy_blobs``: only what
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
from envbuild.oci import ANNOTATION_KEY, MEDIA_TYPE_INDEX, MEDIA_TYPE_MANIFEST
from envbuild.store.base import Descriptor, Store, check_digest
from envbuild.store.helpers import (
    KEY_RECORDS,
    copy_blobs,
    copy_layer_records,
    get_json,
    get_key_record,
    put_key_record,
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

    def summary(self) -> str:
        return (f"{len(self.refs)} ref(s), {len(self.blobs_copied)} blob(s) copied "
                f"({self.bytes_copied / 1e6:.1f} MB), {self.blobs_present} already there, "
                f"{len(self.records_copied)} key record(s)")


def split_pin(arg: str) -> tuple[str, str | None]:
    """``NAME@sha256:<hex>`` → ``(NAME, digest)``: a ref pinned to the digest it must still
    have (``envbuild push/pull``); anything else → ``(arg, None)``."""
    name, sep, digest = arg.rpartition("@")
    if sep and name and digest.startswith("sha256:") and len(digest) == 71:
        check_digest(digest)
        return name, digest
    return arg, None


def resolve_ref(store: Store, name: str) -> str:
    """The ref ``name`` names in ``store``: ``name`` itself, else ``env/<name>``."""
    candidates = [name] if "/" in name else [name, f"env/{name}"]
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
         pins: Mapping[str, str] | None = None) -> SyncReport:
    """Copy ``refs`` (and all they point to) and the key records ``keys`` from ``src`` to ``dst``;
    see the module docstring for the order. Refs are names as they exist in ``src``. ``pins``
    maps a ref to the digest it must have in ``src`` (read once: what is copied is what was
    checked); a ref that moved fails with ``ref-moved`` before anything is copied."""
    report = SyncReport()
    descs = {name: src.get_ref(name) for name in dict.fromkeys(refs)}
    for name, want in (pins or {}).items():
        have = descs[name].digest if name in descs else src.get_ref(name).digest
        if have != want:
            raise StoreError(f"ref {name} in {src!r} moved: it points at {have} now, not at "
                             f"{want}", reference="ref-moved",
                             hint=f"it was published again since {want[:19]}… was read; "
                                  "drop @DIGEST to take the new one, or find out who moved it")
    leaves: list[str] = []     # layers, configs: copied in parallel
    manifests: list[str] = []  # children before parents, copied after all leaves, in order
    all_keys = list(keys)
    for desc in descs.values():
        blobs, k = walk(src, desc)
        for digest, is_manifest in blobs:
            (manifests if is_manifest else leaves).append(digest)
        all_keys.extend(k)
    records = {}
    for key in dict.fromkeys(all_keys):
        hex_key = check_digest(key)
        if dst.get_record(KEY_RECORDS, hex_key) is not None:
            continue
        rec = get_key_record(src, key)
        if rec is not None:
            records[key] = rec
    # layers of records come first (they are usually the big ones), then the lock blobs
    layer_blobs = [r.layer for r in records.values()]
    _copy_all(src, dst, list(dict.fromkeys(layer_blobs + leaves)), report, jobs, progress)
    # what is kept beside a layer (its import index) goes with it, before the refs name it
    copy_layer_records(src, dst, list(dict.fromkeys(layer_blobs + leaves)))
    _copy_all(src, dst, list(dict.fromkeys(manifests)), report, 1, progress)
    for key, rec in records.items():
        put_key_record(dst, key, rec)
        report.records_copied.append(key)
    for name, desc in descs.items():
        dst.put_ref(name, desc.digest, media_type=desc.media_type,
                    annotations=desc.annotations)
        report.refs[name] = desc.digest
        progress(f"ref {name} -> {desc.digest}")
    return report


def _copy_all(src: Store, dst: Store, digests: Sequence[str], report: SyncReport, jobs: int,
              progress) -> None:
    """Copy the blobs ``dst`` lacks, ``jobs`` at a time (one at a time keeps their order)."""
    lock = threading.Lock()

    def one(d: str) -> None:
        if dst.exists(d):
            with lock:
                report.blobs_present += 1
            return
        size = src.stat(d).size
        copied = copy_blobs(src, dst, [d])  # re-checks: a concurrent sync may have won
        with lock:
            if copied:
                report.blobs_copied.append(d)
                report.bytes_copied += size
            else:
                report.blobs_present += 1
        if copied:
            progress(f"copied {d} ({size} bytes)")

    if jobs <= 1 or len(digests) <= 1:
        for d in digests:
            one(d)
        return
    with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="sync") as pool:
        for f in [pool.submit(one, d) for d in digests]:
            f.result()


def pull_cached(remote: Store, local: Store, keys: Iterable[str], *, jobs: int = 4) -> list[str]:
    """Take from ``remote`` each layer key's record and layer that ``local`` lacks (layer first);
    return the keys now present in ``local`` thanks to this call."""
    keys = [k for k in dict.fromkeys(keys) if get_key_record(local, k) is None]
    report = sync(remote, local, keys=keys, jobs=jobs)
    return report.records_copied
