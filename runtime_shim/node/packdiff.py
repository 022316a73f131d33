"""pack-diff: a sandbox's changes as a new layer, and a lock that stacks it on its parent.

A sandbox's upper dir is exactly its diff against the lock's layers (overlayfs: new and changed
files, 0/0 character devices for deletions, ``trusted.overlay.opaque`` for directories whose
lower contents are hidden). Packing it reads only the upper dir — never the lower layers — so
the cost is proportional to the change, and the layer writer converts the overlay markers to
OCI whiteouts.

**The upper dir is hostile input.** Whatever ran in the sandbox chose its contents. The
``SnapshotPolicy`` is applied to every entry while packing (``pack_tree(entry_filter=...)``),
and every decision is reported (``PolicyReport``, in ``--json`` output):

- device nodes and FIFOs are dropped (overlay whiteouts, which are 0/0 character devices, are
  deletions and are kept — as OCI whiteouts);
- setuid and setgid bits are stripped;
- ``security.capability`` and ``trusted.*`` extended attributes are dropped (other
  ``security.*`` too: labels from one host mean nothing on another);
- a file larger than ``max_file_bytes``, more than ``max_total_bytes`` in all, or more than
  ``max_entries`` members refuse the whole snapshot (``SnapshotRefused``) instead of filling
  the store — nothing is published. Sizes are *apparent* sizes: a sparse file (``truncate -s
  1000M``) packs into a few KB but restores as its full size, so it counts in full, and the
  report lists it (``sparse``, with its allocated bytes). The default caps are tied to the
  sandbox (``SnapshotPolicy.for_limits``): a snapshot may not restore to more than the disk
  the sandbox had;
- a file with hardlinks outside the upper dir refuses the snapshot (an upper dir can only hold
  links among its own files);
- symlinks are stored as links and never followed (the walker opens every name relative to
  its directory's fd, no-follow);
- only the overlay's own markers are interpreted (the sandbox overlay is mounted with
  ``trusted.overlay.*``, which sandbox root cannot set: no ``CAP_SYS_ADMIN``): a file,
  directory or symlink the agent *named* ``.wh.NAME`` or ``.wh..wh..opq`` is dropped (OCI
  reserves those names; packing it would delete ``NAME`` or hide a directory on restore), and
  ``user.overlay.*`` attributes are dropped, never read as opaque markers — both reported;
- a tree of any depth is walked iteratively, but a path longer than 4,095 bytes (``PATH_MAX``,
  e.g. a 4,096-deep ``d/d/…``) refuses the snapshot, naming the path: no unpacker could
  recreate it.

A **derived lock** is the parent lock plus the new layer (role ``snapshot``), annotated with the
parent lock's digest and the creation time. Chains of snapshots grow one layer per pack-diff;
``squash_snapshots`` merges the trailing snapshot layers of a lock into one (whiteouts
resolved), and ``max_chain`` squashes automatically.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from envbuild.errors import RuntimeShimError, SnapshotRefused, UnsafeLayerError
from envbuild.layers import Entry, LayerInfo, LayerReader, pack_tree
from envbuild.oci import (
    ANNOTATION_CREATED,
    ANNOTATION_NAME,
    ANNOTATION_PARENT,
    ANNOTATION_ROLE,
    ANNOTATION_TOC,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_LAYER_ZSTD,
    MEDIA_TYPE_MANIFEST,
)
from envbuild.safefs import iter_tree, open_beneath, remove_tree
from envbuild.store import Store, put_file, put_json
from envbuild.store.base import LocalBlobPaths
from runtime_shim.node.locks import LayerRef, ResolvedLock

SNAPSHOT_ROLE = "snapshot"
UPPER_OVERLAY_XATTR = "trusted"  # runtime_shim.isolation.mount and the microVM init mount the sandbox
#                                  overlay without userxattr: its markers are trusted.overlay.*
DROPPED_XATTR_PREFIXES = ("security.", "trusted.")
#: Apparent bytes a snapshot may restore to when the sandbox names no disk limit: the default
#: of ``Limits.disk_bytes`` (10 GiB); ``for_limits`` takes the sandbox's own limit.
DEFAULT_SNAPSHOT_BYTES = 10 << 30


@dataclasses.dataclass(frozen=True)
class SnapshotPolicy:
    """What a snapshot of untrusted sandbox changes may contain. Defaults are safe.

    ``max_file_bytes`` and ``max_total_bytes`` are apparent sizes (what the snapshot restores
    to), so sparse files count in full.

    Not configurable, whatever the policy: names starting with ``.wh.`` (reserved by OCI for
    whiteouts) are dropped and reported, only real overlay whiteouts (0/0 character devices)
    and ``trusted.overlay.opaque`` become OCI whiteouts and opaque markers, ``user.overlay.*``
    attributes are dropped and reported, and a path longer than 4,095 bytes refuses the
    snapshot (see the module docstring)."""

    drop_devices: bool = True
    strip_setid: bool = True
    drop_xattr_prefixes: tuple[str, ...] = DROPPED_XATTR_PREFIXES
    max_file_bytes: int = 1 << 30
    max_total_bytes: int = DEFAULT_SNAPSHOT_BYTES
    max_entries: int = 1_000_000

    @classmethod
    def for_limits(cls, limits: Any = None, **overrides: Any) -> SnapshotPolicy:
        """The policy for a sandbox with ``limits`` (a ``runtime_shim.sdk.sandbox.Limits``): the
        snapshot may restore to at most the sandbox's disk limit, one file to at most the
        smaller of that and ``max_file_bytes``' default."""
        # a sandbox without a disk cap (disk_bytes=None) still gets the default cap
        disk = (limits.disk_bytes if limits is not None else None) or DEFAULT_SNAPSHOT_BYTES
        caps = {"max_total_bytes": disk, "max_file_bytes": min(cls.max_file_bytes, disk)}
        return cls(**{**caps, **overrides})


@dataclasses.dataclass
class PolicyReport:
    """Every decision the policy took, for the user and for ``--json``."""

    decisions: list[dict[str, str]] = dataclasses.field(default_factory=list)
    entries: int = 0
    bytes: int = 0          # apparent bytes of the files packed
    sparse_bytes: int = 0   # of which holes: restored as data, never written by the sandbox

    def note(self, path: str, action: str, reason: str) -> None:
        self.decisions.append({"path": path, "action": action, "reason": reason})

    def to_json(self) -> dict[str, Any]:
        return {"entries": self.entries, "bytes": self.bytes, "sparse_bytes": self.sparse_bytes,
                "decisions": self.decisions}


@dataclasses.dataclass(frozen=True)
class SnapshotResult:
    """What ``Sandbox.pack_diff`` made: the layer, the derived lock (and its ref)."""

    layer: str
    lock: str
    ref: str | None
    size: int
    report: PolicyReport
    squashed: bool
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "lock": self.lock, "ref": self.ref, "size": self.size,
                "squashed": self.squashed, "seconds": round(self.seconds, 3),
                "policy": self.report.to_json()}


def hardlinks_leaving(root: Path) -> list[str]:
    """Regular files below ``root`` whose link count is higher than the number of their names
    below ``root``: linked to something outside it. Iterative and fd-based (any depth)."""
    seen: dict[tuple[int, int], list[str]] = {}
    nlink: dict[tuple[int, int], int] = {}
    for parts, _fd, entry in iter_tree(root):
        if not entry.is_file(follow_symlinks=False):
            continue
        st = entry.stat(follow_symlinks=False)
        if st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            rel = os.fsdecode(b"/".join([*parts, os.fsencode(entry.name)]))
            seen.setdefault(key, []).append(rel)
            nlink[key] = st.st_nlink
    return sorted(p for key, paths in seen.items() if len(paths) < nlink[key] for p in paths)


# (entry, source path) pairs as walk_tree gives them to pack_tree's entry_filter
_Members = Iterator[tuple[Entry, str | None]]


def policy_filter(policy: SnapshotPolicy, report: PolicyReport,
                  name: str) -> Callable[[_Members], _Members]:
    """An ``entry_filter`` for ``pack_tree`` applying ``policy`` and recording in ``report``."""

    def apply(entries: _Members) -> _Members:
        dropped: set[str] = set()
        for e, src in entries:
            if e.type in ("char", "block", "fifo") and policy.drop_devices:
                dropped.add(e.path)
                report.note(e.path, "dropped", f"{e.type} device" if e.type != "fifo" else "fifo")
                continue
            if e.type == "hardlink" and e.linkname in dropped:
                dropped.add(e.path)
                report.note(e.path, "dropped", f"hardlink to dropped {e.linkname}")
                continue
            if policy.strip_setid and e.mode & 0o6000 and e.type in ("file", "hardlink", "dir"):
                bits = " and ".join(b for b, m in (("setuid", 0o4000), ("setgid", 0o2000))
                                    if e.mode & m and not (e.type == "dir" and m == 0o2000))
                if bits:
                    e.mode &= ~0o4000 if e.type == "dir" else ~0o6000
                    report.note(e.path, "stripped", bits)
            if e.xattrs:
                bad = [k for k in e.xattrs if k.startswith(policy.drop_xattr_prefixes)]
                for k in bad:
                    del e.xattrs[k]
                    report.note(e.path, "dropped-xattr", k)
            report.entries += 1
            if report.entries > policy.max_entries:
                raise SnapshotRefused(f"snapshot of {name}: more than {policy.max_entries} "
                                      "entries", hint="raise max_entries, or clean up first")
            if e.type == "file":
                if e.size > policy.max_file_bytes:
                    raise SnapshotRefused(
                        f"snapshot of {name}: {e.path} is {e.size} bytes, over the "
                        f"{policy.max_file_bytes}-byte limit per file",
                        hint="delete it in the sandbox or raise max_file_bytes")
                report.bytes += e.size
                allocated = _allocated(src, e.size)
                if allocated < e.size:
                    report.sparse_bytes += e.size - allocated
                    report.note(e.path, "sparse", f"{e.size} bytes apparent, {allocated} "
                                "allocated: restores as the full size")
                if report.bytes > policy.max_total_bytes:
                    raise SnapshotRefused(
                        f"snapshot of {name}: more than {policy.max_total_bytes} bytes changed "
                        f"(apparent sizes, {report.sparse_bytes} bytes of them in holes of "
                        "sparse files)",
                        hint="raise max_total_bytes, or clean up caches in the sandbox first")
            yield e, src

    return apply


def _allocated(src: bytes | str | None, size: int) -> int:
    """Bytes of disk a file holds (``st_blocks``); ``size`` if it cannot be told."""
    if src is None:
        return size
    try:
        return min(size, os.lstat(src).st_blocks * 512)
    except OSError:
        return size


def pack_upper(upper: Path, out: BinaryIO, policy: SnapshotPolicy, *, name: str,
               source_date_epoch: int = 0,
               select: Callable[[_Members], _Members] | None = None,
               ) -> tuple[LayerInfo, PolicyReport]:
    """Pack an overlay upper dir under ``policy``: ``(LayerInfo, PolicyReport)``.
    ``select`` (an ``entry_filter``) runs first: what it drops is never read nor counted
    against the policy's caps (the grader's change-set filter, ``runtime_shim.grading``)."""
    leaving = hardlinks_leaving(upper)
    if leaving:
        raise SnapshotRefused(f"snapshot of {name}: {leaving[0]} is hardlinked outside the "
                              f"sandbox's changes ({len(leaving)} such file(s))",
                              hint="an upper dir should hold no such links; is it tampered?")
    report = PolicyReport()
    try:
        info = pack_tree(upper, out, overlay_upper=True, source_date_epoch=source_date_epoch,
                         entry_filter=_then(select, policy_filter(policy, report, name)),
                         overlay_xattr=UPPER_OVERLAY_XATTR, on_dropped=report.note)
    except SnapshotRefused:
        raise
    except UnsafeLayerError as e:  # the walker's limits (a path too long for any unpacker)
        raise SnapshotRefused(f"snapshot of {name}: {e.message}", hint=e.hint) from None
    return info, report


def _then(first: Callable[[_Members], _Members] | None,
          second: Callable[[_Members], _Members]) -> Callable[[_Members], _Members]:
    return second if first is None else (lambda entries: second(first(entries)))


# ---------------------------------------------------------------------------------- locks


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def derive_lock(parent: ResolvedLock, layers: list[dict[str, Any]], *, keep: int,
                created: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, config) of ``parent``'s first ``keep`` layers plus ``layers``
    (each ``{digest, size, diff_id, toc_digest, name}``), annotated with the parent lock."""
    created = created or _now()
    config = copy.deepcopy(dict(parent.config))
    manifest = copy.deepcopy(dict(parent.manifest))
    config["rootfs"]["diff_ids"] = config["rootfs"]["diff_ids"][:keep]
    config["history"] = list(config.get("history", []))[:keep]
    manifest["layers"] = manifest["layers"][:keep]
    for layer in layers:
        config["rootfs"]["diff_ids"].append(layer["diff_id"])
        config["history"].append({"created": created,
                                  "created_by": f"envbuild pack-diff {layer['name']}"})
        manifest["layers"].append({
            "mediaType": MEDIA_TYPE_LAYER_ZSTD, "digest": layer["digest"], "size": layer["size"],
            "annotations": {ANNOTATION_TOC: layer["toc_digest"], ANNOTATION_ROLE: SNAPSHOT_ROLE,
                            ANNOTATION_NAME: layer["name"]}})
    config["created"] = created
    manifest["annotations"] = {**manifest.get("annotations", {}),
                               ANNOTATION_PARENT: parent.digest, ANNOTATION_CREATED: created}
    return manifest, config


def publish_lock(store: Store, manifest: dict[str, Any], config: dict[str, Any],
                 ref: str | None) -> str:
    """Store config, then manifest, then (optionally) the ref; the manifest digest."""
    cfg = put_json(store, config, media_type=MEDIA_TYPE_CONFIG)
    manifest["config"] = {"mediaType": MEDIA_TYPE_CONFIG, "digest": cfg.digest,
                          "size": cfg.size}
    digest = put_json(store, manifest, media_type=MEDIA_TYPE_MANIFEST).digest
    if ref:
        store.put_ref(ref, digest, media_type=MEDIA_TYPE_MANIFEST)
    return digest


def snapshot_chain(lock: ResolvedLock) -> int:
    """How many layers at the top of ``lock`` are snapshots."""
    n = 0
    for layer in reversed(lock.layers):
        if layer.role != SNAPSHOT_ROLE:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------- squash


def _reader(store: Store, digest: str, toc_digest: str | None) -> LayerReader:
    if isinstance(store, LocalBlobPaths) and store.blob_path(digest).is_file():
        return LayerReader.open_file(store.blob_path(digest), name=digest,
                                     expected_toc_digest=toc_digest or None)
    return LayerReader.from_store(store, digest, expected_toc_digest=toc_digest or None)


def _is_whiteout(root_fd: int, rel: str) -> bool:
    parent, _, base = rel.rpartition("/")
    try:
        fd = open_beneath(root_fd, parent, os.O_PATH | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        st = os.lstat(base, dir_fd=fd)
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def merge_upper(store: Store, layers: Iterable[LayerRef], dest: Path) -> None:
    """Merge diff layers (bottom to top) into one overlay-style upper dir at ``dest``.

    Each layer is unpacked with its whiteouts kept as overlay whiteouts (they hide content of
    the layers *below the chain* too); an opaque directory first loses what earlier chain
    layers put in it; a directory created where an earlier layer left a whiteout becomes
    opaque, as overlayfs itself does when a deleted directory is made again. Paths are
    resolved below ``dest``'s fd without following symlinks (``safefs.open_beneath``) and
    emptied directories removed iteratively (``safefs.remove_tree``)."""
    dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for layer in layers:
            reader = _reader(store, layer.digest, layer.toc_digest)
            try:
                entries = reader.entries()
                reopened = []
                for e in entries:
                    parent, _, base = e.path.rpartition("/")
                    if base == ".wh..wh..opq":
                        _empty_dir(dest_fd, parent)
                    elif e.type == "dir" and _is_whiteout(dest_fd, e.path):
                        reopened.append(e.path)
                reader.unpack(dest, whiteouts="overlay")
                for p in reopened:
                    fd = open_beneath(dest_fd, p, os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        os.setxattr(fd, "trusted.overlay.opaque", b"y")
                    finally:
                        os.close(fd)
            finally:
                close = getattr(reader, "close", None)
                if close:
                    close()
    finally:
        os.close(dest_fd)


def _empty_dir(root_fd: int, rel: str) -> None:
    """Remove everything in the directory ``rel`` below ``root_fd`` (nothing if it is not a
    real directory there)."""
    try:
        fd = open_beneath(root_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink on the way: not a directory of this tree
            return
        raise
    try:
        for child in os.listdir(fd):
            remove_tree(child, dir_fd=fd)
    finally:
        os.close(fd)


def squash_snapshots(store: Store, lock: ResolvedLock, *, scratch: Path, ref: str | None,
                     name: str = "squash") -> str | None:
    """Replace the trailing snapshot layers of ``lock`` by one; publish the derived lock under
    ``ref``. Returns its digest, or None when there is at most one snapshot layer."""
    chain = snapshot_chain(lock)
    if chain < 2:
        return None
    keep = len(lock.layers) - chain
    work = Path(tempfile.mkdtemp(prefix="squash-", dir=scratch))
    try:
        upper = work / "upper"
        upper.mkdir()
        merge_upper(store, lock.layers[keep:], upper)
        blob = work / "layer.tar.zst"
        with open(blob, "wb") as out:
            info = pack_tree(upper, out, overlay_upper=True)
        stored = put_file(store, blob)
        if stored.digest != info.digest:
            raise RuntimeShimError(f"squash: stored {stored.digest}, packed {info.digest}")
        from runtime_shim.lazyfs.pyindex import index_layer_file

        index_layer_file(store, str(blob), info.digest)   # for lazy sandboxes (pyindex)
        manifest, config = derive_lock(lock, [{"digest": info.digest, "size": info.size,
                                               "diff_id": info.diff_id,
                                               "toc_digest": info.toc_digest, "name": name}],
                                       keep=keep)
        return publish_lock(store, manifest, config, ref)
    finally:
        remove_tree(work)
