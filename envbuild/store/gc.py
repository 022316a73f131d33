"""Garbage collection of a store: mark everything reachable, sweep old unreachable blobs.

``gc(store, grace=..., roots=..., drop_cache=..., dry_run=...) -> GcReport``; the CLI is
``envbuild gc`` (``envbuild.cli.cmd_jobs``). It works on any backend through the ``Store``
interface and the optional age methods (``BlobInfo.mtime``, ``record_mtime``,
``list_partials``; see "Ages and garbage collection" in ``envbuild.store.base``).

Mark: the roots, and everything they reach
    * **every ref** (``env/*``, ``snap/*``, anything else): the blob it points at;
    * **every lock reached**: an image manifest reaches its config and layers, an index its
      manifests, and a snapshot lock (manifest annotation ``org.envbuild.parent.lock``) its
      parent lock, recursively, and a task lock (annotation ``org.envbuild.task.env.lock``)
      its config, its hidden layer and the env lock its agent gets;
    * **key records** (``keys/v1/*``, the build cache): each record's layer blob. With
      ``drop_cache=True`` a record is a root only while something else reaches its layer or the
      record is younger than the grace period; otherwise the record is deleted (before its
      layer, so a record never points at a deleted blob) and the layer becomes garbage.
      Default: every record is a root — the build cache is never dropped implicitly, since the
      planner trusts a record without re-checking its blob;
    * **exec log blobs** (``runtime_shim.fleet.execlog``): every blob named by a record of
      ``execlog/blobs/v1`` (a fleet sandbox's file write over 1 MiB, which a replay of its log
      writes again);
    * **extra roots** (``roots=``: the digests of job manifests given with ``--job``): each is
      kept, and walked like a lock when it is one;
    * **every blob younger than the grace period**, and what it reaches when it is a manifest:
      a build or a pack-diff that stored a lock but has not yet written its ref keeps the
      (older) layers and parent lock that lock names.

Records kept beside a layer blob (``LAYER_RECORDS``: its import index) go with it: those of
the blobs a sweep deletes, and those whose blob is absent once they are older than the grace
period (a writer stores the blob first).

Build logs of a local store (``<store>/logs/<layer>-<key hex, 12>.log``, written by the
builder; ``envbuild.build.buildlog``) are collected once older than the grace period unless a
key record that survives this run has that key: the log of a build that failed, or whose
record was dropped, goes; the log of a layer in the build cache stays.

Sweep: a blob is deleted only if it is not marked **and** it is older than the grace period
(its age is known and ``mtime <= start - grace``, where ``start`` is when GC began: a blob
stored while GC runs is never old enough, even with ``grace=0``). Unfinished writes (local
``.tmp-*`` files, S3 multipart uploads) are deleted only once unchanged for longer than the
grace period and at least ``PARTIAL_MIN_AGE`` (1 h); GC never touches a temp file a writer is
still writing (the local store's ``put`` holds an flock on it, which ``list_partials``
respects; an S3 multipart upload's age counts from its start, so keep the grace period longer
than your longest upload). Just before sweeping, the refs and key
records are read again and anything new is marked, which narrows the window in which a writer
that *reuses* an existing, unreachable blob (``exists`` said yes, so it skipped ``put``) can
lose it; that writer is safe outright when the blob was reachable when it checked (a key
record or a ref reached it), which is what builds rely on. A ``sync``/``push`` into a store
being collected is exposed to that window for blobs the destination already had but nothing
reached; run GC when no push targets the store, or verify the pushed locks afterwards.

What is therefore safe while GC runs: every build (blobs, then key records, then lock blobs,
then refs) and every pack-diff that finishes within the grace period, and a ``sync`` with the
caveat above; what is not: a grace period shorter than your longest write, and
``drop_cache=True`` while builds run (a build that read a key record just before GC dropped it
would lock a deleted layer — drop the cache on a quiet store). ``grace=0`` is for tests and
quiet stores.

A ref that points at a missing blob is reported (``dangling``) and marks nothing; a reachable
manifest that cannot be read or parsed (corrupt, or the backend failed) stops GC before it
deletes anything (``StoreError``, reference ``gc-unmarkable``): not knowing what a lock
reaches means not knowing what is garbage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from envbuild.errors import BlobNotFound, StoreError
from envbuild.oci import ANNOTATION_PARENT, ANNOTATION_TASK_ENV, MEDIA_TYPE_MANIFEST, is_digest
from envbuild.store.base import BlobInfo, PartialWrite, Store, check_digest
from envbuild.store.helpers import KEY_RECORDS, LAYER_RECORDS, MAX_JSON_SIZE, get_json
from envbuild.store.local import LocalStore
from envbuild.store.sync import _MANIFESTS  # the media types sync.walk descends into

#: Records naming blobs that fleet exec logs hold (``runtime_shim.fleet.execlog.BLOB_INDEX``;
#: the literal here keeps the store free of runtime_shim imports).
EXEC_LOG_BLOBS = "execlog/blobs/v1"

#: Default grace period: 24 hours.
DEFAULT_GRACE = 24 * 3600.0
#: An unfinished write is deleted only once it has not changed for this long, whatever the
#: grace period: a temp file's mtime moves with every write, so a live writer never gets there,
#: even under ``grace=0``.
PARTIAL_MIN_AGE = 3600.0

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``"24h"``, ``"90m"``, ``"2d"``, ``"0"``, ``"30s"`` → seconds (``StoreError`` otherwise)."""
    m = _DURATION_RE.fullmatch(text.strip().lower())
    if not m:
        raise StoreError(f"not a duration: {text!r}", reference="invalid-duration",
                         hint="use a number with s, m, h, d or w, e.g. 24h, 90m, 7d, 0")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclasses.dataclass(frozen=True)
class GcItem:
    """One thing GC deleted (or would delete): a ``blob``, a key ``record`` or a ``partial``
    write; ``age`` in seconds at the start of GC."""

    kind: str  # blob, record, partial or log
    name: str
    size: int
    age: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "size": self.size,
                "age": round(self.age, 3)}


@dataclasses.dataclass
class GcReport:
    """What a GC run found and did. ``deleted`` lists what was (or, on a dry run, would be)
    deleted; ``young`` counts unreachable blobs spared by the grace period; ``dangling`` names
    roots that point at missing blobs (``ref env/x -> sha256:…``)."""

    dry_run: bool
    grace: float
    blobs: int = 0
    blob_bytes: int = 0
    reachable: int = 0
    young: int = 0
    deleted: list[GcItem] = dataclasses.field(default_factory=list)
    dangling: list[str] = dataclasses.field(default_factory=list)

    @property
    def deleted_bytes(self) -> int:
        return sum(i.size for i in self.deleted if i.kind == "blob")

    def summary(self) -> str:
        counts = {k: sum(1 for i in self.deleted if i.kind == k)
                  for k in ("blob", "record", "partial", "log")}
        verb = "would delete" if self.dry_run else "deleted"
        return (f"{self.blobs} blob(s) ({self.blob_bytes / 1e6:.1f} MB), {self.reachable} "
                f"reachable, {self.young} unreachable but younger than the grace period; "
                f"{verb} {counts['blob']} blob(s) ({self.deleted_bytes / 1e6:.1f} MB), "
                f"{counts['record']} key record(s), {counts['partial']} partial write(s), "
                f"{counts['log']} build log(s)")

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "grace": self.grace, "blobs": self.blobs,
                "blob_bytes": self.blob_bytes, "reachable": self.reachable,
                "young": self.young, "deleted_bytes": self.deleted_bytes,
                "deleted": [i.to_json() for i in self.deleted], "dangling": self.dangling}


class _Marker:
    """The mark phase: a set of reached digests, grown from roots without revisiting."""

    def __init__(self, store: Store, report: GcReport, sizes: dict[str, int]) -> None:
        self.store = store
        self.report = report
        self.marked: set[str] = set()
        self._sizes = sizes  # from the listing: saves a stat per sniffed blob

    def descriptor(self, desc: dict[str, Any], via: str) -> None:
        """Mark a descriptor (OCI JSON) and, for a manifest, everything below it."""
        stack = [(desc, via)]
        while stack:
            d, where = stack.pop()
            digest = d.get("digest")
            try:
                check_digest(digest)
            except StoreError:
                raise _unmarkable(where, str(digest),
                                  "a descriptor with a malformed digest") from None
            assert isinstance(digest, str)  # check_digest passed
            if digest in self.marked:
                continue
            self.marked.add(digest)
            if d.get("mediaType") not in _MANIFESTS:
                continue
            doc = self._read_manifest(digest, where)
            if doc is not None:
                stack.extend((c, f"{where} -> {digest[:19]}") for c in _children(doc))

    def digest(self, digest: str, via: str, *, sniff: bool = True) -> None:
        """Mark a bare digest (a job manifest entry, a young blob); if it is a manifest (its
        JSON says so), mark what it reaches too."""
        if digest in self.marked:
            return
        if sniff:
            doc = self._sniff(digest)
            if doc is not None:
                self.descriptor({"mediaType": doc["mediaType"], "digest": digest}, via)
                return
        self.marked.add(digest)

    def _read_manifest(self, digest: str, where: str) -> dict[str, Any] | None:
        try:
            doc = get_json(self.store, digest)
        except BlobNotFound:
            self.report.dangling.append(f"{where} -> {digest} (missing)")
            return None
        except StoreError as e:
            raise _unmarkable(where, digest, e.message) from e
        if not isinstance(doc, dict):
            raise _unmarkable(where, digest, "not a JSON object")
        return doc

    def _sniff(self, digest: str) -> dict[str, Any] | None:
        """The blob parsed, if it is a manifest or index; ``None`` for anything else (layers:
        one ranged read of their first byte) and for blobs that cannot be read."""
        try:
            size = self._sizes.get(digest)
            if size is None:
                size = self.store.stat(digest).size
            if size > MAX_JSON_SIZE or self.store.get_range(digest, 0, 1) != b"{":
                return None
            doc = get_json(self.store, digest)
        except StoreError:
            return None
        if isinstance(doc, dict) and doc.get("mediaType") in _MANIFESTS:
            return doc
        if isinstance(doc, dict) and doc.get("schemaVersion") == 2 and "layers" in doc:
            return {**doc, "mediaType": MEDIA_TYPE_MANIFEST}  # mediaType is optional in OCI
        return None


def _children(doc: dict[str, Any]) -> list[dict[str, Any]]:
    children = [c for c in doc.get("manifests") or [] if isinstance(c, dict)]
    for key in ("config", "subject"):
        if isinstance(doc.get(key), dict):
            children.append(doc[key])
    children.extend(c for c in doc.get("layers") or [] if isinstance(c, dict))
    notes = doc.get("annotations") or {}
    parent = notes.get(ANNOTATION_PARENT)
    if parent:
        children.append({"mediaType": MEDIA_TYPE_MANIFEST, "digest": parent})
    # a task lock (runtime_shim.node.tasklock): the env lock its agent gets
    env_lock = notes.get(ANNOTATION_TASK_ENV)
    if env_lock:
        children.append({"mediaType": MEDIA_TYPE_MANIFEST, "digest": env_lock})
    # a checkpoint lock (runtime_shim.sdk.checkpoint): its memory image and record blobs
    for key in ("org.envbuild.checkpoint.image", "org.envbuild.checkpoint.record"):
        if isinstance(notes.get(key), str):
            children.append({"mediaType": "application/octet-stream", "digest": notes[key]})
    return children


def _unmarkable(where: str, digest: str, why: str) -> StoreError:
    return StoreError(
        f"gc: cannot read {digest}, reached from {where}: {why}; nothing was deleted",
        reference="gc-unmarkable",
        hint="check it with `envbuild job verify` or `envbuild layer verify`; delete or repoint "
             "the ref that reaches it, then run gc again")


def gc(store: Store, *, grace: float = DEFAULT_GRACE, roots: Iterable[str] = (),
       drop_cache: bool = False, dry_run: bool = False, now: float | None = None,
       progress: Callable[[str], None] = lambda msg: None) -> GcReport:
    """Collect the garbage of ``store``; see the module docstring for the rules.

    ``roots`` are extra digests to keep (and walk, when they are locks), e.g. every blob a job
    manifest pins. ``now`` is the start time ages are measured from (tests)."""
    if grace < 0:
        raise StoreError(f"negative grace period {grace}", reference="invalid-duration")
    start = time.time() if now is None else now
    cutoff = start - grace
    report = GcReport(dry_run=dry_run, grace=grace)
    infos = list(store.list_info())
    report.blobs = len(infos)
    report.blob_bytes = sum(i.size for i in infos)
    marker = _Marker(store, report, {i.digest: i.size for i in infos})

    refs = _mark_refs(store, marker, {})
    for digest in roots:
        check_digest(digest)
        marker.digest(digest, f"job manifest entry {digest[:19]}")
    records, drop = _mark_records(store, marker, cutoff, drop_cache, {})
    logged = _mark_exec_log_blobs(store, marker, set())
    reachable = set(marker.marked)
    for info in infos:
        if not _old(info, cutoff):
            marker.digest(info.digest, f"young blob {info.digest[:19]}")
    progress(f"marked {len(marker.marked)} blob(s) from {len(refs)} ref(s)")
    # Re-read the roots a concurrent writer may have added since, then decide.
    _mark_refs(store, marker, refs)
    records, drop = _mark_records(store, marker, cutoff, drop_cache, records)
    _mark_exec_log_blobs(store, marker, logged)
    drop = {name: rec for name, rec in drop.items() if rec[0] not in marker.marked}

    report.reachable = sum(1 for i in infos if i.digest in reachable)
    report.young = sum(1 for i in infos if i.digest in marker.marked - reachable)
    garbage = [i for i in infos if i.digest not in marker.marked]
    for name, (_layer, mtime) in sorted(drop.items()):
        report.deleted.append(GcItem("record", f"{KEY_RECORDS}/{name}", 0, start - mtime))
        if not dry_run:
            store.delete_record(KEY_RECORDS, name)
    for info in sorted(garbage, key=lambda i: i.digest):
        report.deleted.append(GcItem("blob", info.digest, info.size,
                                     start - info.mtime))  # type: ignore[operator]
        if not dry_run:
            store.delete(info.digest)
            progress(f"deleted {info.digest} ({info.size} bytes)")
    _sweep_layer_records(store, report, {i.digest for i in garbage},
                         {i.digest for i in infos}, cutoff, start, dry_run)
    for partial in _stale_partials(store, min(cutoff, start - PARTIAL_MIN_AGE)):
        report.deleted.append(GcItem("partial", partial.name, partial.size,
                                     start - partial.mtime))
        if not dry_run:
            store.delete_partial(partial)
    if isinstance(store, LocalStore):
        kept = {name[:12] for name in records if name not in drop}
        _sweep_logs(store.root / "logs", report, kept, cutoff, start, dry_run)
    return report


def _sweep_logs(logs: Path, report: GcReport, keys: set[str], cutoff: float, start: float,
                dry_run: bool) -> None:
    """Delete the build logs in ``logs`` older than ``cutoff`` whose key is not in ``keys``
    (the 12-hex-digit prefixes of the key records that remain)."""
    try:
        entries = list(os.scandir(logs))
    except FileNotFoundError:
        return
    for entry in sorted(entries, key=lambda e: e.name):
        if not entry.name.endswith(".log") or not entry.is_file(follow_symlinks=False):
            continue
        key = re.search(r"-([0-9a-f]{12})\.log$", entry.name)
        st = entry.stat(follow_symlinks=False)
        if (key and key.group(1) in keys) or st.st_mtime > cutoff:
            continue
        report.deleted.append(GcItem("log", f"logs/{entry.name}", st.st_size,
                                     start - st.st_mtime))
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


def _sweep_layer_records(store: Store, report: GcReport, deleted: set[str], listed: set[str],
                         cutoff: float, start: float, dry_run: bool) -> None:
    """Delete the records beside layer blobs (``LAYER_RECORDS``) of the blobs this sweep
    deleted, and those older than the grace period whose blob is not in the store."""
    for ns in LAYER_RECORDS:
        for name in store.list_records(ns):
            digest = "sha256:" + name
            if digest in listed and digest not in deleted:
                continue
            mtime = store.record_mtime(ns, name)
            if digest not in deleted and (mtime is None or mtime > cutoff
                                          or store.exists(digest)):
                continue   # age unknown, young, or its blob came after the listing
            report.deleted.append(GcItem("record", f"{ns}/{name}", 0,
                                         start - mtime if mtime is not None else 0.0))
            if not dry_run:
                store.delete_record(ns, name)


def _old(info: BlobInfo, cutoff: float) -> bool:
    return info.mtime is not None and info.mtime <= cutoff


def _mark_refs(store: Store, marker: _Marker, seen: dict[str, str]) -> dict[str, str]:
    """Mark every ref not in ``seen`` (name -> digest) or pointing elsewhere; return all."""
    now: dict[str, str] = {}
    for name in store.list_refs():
        try:
            desc = store.get_ref(name)
        except StoreError:
            continue  # deleted since the listing (RefNotFound)
        now[name] = desc.digest
        if seen.get(name) == desc.digest:
            continue
        if desc.media_type not in _MANIFESTS and not store.exists(desc.digest):
            marker.report.dangling.append(f"ref {name} -> {desc.digest} (missing)")
        marker.descriptor(desc.to_oci(), f"ref {name}")
    return {**seen, **now}


def _mark_records(store: Store, marker: _Marker, cutoff: float, drop_cache: bool,
                  seen: dict[str, tuple[str, float] | None]
                  ) -> tuple[dict[str, tuple[str, float] | None], dict[str, tuple[str, float]]]:
    """Mark the layers of the key records not in ``seen``; return every record read (name ->
    ``(layer, mtime)`` if it may be dropped, else ``None``) and the droppable ones."""
    records = dict(seen)
    drop: dict[str, tuple[str, float]] = {}
    for name in store.list_records(KEY_RECORDS):
        if name in seen:
            before = seen[name]
            if before is None:
                continue
            if store.record_mtime(KEY_RECORDS, name) == before[1]:
                drop[name] = before
                continue
            # rewritten since the first pass: judge it afresh
        obj = store.get_record(KEY_RECORDS, name)
        layer = obj.get("layer") if obj else None
        if not is_digest(layer):
            records[name] = None  # malformed: keep it, it marks nothing
            continue
        mtime = store.record_mtime(KEY_RECORDS, name) if drop_cache else None
        if drop_cache and layer not in marker.marked and mtime is not None and mtime <= cutoff:
            records[name] = drop[name] = (layer, mtime)
            continue
        records[name] = None
        marker.digest(layer, f"key record {name[:12]}", sniff=False)
    return records, drop


def _mark_exec_log_blobs(store: Store, marker: _Marker, seen: set[str]) -> set[str]:
    """Mark the blob of every exec log index record not in ``seen``; return every name read.
    A malformed record marks nothing (it names no blob this GC could keep)."""
    names: set[str] = set(store.list_records(EXEC_LOG_BLOBS))
    for name in sorted(names - seen):
        obj = store.get_record(EXEC_LOG_BLOBS, name)
        blob = obj.get("blob") if obj else None
        if is_digest(blob):
            marker.digest(blob, f"exec log record {name}", sniff=False)
    return seen | names


def _stale_partials(store: Store, cutoff: float) -> list[PartialWrite]:
    return sorted((p for p in store.list_partials() if p.mtime <= cutoff),
                  key=lambda p: p.name)
