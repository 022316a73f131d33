"""Checkpoints with memory: ``Sandbox.checkpoint`` / ``Sandbox.restore`` / ``Sandbox.fork``.

A checkpoint is **one artifact in the store: a lock**. Its layers are the sandbox's lock plus a
snapshot layer of its changes (pack-diff, under the same hostile-content policy: ``runtime_shim
.packdiff``), so ``Sandbox.create(ref)`` starts a fresh sandbox from its files; its manifest's
annotations name two more blobs (``CHECKPOINT_ANNOTATIONS``), which ``envbuild gc`` keeps and
``envbuild job verify`` reads in full:

- ``org.envbuild.checkpoint.image``: the memory image, the backend's image dir packed as an
  envbuild layer (compact frames, regular files only; ``org.envbuild.checkpoint.image.toc`` is
  its TOC digest) and unpacked on restore by the one safe unpacker;
- ``org.envbuild.checkpoint.record``: envbuild's own record of what it dumped (JSON, version
  ``CHECKPOINT_VERSION``): the backend's ``CheckpointImage.record`` (for CRIU: process tree,
  mounts, every image file's sha256 and size), the backend and kind, sizes and times.

Restore resolves the lock, reads the record, unpacks the image into the new sandbox's dir and
hands both to the backend's ``Restorable.restore``, which refuses an image that does not match
the record before any process runs; every failure removes the new sandbox's dir (nothing is
left). The sandbox gets the isolation of a fresh one (``network=``, ``limits=`` of the restore
call, the default capabilities and seccomp filter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envbuild.errors import BackendUnavailable, CheckpointRefused, RuntimeShimError
from envbuild.store import Store, get_json, put_file, put_json
from runtime_shim.backends.base import (
    Checkpointable,
    CheckpointImage,
    SandboxHandle,
    Snapshottable,
)

if TYPE_CHECKING:
    from runtime_shim.node.layout import NodeLayout, SandboxPaths
    from runtime_shim.node.locks import ResolvedLock
    from runtime_shim.node.packdiff import PolicyReport

CHECKPOINT_VERSION = 1
ANNOTATION_IMAGE = "org.envbuild.checkpoint.image"
ANNOTATION_IMAGE_TOC = "org.envbuild.checkpoint.image.toc"
ANNOTATION_RECORD = "org.envbuild.checkpoint.record"
#: Annotations of a checkpoint lock whose values are blob digests (``gc`` and ``job verify``).
CHECKPOINT_ANNOTATIONS = (ANNOTATION_IMAGE, ANNOTATION_RECORD)
MEDIA_TYPE_RECORD = "application/vnd.envbuild.checkpoint.record.v1+json"
#: The image dir of a checkpoint or restore, in the sandbox dir (host only).
IMAGE_DIR = "checkpoint-image"
#: A record is KBs (a file list and a process tree); refuse a bigger one unread.
MAX_RECORD_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class CheckpointResult:
    """What ``Sandbox.checkpoint`` made: the lock (and ``ref``), its snapshot layer, the
    memory image blob; sizes in bytes (``image_bytes``: the dump's files; ``image_stored``:
    the packed blob; ``files_bytes``: the snapshot layer), times in seconds."""

    lock: str
    ref: str | None
    layer: str
    image: str
    record: str
    image_bytes: int
    image_stored: int
    files_bytes: int
    dump_seconds: float
    seconds: float
    report: PolicyReport | None = None  # what pack-diff's policy did to the files

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "report"}
        if self.report is not None:
            out["report"] = self.report.to_json()
        return out


def take(handle: SandboxHandle, *, sandbox_id: str, backend: str, lock: ResolvedLock, paths: SandboxPaths,
         store: Store, publish: str | None, leave_running: bool) -> CheckpointResult:
    """Checkpoint the running sandbox ``handle`` (its id, backend name, lock and dir given;
    see the module docstring). With ``leave_running=False`` its processes are gone afterwards
    and the caller closes it."""
    from envbuild.layers import pack_tree
    from runtime_shim.node import packdiff

    if not isinstance(handle, Checkpointable) or not isinstance(handle, Snapshottable):
        raise BackendUnavailable(f"checkpoint with memory is not supported by the {backend} "
                                 "backend", hint="sb.pack_diff() saves the files only")
    started = time.monotonic()
    name = publish or sandbox_id
    image_dir = paths.root / IMAGE_DIR
    snap = paths.root / "checkpoint-files.tar.zst"
    packed = paths.root / "checkpoint-image.tar.zst"
    shutil.rmtree(image_dir, ignore_errors=True)
    try:
        with handle.quiesce():
            image = handle.checkpoint(image_dir, leave_running=leave_running)
            with open(snap, "wb") as out:
                info, report = packdiff.pack_upper(
                    handle.upper_dir(), out, packdiff.SnapshotPolicy.for_limits(handle.limits),
                    name=name)
        with open(packed, "wb") as out:
            img_info = pack_tree(image_dir, out, framing="compact", allow_devices=False)
        stored = put_file(store, snap)
        if stored.digest != info.digest:
            raise RuntimeShimError(f"snapshot stored as {stored.digest}, packed {info.digest}")
        put_file(store, packed)
        record = {"version": CHECKPOINT_VERSION, "backend": backend, "kind": image.kind,
                  "lock": lock.digest, "image": img_info.digest,
                  "image_bytes": image.bytes, "dump_seconds": round(image.seconds, 3),
                  "backend_record": dict(image.record)}
        rec = put_json(store, record, media_type=MEDIA_TYPE_RECORD)
    finally:
        for p in (snap, packed):
            p.unlink(missing_ok=True)
        shutil.rmtree(image_dir, ignore_errors=True)
    layer = {"digest": info.digest, "size": info.size, "diff_id": info.diff_id,
             "toc_digest": info.toc_digest, "name": name}
    manifest, config = packdiff.derive_lock(lock, [layer], keep=len(lock.layers))
    manifest["annotations"] = {**manifest["annotations"], ANNOTATION_IMAGE: img_info.digest,
                               ANNOTATION_IMAGE_TOC: img_info.toc_digest,
                               ANNOTATION_RECORD: rec.digest}
    digest = packdiff.publish_lock(store, manifest, config, publish)
    return CheckpointResult(lock=digest, ref=publish, layer=info.digest, image=img_info.digest,
                            record=rec.digest, image_bytes=image.bytes,
                            image_stored=img_info.size, files_bytes=info.size,
                            dump_seconds=image.seconds, seconds=time.monotonic() - started,
                            report=report)


def read_record(store: Store, lock: ResolvedLock) -> Mapping[str, Any]:
    """The checkpoint record a lock names, checked against the lock: ``CheckpointRefused`` if
    the lock is not a checkpoint or its record does not belong to it."""
    notes = lock.manifest.get("annotations") or {}
    digest, image = notes.get(ANNOTATION_RECORD), notes.get(ANNOTATION_IMAGE)
    if not isinstance(digest, str) or not isinstance(image, str):
        raise CheckpointRefused(f"lock {lock.digest[:19]} is not a checkpoint (no memory image)",
                                hint="Sandbox.create starts a sandbox from a snapshot's files")
    try:
        record = get_json(store, digest, max_size=MAX_RECORD_BYTES)
    except RuntimeShimError:
        raise
    except Exception as e:  # a StoreError: missing, too big, not JSON
        raise CheckpointRefused(f"checkpoint record {digest[:19]}: {e}") from None
    if not isinstance(record, dict) or record.get("version") != CHECKPOINT_VERSION:
        raise CheckpointRefused(f"checkpoint record {digest[:19]}: not a record of version "
                                f"{CHECKPOINT_VERSION}", hint="checkpoint again")
    parent = notes.get("org.envbuild.parent.lock")
    if record.get("image") != image or record.get("lock") != parent:
        raise CheckpointRefused(f"checkpoint record {digest[:19]} does not belong to lock "
                                f"{lock.digest[:19]}", hint="the lock was tampered with")
    return record


def unpack_image(store: Store, lock: ResolvedLock, record: Mapping[str, Any], dest: Path
                 ) -> CheckpointImage:
    """The memory image of a checkpoint lock, unpacked (safe unpacker, no devices) into
    ``dest``; its contents are checked by the backend's ``restore``."""
    from envbuild.layers import LayerReader

    notes = lock.manifest.get("annotations") or {}
    digest = str(record["image"])
    size = store.stat(digest).size
    reader = LayerReader(lambda off, n: store.get_range(digest, off, n), size, name=digest,
                         expected_toc_digest=notes.get(ANNOTATION_IMAGE_TOC))
    dest.mkdir()
    reader.unpack(dest, whiteouts="keep", allow_devices=False)
    inner = record.get("backend_record")
    if not isinstance(inner, dict):
        raise CheckpointRefused("checkpoint record: no backend record")
    return CheckpointImage(kind=str(record.get("kind")), dir=dest, record=inner,
                           bytes=int(record.get("image_bytes") or 0))


@contextlib.contextmanager
def unpacked_image(store: Store, lock: ResolvedLock, record: Mapping[str, Any],
                   layout: NodeLayout) -> Iterator[CheckpointImage]:
    """The memory image of the checkpoint ``lock`` (its ``record`` read by ``read_record``)
    unpacked under the node's ``restores/`` dir for ``Sandbox.create(restore=...)``; deleted
    on leaving (once the processes run, nothing of it stays under the node dir)."""
    layout.restores.mkdir(mode=0o700, exist_ok=True)
    dest = layout.restores / uuid.uuid4().hex
    try:
        yield unpack_image(store, lock, record, dest)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
