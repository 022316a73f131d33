"""``envbuild job verify``: is everything a job manifest needs in the store, intact?

Every lock manifest, config and layer the manifest names — through its ``pinned`` closure
and through the lock manifests themselves, and a task group's task lock (its spec and hidden
layer) — is read in full and checked against its digest;
every layer's TOC is found through its footer and checked against the TOC digest in the lock's
``org.envbuild.toc.digest`` annotation (and the pinned ``toc``) with
``LayerReader.from_store(..., expected_toc_digest=...)``. Nothing stops at the first problem:
the report lists every missing or corrupt item, once, with the groups that need it. An
unresolved group's ref is followed as it is now (and a missing ref is a problem too).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

from envbuild.canonical import load_json
from envbuild.errors import BlobNotFound, EnvbuildError
from envbuild.jobs.model import JobManifest
from envbuild.layers import LayerReader
from envbuild.oci import ANNOTATION_TOC, is_digest
from envbuild.store import Store
from envbuild.store.base import CHUNK_SIZE
from envbuild.store.sync import resolve_ref
from runtime_shim.node import MAX_LOCK_JSON


@dataclasses.dataclass(frozen=True)
class VerifyProblem:
    """One missing or corrupt item. ``kind``: ref, lock, config, layer, toc or checkpoint (a
    checkpoint lock's record; its memory image is a layer); ``status``:
    missing, corrupt or mismatch (the pinned closure disagrees with the lock)."""

    kind: str
    name: str
    status: str
    detail: str
    groups: tuple[str, ...]

    def render(self) -> str:
        text = f"{self.status} {self.kind} {self.name}"
        if self.detail:
            text += f": {self.detail}"
        return text + f" (group {', '.join(self.groups)})"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"groups": list(self.groups)}


@dataclasses.dataclass
class VerifyReport:
    checked: int = 0
    bytes_checked: int = 0
    problems: list[VerifyProblem] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for p in self.problems:
            counts[p.status] = counts.get(p.status, 0) + 1
        found = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no problems"
        return (f"checked {self.checked} blob(s) ({self.bytes_checked / 1e6:.1f} MB): {found}")

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "checked": self.checked, "bytes_checked": self.bytes_checked,
                "problems": [p.to_json() for p in self.problems]}


@dataclasses.dataclass
class _Item:
    kind: str  # lock | config | layer
    tocs: set[str] = dataclasses.field(default_factory=set)
    groups: dict[str, None] = dataclasses.field(default_factory=dict)


def verify_job_manifest(manifest: JobManifest, store: Store, *, jobs: int = 4) -> VerifyReport:
    """Check every blob ``manifest`` needs in ``store``; see the module docstring."""
    report = VerifyReport()
    items: dict[str, _Item] = {}
    locks = _pinned_needs(manifest, store, report, items)
    # Locks first: what they list joins the items (the pinned closure may be incomplete).
    for digest, labels in locks.items():
        _lock_needs(manifest, store, digest, labels, report, items)
    rest = [d for d, item in items.items() if item.kind != "lock"]
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs),
                                               thread_name_prefix="verify") as pool:
        found = list(pool.map(lambda d: _check(store, d, items[d]), rest))
    for problems, size in found:
        report.problems.extend(problems)
        if size is not None:
            report.checked += 1
            report.bytes_checked += size
    report.problems.sort(key=lambda p: (p.kind, p.name, p.status))
    return report


def _need(items: dict[str, _Item], digest: str, kind: str, group: str,
          toc: str | None = None) -> None:
    item = items.setdefault(digest, _Item(kind))
    item.groups[group] = None
    if toc:
        item.tocs.add(toc)


def _pinned_needs(manifest: JobManifest, store: Store, report: VerifyReport,
                  items: dict[str, _Item]) -> dict[str, list[str]]:
    """Each group's lock (a ref resolved now) and what the manifest pinned for it, as needs;
    returns lock digest -> labels of the groups using it."""
    locks: dict[str, list[str]] = {}
    for group in manifest.groups:
        label = group.label
        digest = group.lock
        if not is_digest(digest):
            try:
                digest = store.get_ref(resolve_ref(store, group.lock)).digest
            except EnvbuildError as e:
                report.problems.append(VerifyProblem("ref", group.lock, "missing", e.message,
                                                     (label,)))
                continue
        locks.setdefault(digest, []).append(label)
        _need(items, digest, "lock", label)
        if group.task and is_digest(group.task):  # the task lock that grades the group: read
            locks.setdefault(group.task, []).append(label)  # as a lock (spec, hidden layer)
            _need(items, group.task, "lock", label)
        if group.pinned is not None:
            _need(items, group.pinned.config, "config", label)
            for layer in group.pinned.layers:
                _need(items, layer.digest, "layer", label, layer.toc)
    return locks


def _lock_needs(manifest: JobManifest, store: Store, digest: str, labels: list[str],
                report: VerifyReport, items: dict[str, _Item]) -> None:
    """Read the lock ``digest``: its config, layers and checkpoint blobs become needs, and a
    group whose pins differ from the lock is a problem."""
    data = _read(store, digest, report, items[digest])
    if data is None:
        return
    try:
        doc = load_json(data)
        config = doc["config"]["digest"]
        layers = [(d["digest"], (d.get("annotations") or {}).get(ANNOTATION_TOC))
                  for d in doc.get("layers") or []]
        notes = doc.get("annotations") or {}
    except (ValueError, KeyError, TypeError) as e:
        report.problems.append(VerifyProblem("lock", digest, "corrupt",
                                             f"not an image manifest ({e})", tuple(labels)))
        return
    for label in labels:
        _need(items, config, "config", label)
        for layer, toc in layers:
            _need(items, layer, "layer", label, toc)
        # a checkpoint lock (runtime_shim.sdk.checkpoint): its memory image (a layer, with
        # its TOC digest) and the record of what was dumped
        if isinstance(notes.get("org.envbuild.checkpoint.image"), str):
            _need(items, notes["org.envbuild.checkpoint.image"], "layer", label,
                  notes.get("org.envbuild.checkpoint.image.toc"))
        if isinstance(notes.get("org.envbuild.checkpoint.record"), str):
            _need(items, notes["org.envbuild.checkpoint.record"], "checkpoint", label)
    for group in manifest.groups:
        if group.lock == digest and group.pinned is not None and (
                group.pinned.config != config
                or [(p.digest, p.toc) for p in group.pinned.layers] != layers):
            report.problems.append(VerifyProblem(
                "lock", digest, "mismatch", "the pinned config and layers differ from the "
                "lock's; resolve the manifest again", (group.label,)))


def _read(store: Store, digest: str, report: VerifyReport, item: _Item) -> bytes | None:
    """A lock manifest's bytes, verified, or ``None`` after recording the problem."""
    groups = tuple(item.groups)
    try:
        size = store.stat(digest).size
        if size > MAX_LOCK_JSON:  # a layer named as a lock: not read into memory
            report.problems.append(VerifyProblem("lock", digest, "corrupt", f"{size} bytes, "
                                                 "too large for an image manifest", groups))
            return None
        with store.get(digest) as f:
            data = f.read()
    except BlobNotFound:
        report.problems.append(VerifyProblem("lock", digest, "missing", "", groups))
        return None
    except EnvbuildError as e:
        report.problems.append(VerifyProblem("lock", digest, "corrupt", e.message, groups))
        return None
    report.checked += 1
    report.bytes_checked += len(data)
    return data


def _check(store: Store, digest: str, item: _Item) -> tuple[list[VerifyProblem], int | None]:
    """Problems of one config or layer, and its size when its bytes verified."""
    groups = tuple(item.groups)
    size = 0
    try:
        with store.get(digest) as f:
            while chunk := f.read(CHUNK_SIZE):
                size += len(chunk)
    except BlobNotFound:
        return [VerifyProblem(item.kind, digest, "missing", "", groups)], None
    except EnvbuildError as e:
        return [VerifyProblem(item.kind, digest, "corrupt", e.message, groups)], None
    problems = []
    if item.kind == "layer":
        tocs: list[str | None] = [*sorted(item.tocs)] or [None]
        for toc in tocs:
            try:
                LayerReader.from_store(store, digest, expected_toc_digest=toc)
            except EnvbuildError as e:
                problems.append(VerifyProblem("toc", digest, "corrupt", e.message, groups))
    return problems, size
