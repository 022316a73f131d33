"""Eviction of the node's object store (``objects``): what ``envbuild node ls`` shows of it
and what ``envbuild node gc`` frees (issue 36, items 3 and 4).

**Unused objects are unlinked.** An object is *used* while a layer whose source record names
it is mounted (``<node>/native/<hex>``) or is being made ready by a create (it holds the
layer's lock, ``locks/native-<hex>.meta.lock``, the one ``nativetree.ensure`` holds from
placement to mount). ``collect`` takes the lock of every other layer with a record (without
waiting: a layer whose lock is busy is used), and, while it holds them, those layers' records
(``<hex>.json``, ``<hex>.toc``) and every object no remaining record names are removed — a
placeholder's mark first (a mark pins its inode). The removal runs where placements run, so
that none interleaves, in batches (``UNLINK_BATCH``), placements kept out during each and
records placed in between read before the next: in the filler (request ``evict``, under its
placement lock, and it forgets those layers: their records, trees, readers and predictions'
views), or, when no filler answers, by ``objcollect`` under the holder's lock
(``filler.lock``: no filler can start, so no placement, while it is held; the marks went
with the last group). A layer mounted later is
placed again first: its placement makes the placeholders the node lacks.

**Idle objects are emptied** (``node gc --objects-max SIZE``): while the filled objects take
more than SIZE on disk, complete objects of mounted layers are turned back into placeholders,
least recently read first (``st_atime``), by the filler (``empty``): the object is claimed
(single flight: a fill or an open of it waits), *marked again*, opened through the worker's
write mount and taken under a write lease (``F_SETLEASE F_WRLCK``), which the kernel grants
only while no other file of the inode is open (no reader, no mapping, no execution); then its
fill state is removed, then it is truncated to 0 — the empty placeholder a fresh object is
(``objects``: never a sparse file of the content's size, which would read as zeros were the
group gone) —, the lease dropped and the claim released. An open that came meanwhile waited
for the claim (its ``FAN_OPEN_PERM`` is answered after a fill of its own); an open after is
marked like any placeholder's. **Why a reader in flight never sees a hole**: a reader has the
object open, so the lease is refused and the object is left complete (``busy``). A reader's
open increments the inode's read count (atomically: a full barrier) before the kernel reads
its marks to decide whether the file raises pre-content events; the mark is added before the
lease, and the lease checks the read count after it is set: either the reader is counted
(refused) or it saw the mark (its reads wait for the fill). Lease breaks (the group's own
open of an event's file, while the lease is held) are answered with ``SIGWINCH`` (ignored),
not ``SIGIO`` (which would end the worker), and last only until the lease is dropped, a
few system calls later. Why not ``FALLOC_FL_PUNCH_HOLE``: a punched object keeps its size
and reads as zeros wherever no group watches it; a truncated one ends at once.

Without a private write mount (``fillworker.writer_mount``) the filler does not empty: its
truncate would raise an event only its reading thread answers, which may wait on the lease.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from envbuild.oci import is_hex64
from runtime_shim.lazyfs import fanotify
from runtime_shim.lazyfs.objects import FILLED_XATTR, ObjectStore

#: ``fcntl(F_SETSIG)``: the signal of a lease break (default action: ignore).
F_SETSIG = 10
#: Objects unlinked a batch, placements kept out (a create's placement waits for at most
#: a batch: 4,096 unlinks took ~0.9 s on this shared disk).
UNLINK_BATCH = 4096
#: Layers an ``evict`` request may name.
MAX_LAYERS = 4096


# -- what there is -----------------------------------------------------------------------


def mounted_layers(node_root: str) -> set[str]:
    """Hexes of the native layers mounted on the node (``<node>/native/<hex>``)."""
    from runtime_shim.isolation.mount import mounted_targets_under

    base = os.path.join(node_root, "native")
    return {os.path.basename(m) for m in mounted_targets_under(base)
            if os.path.dirname(m) == base and is_hex64(os.path.basename(m))}


def named_by(objects: ObjectStore, layers: Iterable[str]) -> set[str]:
    """The objects the source records of ``layers`` name (a layer without one: none)."""
    out: set[str] = set()
    for hexd in layers:
        with contextlib.suppress(OSError, ValueError):
            out.update(objects.layer_record(hexd)["objects"])
    return out


def describe_objects(node_root: str) -> dict[str, int]:
    """``node ls``: objects, complete / partial (a killed fill's prefix, another boot's
    fill) / empty placeholders, bytes allocated on disk (``st_blocks``, not sizes), and
    those a mounted layer names (objects and bytes), and the layer records."""
    root = os.path.abspath(node_root)
    objects = ObjectStore(root)
    mounted = mounted_layers(root)
    used = named_by(objects, mounted)
    out = dict.fromkeys(("objects", "complete", "partial", "placeholders", "bytes",
                         "in_use", "in_use_bytes"), 0)
    for name, st, done in _scan(objects):
        size = st.st_blocks * 512
        out["objects"] += 1
        out["bytes"] += size
        kind = "complete" if done else "partial" if st.st_size or st.st_blocks else \
            "placeholders"
        out[kind] += 1
        if name in used:
            out["in_use"] += 1
            out["in_use_bytes"] += size
    out["layers_mounted"] = len(mounted)
    out["layer_records"] = len(objects.layer_records())
    return out


def _scan(objects: ObjectStore) -> Iterator[tuple[str, os.stat_result, bool]]:
    """Each object: its name, ``lstat`` and whether it is complete."""
    try:
        names = os.listdir(objects.data)
    except FileNotFoundError:
        return
    for name in names:
        if not is_hex64(name):
            continue
        try:
            st = os.lstat(os.path.join(objects.data, name))
        except FileNotFoundError:
            continue
        yield name, st, objects.complete(name)


def drop_records(objects: ObjectStore, layers: Iterable[str]) -> None:
    """Remove the source records (and TOC tails) of ``layers``."""
    for hexd in layers:
        if not is_hex64(hexd):
            raise ValueError(f"bad layer name {hexd!r}")
        for suffix in (".json", ".toc"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(objects.root, "layers", hexd + suffix))


def unlink_unused(objects: ObjectStore, held: Callable[[], AbstractContextManager[bool]], *,
                  skip: Callable[[str], bool] = lambda _h: False,
                  unmark: Callable[[str], None] | None = None) -> tuple[int, int, set[str]]:
    """Unlink the objects no layer record names (nor ``skip``-ped), each unmarked first
    (``unmark``), in batches of ``UNLINK_BATCH``, each under ``held()`` (what keeps
    placements out; it yields False when it cannot be had: the rest is left), records that
    appeared since the last batch read first (a layer placed meanwhile keeps its objects).
    How many, the bytes they held on disk, and the objects the records name."""
    with held() as ok:
        if not ok:
            return 0, 0, set()
        names = set(objects.layer_records())
        keep = named_by(objects, names)
        todo = [(name, st.st_blocks * 512) for name, st, _ in _scan(objects)
                if name not in keep]
    n = freed = 0
    for start in range(0, len(todo), UNLINK_BATCH):
        with held() as ok:
            if not ok:
                break
            new = set(objects.layer_records()) - names
            keep |= named_by(objects, new)
            names |= new
            for name, size in todo[start:start + UNLINK_BATCH]:
                if name in keep or skip(name):
                    continue
                if unmark is not None:
                    unmark(name)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(objects.data, name))
                    n += 1
                    freed += size
    return n, freed, keep


# -- the filler's side -------------------------------------------------------------------


def serve_evict(w: Any, req: dict[str, Any]) -> dict[str, Any]:
    """The worker's ``evict`` (``fillworker.Worker`` ``w``; module docstring): under its
    placement lock, forget the ``layers`` the client holds, drop their records, unlink what
    no other record names; then, with ``max_bytes``, empty idle objects."""
    layers = req.get("layers") or []
    max_bytes = req.get("max_bytes")
    if not isinstance(layers, list) or len(layers) > MAX_LAYERS or \
            not all(isinstance(h, str) and is_hex64(h) for h in layers):
        return {"ok": False, "error": f"layers: a list of at most {MAX_LAYERS} layer hexes"}
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
                                  or max_bytes < 0):
        return {"ok": False, "error": "max_bytes: a number of bytes, or null"}
    objects: ObjectStore = w.objects
    mounted = _mounted_for_holder(objects.root)
    if mounted & set(layers):   # the client is root, and still: never a mounted layer's
        return {"ok": False, "error": f"layer {sorted(mounted & set(layers))[0]} is mounted"}
    odir = w.objdir()
    with w._place_lock:
        forget(w, layers)
        drop_records(objects, layers)

    @contextlib.contextmanager
    def placements_out() -> Iterator[bool]:
        with w._place_lock:
            yield True
    n, freed, keep = unlink_unused(
        objects, placements_out, skip=lambda h: _claimed(w, h),
        unmark=lambda h: fanotify.mark(w.group, h, remove=True, dir_fd=odir.fd))
    reply = {"ok": True, "unlinked": n, "unlinked_bytes": freed, "forgot": len(layers)}
    if max_bytes is not None:
        reply.update(shrink(w, keep, max_bytes))
    return reply


def _mounted_for_holder(objects_root: str) -> set[str]:
    """The native layers mounted on the node as the worker's holder sees them (the worker's
    own mount namespace holds only the object store: ``fillworker.writer_mount``)."""
    base = os.path.join(os.path.dirname(objects_root), "native")
    try:
        with open(f"/proc/{os.getppid()}/mountinfo", encoding="utf-8",
                  errors="surrogateescape") as f:
            points = [line.split(" ", 5)[4].replace("\\040", " ") for line in f]
    except OSError:
        return set()
    return {os.path.basename(p) for p in points if os.path.dirname(p) == base}


def _claimed(w: Any, hexd: str) -> bool:
    with w._lock:
        return hexd in w._waiting


def forget(w: Any, layers: Collection[str]) -> None:
    """Drop what worker ``w`` holds of ``layers`` (records, sources, readers, trees, blob
    orders, predictions' views and the stacks holding them): a hostile layer's memory goes
    with its last mount, not with the filler."""
    if not layers:
        return
    digests = {"sha256:" + h for h in layers}
    with w._lock:
        for h in layers:
            w._layers_loaded.discard(h)
            w._records.pop(h, None)
            w._index_urls.pop(h, None)
        sources: dict[str, tuple[dict[str, Any], str, int]] = {}
        for rec in w._records.values():
            for hexd, (path, size) in rec["objects"].items():
                sources.setdefault(hexd, (rec, str(path), int(size)))
        w._sources = sources
        for d in digests:
            w._orders.pop(d, None)
            w._ranges.pop(d, None)
        for key in [k for k in w._readers if k.rsplit("\0", 1)[-1] in digests]:
            del w._readers[key]
    with w._tree_lock:
        for d in digests:
            w._trees.pop(d, None)
    hints = w.hints
    with hints._lock:
        for h in layers:
            hints._views.pop(h, None)
        for key in [k for k in hints._stacks if set(k) & set(layers)]:
            del hints._stacks[key]
        for h in [h for h, k in hints._stack_of.items() if set(k) & set(layers)]:
            del hints._stack_of[h]
        for cache in (hints._roots, hints._expanded):
            for key in [k for k in cache if set(k) & set(layers)]:
                del cache[key]
    _release_memory()


def _release_memory() -> None:
    """Collect what was frozen with the forgotten layers (the worker freezes its records
    after each placement: ``filler``) and hand freed heap back to the kernel."""
    import ctypes
    import gc

    from envbuild.libc import function

    gc.unfreeze()
    gc.collect()
    gc.freeze()
    with contextlib.suppress(AttributeError):
        function("malloc_trim", argtypes=[ctypes.c_size_t])(0)


def shrink(w: Any, used: Collection[str], max_bytes: int) -> dict[str, Any]:
    """Empty complete objects of ``used`` (``empty``), least recently read first, while the
    objects take more than ``max_bytes`` on disk; what was emptied, and what was busy."""
    if os.path.realpath(w.wdata) == os.path.realpath(w.objects.data):
        return {"emptied": 0, "emptied_bytes": 0, "busy": 0,
                "shrink_skipped": "the filler has no private write mount"}
    total = 0
    candidates = []
    for name, st, done in _scan(w.objects):
        total += st.st_blocks * 512
        if done and st.st_blocks and name in used:
            candidates.append((st.st_atime, -st.st_blocks, name, st.st_blocks * 512))
    emptied = emptied_bytes = busy = 0
    for _at, _b, name, size in sorted(candidates):
        if total <= max_bytes:
            break
        try:
            ok = empty(w, name)
        except OSError as e:   # e.g. the mark limit: the rest stays filled
            return {"emptied": emptied, "emptied_bytes": emptied_bytes, "busy": busy,
                    "bytes_left": total, "shrink_stopped": str(e)}
        if ok:
            emptied += 1
            emptied_bytes += size
            total -= size
        else:
            busy += 1
    return {"emptied": emptied, "emptied_bytes": emptied_bytes, "busy": busy,
            "bytes_left": total}


def empty(w: Any, hexd: str) -> bool:
    """Turn complete object ``hexd`` back into a marked placeholder if no one has it open
    (module docstring); False when it is busy, claimed or not complete."""
    with w._lock:
        if hexd in w._waiting:
            return False
        w._waiting[hexd] = []   # claimed: opens of it wait for us, then fill it anew
    odir = w.objdir()
    marked = emptied = False
    try:
        if not w.objects.complete(hexd):
            return False
        fanotify.mark(w.group, hexd, dir_fd=odir.fd)
        marked = True
        emptied = _truncate_if_idle(hexd, odir.wfd)
        return emptied
    finally:
        if marked and not emptied:
            with contextlib.suppress(OSError):
                fanotify.mark(w.group, hexd, remove=True, dir_fd=odir.fd)
        w._release([hexd])


def _truncate_if_idle(hexd: str, wdir_fd: int) -> bool:
    """Under a write lease (granted only while no other file of the object is open): its
    fill state removed, then its bytes. False when it is open elsewhere."""
    try:
        fd = os.open(hexd, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=wdir_fd)
    except OSError as e:
        if e.errno in (errno.ETXTBSY, errno.ENOENT):
            return False   # being executed; or gone
        raise
    try:
        fcntl.fcntl(fd, F_SETSIG, signal.SIGWINCH)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EBUSY):
                return False   # open elsewhere (a reader, a mapping, an execution)
            raise
        try:
            os.removexattr(fd, FILLED_XATTR)   # first: a crash between leaves a placeholder
            os.ftruncate(fd, 0)
        finally:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return True
    finally:
        os.close(fd)


__all__ = ["MAX_LAYERS", "UNLINK_BATCH", "describe_objects", "drop_records", "empty", "forget",
           "mounted_layers", "named_by", "serve_evict", "shrink", "unlink_unused"]
