"""The node's content-addressed object store for native lazy layers: one file per distinct
file content, created as an empty placeholder and filled on first access.

Layout, on the node dir's own filesystem (root only, 0700)::

    <node>/objects/data/<hex>   the object: the file whose sha256 is <hex>, ``size`` bytes;
                                an empty placeholder until filled. The data-only lower
                                layer of every native layer's overlay (``nativetree``)
    <node>/objects/layers/<L>.json  where the objects of layer L come from: JSON {store,
                                s3_endpoint, layer, size, objects: {hex: [path, size]}}, one per
                                layer (not one file per object: a create of a 15,000-file
                                layer makes 15,000 inodes on the node's disk, not 30,000)
    <node>/objects/layers/<L>.toc   layer L's blob from its TOC frame to its end (TOC and
                                footer), as the create that first used L fetched it: the
                                filler reads L's TOC from here, not over the link again
                                (``LazyLayer(tail=...)`` verifies it as if fetched)
    <node>/objects/tmp/         placeholders being made, and fills being verified

**Fill state.** An object is complete once its xattr ``trusted.envbuild.filled`` is ``1``
or this boot's tag (``boot_tag``); the filler (``runtime_shim.lazyfs.filler``) sets the tag
after the verified bytes are written, then removes the object's fanotify mark. Everything
else is a placeholder the filler marks when it starts (so a restarted filler resumes), and
the filler makes and marks a layer's placeholders before a create mounts it (so no reader
reaches an unmarked placeholder). The TOC has one digest
per file (no per-frame digest), so a fill is a whole file: fetched, verified against the TOC
digest in a spool file, then copied into the placeholder: no byte of an unverified fill is
ever in the object.

**Why an empty placeholder, not a sparse one of the file's size**: the sizes a reader sees
come from the metadata tree (``trusted.overlay.metacopy`` files), never from the object, and
an empty object makes every way of reading it that the filler does not see fail loudly
rather than return a hole: a read past its end is the end of the file, an ``mmap`` of it is
SIGBUS, an ``execve`` an ENOEXEC — where a sparse placeholder read as zeros. The filler sees
every open while it lives (``FAN_OPEN_PERM``), so this is the last line: for the one case in
which its fanotify group is gone (``filler``: the holder and the worker both killed).

**Eviction** (``objgc``, ``node gc``): an object no used layer names is unlinked; an idle
complete one may be turned back into a marked empty placeholder.

**One object per content.** Two layers (of any image) holding the same file share the
object: one inode, one page-cache copy; the first layer record naming it is its source (any
source gives the same verified bytes).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import uuid
from typing import Any

from envbuild.atomic import write_atomic
from envbuild.errors import RuntimeShimError
from envbuild.oci import is_hex64

FILLED_XATTR = "trusted.envbuild.filled"
#: A fill's writes, at most this many bytes each (one 64 MiB write took 0.97 s here, 64
#: writes of 1 MiB 0.06 s).
WRITE_PIECE = 1 << 20
_DIRS = ("data", "layers", "tmp")


def boot_tag() -> bytes:
    """``trusted.envbuild.filled`` of an object filled since this boot: ``boot:<boot id>``.
    A fill's bytes are not synced (a ``syncfs`` a batch took 18-700 ms on this shared disk,
    and its readers waited for it): within a boot the page cache holds them for every
    reader; after a crash an object of another boot's tag may have lost them, so it counts
    as a placeholder again (marked, filled anew on its first open). ``1``: complete in any
    boot (an empty file's object)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return b"boot:" + f.read().strip()
    except OSError:
        return b"boot:unknown"


class ObjectStore:
    """``<node>/objects``: placeholders, their sources and fill state."""

    def __init__(self, node_root: str | os.PathLike[str]) -> None:
        self.root = os.path.join(os.path.abspath(node_root), "objects")
        self.data = os.path.join(self.root, "data")
        #: the fill state of an object filled in this boot (``boot_tag``)
        self.tag = boot_tag()

    def make_dirs(self) -> None:
        """Make the store's dirs; its root must be a real directory of root's (the filler's
        socket is in it: nobody else may reach or replace it)."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
            raise RuntimeShimError(
                f"{self.root} is not a directory of root's (uid {st.st_uid}): another user "
                "could reach or replace the native filler's socket",
                hint="remove it; only root should write in a node dir")
        os.chmod(self.root, 0o700)
        for sub in _DIRS:
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)

    def path(self, hexd: str) -> str:
        if not is_hex64(hexd):
            raise ValueError(f"bad object name {hexd!r}")
        return os.path.join(self.data, hexd)

    def tmp(self, what: str) -> str:
        return os.path.join(self.root, "tmp", f"{what}-{uuid.uuid4().hex[:12]}")

    def complete(self, hexd: str) -> bool:
        try:
            return os.getxattr(self.path(hexd), FILLED_XATTR) in (b"1", self.tag)
        except OSError:
            return False

    def layer_record(self, layer_hex: str) -> dict[str, Any]:
        """The source record of a layer (``record_layer``)."""
        if not is_hex64(layer_hex):
            raise ValueError(f"bad layer name {layer_hex!r}")
        with open(os.path.join(self.root, "layers", layer_hex + ".json"), encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or not isinstance(doc.get("objects"), dict):
            raise ValueError(f"layer {layer_hex}: bad source record")
        return doc

    def layer_records(self) -> list[str]:
        try:
            names = os.listdir(os.path.join(self.root, "layers"))
        except FileNotFoundError:
            return []
        return [n[:-5] for n in names if n.endswith(".json") and is_hex64(n[:-5])]

    def record_layer(self, layer: str, size: int, store: str, endpoint: str | None,
                     objects: dict[str, tuple[str, int]], tail: bytes = b"",
                     toc_digest: str = "") -> None:
        """Where the objects of ``layer`` (a blob of ``size`` bytes) come from: ``{hex: (path
        in the layer, size)}``, one record per layer (written once; a layer never changes);
        with ``tail`` (the blob's TOC and footer) and ``toc_digest`` (the lock's) when
        known."""
        hexd = layer.removeprefix("sha256:")
        path = os.path.join(self.root, "layers", hexd + ".json")
        if os.path.exists(path):
            return
        if tail:   # before the record: a record naming a tail finds it
            write_atomic(self.tail_path(hexd), tail)
        write_atomic(path, json.dumps({"store": store, "s3_endpoint": endpoint,
                                       "layer": layer, "size": size, "objects": objects,
                                       "toc_digest": toc_digest, "tail": len(tail)}))

    def tail_path(self, layer_hex: str) -> str:
        if not is_hex64(layer_hex):
            raise ValueError(f"bad layer name {layer_hex!r}")
        return os.path.join(self.root, "layers", layer_hex + ".toc")

    def layer_tail(self, layer_hex: str, length: int) -> bytes | None:
        """The tail ``record_layer`` kept of a layer (None: none, or not ``length`` bytes)."""
        if length <= 0:
            return None
        try:
            with open(self.tail_path(layer_hex), "rb") as f:
                data = f.read(length + 1)
        except FileNotFoundError:
            return None
        return data if len(data) == length else None

    def incomplete(self) -> list[str]:
        """Every placeholder (what a starting filler marks)."""
        try:
            names = os.listdir(self.data)
        except FileNotFoundError:
            return []
        return [n for n in names if is_hex64(n) and not self.complete(n)]


def _open_object(target: str, dir_fd: int | None = None) -> int:
    """The placeholder ``target`` opened for a fill. Never ``O_TRUNC``: on ext4 a truncate
    to 0 marks the file for a flush at its close (the replace-via-truncate heuristic,
    ``auto_da_alloc``): ~100 us of the fill's open and close an object here, and I/O the
    unsynced fills (``boot_tag``) mean to leave to writeback. The object holds at
    most these same bytes (a killed fill's prefix: only verified content is ever written),
    and ``_fit`` cuts anything past them."""
    return os.open(target, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)


def _fit(fd: int, size: int) -> None:
    if os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)


def write_into(target: str, data: bytes, *, dir_fd: int | None = None,
               state: tuple[str, bytes] | None = None) -> None:
    """Write verified ``data`` into the placeholder (not synced: ``boot_tag``); ``target``
    relative to ``dir_fd`` if given; with ``state`` (an xattr and its value: the fill
    state), that xattr set on the written file's own fd once every byte is in."""
    fd = _open_object(target, dir_fd)
    try:
        if len(data) <= WRITE_PIECE:
            os.pwrite(fd, data, 0)   # a small file (most): no view, no slice
        else:
            view = memoryview(data)
            for off in range(0, len(view), WRITE_PIECE):
                os.pwrite(fd, view[off:off + WRITE_PIECE], off)
        _fit(fd, len(data))
        if state is not None:
            os.setxattr(fd, *state)
    finally:
        os.close(fd)


def copy_into(spool: str, target: str, size: int) -> None:
    """Copy the verified spool into the placeholder (not synced: ``boot_tag``)."""
    src = os.open(spool, os.O_RDONLY | os.O_CLOEXEC)
    dst = _open_object(target)
    try:
        done = 0
        while done < size:
            n = os.copy_file_range(src, dst, size - done, done, done)
            if n <= 0:
                raise OSError(errno.EIO, f"copy into {target} stopped at {done} of {size}")
            done += n
        _fit(dst, size)
    finally:
        os.close(src)
        os.close(dst)


__all__ = ["FILLED_XATTR", "ObjectStore", "boot_tag", "copy_into", "write_into"]
