"""The native filler's worker (``filler``): places and marks the node's objects, answers the
fanotify events of their first opens, and fills them from their layers, each verified against
its TOC digest before any reader sees a byte (module docstring of ``filler``)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envbuild.oci import is_hex64
from runtime_shim.lazyfs import fanotify, fillwindow
from runtime_shim.lazyfs.fillbatch import ObjectDir
from runtime_shim.lazyfs.fillhints import Hints, LayerView
from runtime_shim.lazyfs.fillwindow import WINDOW_MAX_FILE, FileRef, LayerOrder
from runtime_shim.lazyfs.objects import FILLED_XATTR, ObjectStore, copy_into, write_into

log = logging.getLogger("envbuild.lazyfs.filler")

#: The worker's fd limit: every event fd it ever holds is below it, so a successor can answer
#: a dead worker's unanswered events by number.
MAX_FDS = 4096
#: Fills at once (each a ranged read of the store, then a local copy).
FILL_WORKERS = 8
#: Files up to this size are read whole in memory (``LazyLayer.read``: frames fetched in
#: parallel, verified in memory; a 64 MiB file in 0.1 s here, where streaming it through a
#: spool took 0.45 s), at most ``MEMORY_BUDGET`` bytes of them at once; larger ones streamed.
STREAM_ABOVE = 64 << 20
MEMORY_BUDGET = 256 << 20
#: Fills ahead of opens in flight (windows, predictions), and the size of a predicted batch:
#: one ranged read or a few, each batch's files written together.
AHEAD_WORKERS = 8
AHEAD_FILES = 32
AHEAD_BYTES = 4 << 20
#: The node-wide cap of root's fanotify marks (the holder raises it: ``filler``).
MARKS_SYSCTL = "/proc/sys/fs/fanotify/max_user_marks"


class Worker:
    """Marks placeholders, answers events, fills objects (one fill per object at a time)."""

    def __init__(self, node_root: str, group: int) -> None:
        self.objects = ObjectStore(node_root)
        self.group = group
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._place_lock = threading.Lock()   # one layer's placement at a time
        self._waiting: dict[str, list[int]] = {}   # object → event fds waiting for its fill
        self._readers: dict[str, Any] = {}
        self._sources: dict[str, tuple[dict[str, Any], str, int]] = {}  # hex → layer, path, size
        self._layers_loaded: set[str] = set()
        self._pool = ThreadPoolExecutor(FILL_WORKERS, thread_name_prefix="fill")
        # fills nobody waits for yet (windows, predictions), apart: an open never queues
        # behind them; and the predictions' own thread (CPU: one at a time)
        self._ahead_pool = ThreadPoolExecutor(AHEAD_WORKERS, thread_name_prefix="ahead")
        self._hint_pool = ThreadPoolExecutor(1, thread_name_prefix="hints")
        self.hints = Hints(self._view)
        self._records: dict[str, dict[str, Any]] = {}
        self._index_urls: dict[str, str] = {}   # layer hex -> a presigned GET of its index
        self.fills = self.failures = self.ahead = self.predicted = self.own_events = 0
        self.wdata = self.objects.data   # where fills write (``writer_mount``)
        self._orders: dict[str, LayerOrder] = {}
        # each layer's TOC decoded once (``tree_of``): its blob order and its predictions'
        # lookups both come from this tree
        self._trees: dict[str, dict[str, Any]] = {}
        self._tree_lock = threading.Lock()
        self._ranges: dict[str, str] = {}   # layer digest → a presigned GET of its blob
        self._memory = threading.BoundedSemaphore(MEMORY_BUDGET // STREAM_ABOVE)
        self._dir: ObjectDir | None = None

    def objdir(self) -> ObjectDir:
        """The data dir and ``wdata`` opened once (``fillbatch``), on first use: after
        ``wdata`` is set."""
        with self._lock:
            if self._dir is None:
                self._dir = ObjectDir(self.objects.data, self.wdata, self.objects.tag,
                                      self.group)
            return self._dir

    def sweep(self) -> int:
        """Answer EIO to the events a dead worker read but never answered; how many."""
        return sum(fanotify.answer(self.group, fd, fanotify.deny_errno(errno.EIO))
                   for fd in range(MAX_FDS))

    def mark(self, hexd: str, dir_fd: int | None = None) -> bool:
        """Mark placeholder ``hexd`` (no-op for a complete object); True when marked."""
        if self.objects.complete(hexd):
            return False
        _mark_new(self.group, hexd, dir_fd) if dir_fd is not None else \
            _mark_new(self.group, self.objects.path(hexd))
        if self.objects.complete(hexd):  # filled meanwhile (another worker's last act)
            fanotify.mark(self.group, self.objects.path(hexd), remove=True)
            return False
        return True

    def place(self, layer_hex: str) -> int:
        """Make the placeholders of layer ``layer_hex``'s objects that the node lacks (its
        source record, ``record_layer``) and mark them, before its overlay is mounted; how
        many were made. One ``mknod`` and one ``fanotify_mark`` (by name, in the data dir)
        an object; an existing object is complete or was marked when made (by this worker
        or, for a predecessor's, when this worker started): nothing to do. Placements run
        one at a time, so no create mounts a layer over an object another is still
        marking."""
        self.load_layer(layer_hex)
        record = self.objects.layer_record(layer_hex)
        made = 0
        with self._place_lock:
            dir_fd = os.open(self.objects.data, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for hexd, (_path, size) in record["objects"].items():
                    if not is_hex64(hexd):
                        raise ValueError(f"layer {layer_hex[:16]}: bad object name {hexd!r}")
                    try:
                        os.mknod(hexd, stat.S_IFREG | 0o444, dir_fd=dir_fd)
                    except FileExistsError:
                        continue
                    made += 1
                    if not size:   # the object of an empty file is complete at once
                        os.setxattr(f"{self.objects.data}/{hexd}", FILLED_XATTR, b"1")
                    else:
                        _mark_new(self.group, hexd, dir_fd)
            finally:
                os.close(dir_fd)
        return made

    def run(self) -> None:
        """Read events for ever (the calling thread)."""
        while True:
            try:
                buf = os.read(self.group, 64 << 10)
            except InterruptedError:
                continue
            for event in fanotify.parse(buf):
                self.on_event(event)

    def on_event(self, event: fanotify.Event) -> None:
        if event.pid == self.pid:   # our own fill's write: never wait for ourselves
            self.own_events += 1
            fanotify.answer(self.group, event.fd, fanotify.FAN_ALLOW)
            os.close(event.fd)
            return
        hexd = _object_of(event.fd)
        if hexd is None:
            try:
                what = os.readlink(f"/proc/self/fd/{event.fd}")
            except OSError as e:
                what = str(e)
            log.error("event for an unknown file (fd %d, pid %d, %r): EIO", event.fd, event.pid,
                      what)
            self._finish([event.fd], ok=False)
            return
        with self._lock:
            waiting = self._waiting.get(hexd)
            if waiting is not None:   # a fill of it is running: wait for that one
                waiting.append(event.fd)
                return
            self._waiting[hexd] = [event.fd]
        self._pool.submit(self._fill_and_answer, hexd)
        self._hint_pool.submit(self._predict, hexd, None)

    def _finish(self, fds: list[int], *, ok: bool) -> None:
        answer = fanotify.FAN_ALLOW if ok else fanotify.deny_errno(errno.EIO)
        for fd in fds:
            fanotify.answer(self.group, fd, answer)
            os.close(fd)

    def _fill_and_answer(self, hexd: str) -> None:
        ok = False
        t0 = time.monotonic()
        try:
            ok = self.objects.complete(hexd) or self.fill(hexd)
        except Exception as e:  # noqa: BLE001 - every failure is the reader's EIO and a line
            self.failures += 1
            src = _safe_source(self, hexd)
            log.error("object %s (layer %s, %s): %s: readers get EIO", hexd[:16],
                      src.get("layer", "?"), src.get("path", "?"), e)
        if ok:
            try:
                fanotify.mark(self.group, self.objects.path(hexd), remove=True)
            except OSError as e:
                log.warning("object %s: removing its mark: %s", hexd[:16], e)
            log.info("object %s filled in %.3f s", hexd[:16], time.monotonic() - t0)
        with self._lock:
            fds = self._waiting.pop(hexd, [])
        self._finish(fds, ok=ok)

    def load_layer(self, layer_hex: str) -> None:
        """Learn where the objects of a layer come from (its record, once)."""
        with self._lock:
            if layer_hex in self._layers_loaded:
                return
        record = self.objects.layer_record(layer_hex)
        with self._lock:
            self._layers_loaded.add(layer_hex)
            self._records[layer_hex] = record
            for hexd, (path, size) in record["objects"].items():
                self._sources.setdefault(hexd, (record, str(path), int(size)))

    def set_ranges(self, digest: str, url: str) -> None:
        """A presigned GET of layer ``digest``'s blob, for its readers made from now on."""
        with self._lock:
            self._ranges.setdefault(digest, url)

    def source(self, hexd: str) -> tuple[dict[str, Any], str, int]:
        with self._lock:
            got = self._sources.get(hexd)
        if got is None:
            raise LookupError("no layer record names it")
        return got

    def fill(self, hexd: str) -> bool:
        """Fetch, verify and write object ``hexd``; True when it is complete. Files up to
        ``STREAM_ABOVE`` are read whole (verified in memory) and written at once; larger
        ones streamed (``LazyLayer.stream``: frames fetched in parallel, verified at the
        end) into a spool, copied in only once verified."""
        record, path, size = self.source(hexd)
        layer = self._layer(record)
        entry = layer.stat(path)
        if entry.digest != "sha256:" + hexd or entry.size != size:
            raise ValueError(f"{path} of the layer is {entry.digest}, not the object")
        if size <= WINDOW_MAX_FILE:   # with the files after it in the blob, if unfilled
            self._fill_window(layer, entry, hexd)
            return True
        if size <= STREAM_ABOVE:
            with self._memory:   # at most MEMORY_BUDGET of whole files in memory
                data = layer.read(path)   # verified by read
                write_into(self._wpath(hexd), data)
                self._after_fill(hexd, data)
        else:
            spool = self.objects.tmp("fill")
            try:
                with open(spool, "wb") as f:
                    for piece in layer.stream(path):   # raises at the end if not verified
                        f.write(piece)
                copy_into(spool, self._wpath(hexd), size)
            finally:
                os.unlink(spool)
        os.setxattr(self.objects.path(hexd), FILLED_XATTR, self.objects.tag)
        self.fills += 1
        return True

    def _fill_window(self, layer: Any, entry: Any, hexd: str) -> None:
        """Fill ``entry``, the opened file, in a ranged read of its own frames, and let its
        readers on as soon as it is written; beside it, in a second read (in a
        pool thread), the unfilled files that follow it in the blob within ``MISS_WINDOW``
        compressed bytes (``_fill_ahead``): a package's modules are then filled without an
        open each waiting for its own read, and the opened file waits for none of them.
        Only after the open of a Python file or a script (``fillwindow.window_before``,
        ``window_after``): after any other file the window is mostly never read."""
        code = fillwindow.window_before(entry.path)
        if code:
            self._window_soon(layer, entry.path)
        data = layer._load([entry])[entry.path]
        self.objdir().write(hexd, data)
        self._complete([hexd])   # the reader that opened it goes on now
        if not code and fillwindow.window_after(data):   # a script: known by its bytes
            self._window_soon(layer, entry.path)
        self._after_fill(hexd, data)

    def _window_soon(self, layer: Any, path: str) -> None:
        """The window after ``path`` (``_window``), at once when the layer's blob order is
        made, else in a pool thread: an opened file never waits for a TOC's decode."""
        with self._lock:
            order = self._orders.get(layer.digest)
        if order is not None:
            self._window(layer, path, order)
        else:
            self._ahead_pool.submit(self._window, layer, path)

    # -- fills ahead of opens ---------------------------------------------------------------

    def _window(self, layer: Any, path: str, order: LayerOrder | None = None) -> None:
        """Claim the unfilled files after ``path`` in ``layer``'s blob (``LayerOrder``) and
        fill them in a pool thread (``_fill_ahead``)."""
        claimed = self._claim((order or self._order(layer)).after(path))
        if claimed:
            self._ahead_pool.submit(self._fill_ahead, layer, claimed)

    def _after_fill(self, hexd: str, data: bytes) -> None:
        """An object is filled: an ELF file's libraries are the next opens."""
        if data.startswith(b"\x7fELF"):
            self._hint_pool.submit(self._predict, hexd, data)

    def _predict(self, hexd: str, data: bytes | None) -> None:
        """Fill ahead what the open of ``hexd`` predicts (``fillhints``; ``data``: its bytes,
        for an ELF file's libraries)."""
        try:
            record, path, _ = self.source(hexd)
            layer_hex = str(record["layer"]).removeprefix("sha256:")
            hexes = self.hints.on_elf(layer_hex, data, path) if data is not None \
                else self.hints.on_open(layer_hex, path)
            self._fill_predicted(hexes)
        except Exception as e:  # noqa: BLE001 - a hint: the opens fill what it missed
            log.warning("predicting after %s: %s", hexd[:16], e)

    def add_stack(self, layers: list[str]) -> None:
        """A sandbox's layers, top first, just before it starts: predictions resolve in
        them from now on; the files its start reads are filled ahead, and each layer's
        reader and blob order are made now, off the path of its first open."""
        self.hints.add_stack(layers)
        if layers:
            self._hint_pool.submit(self._start, layers)

    def _start(self, layers: list[str]) -> None:
        try:
            self._fill_predicted(self.hints.on_start(layers[0]))
            for h in layers:
                with self._lock:
                    record = self._records.get(h)
                if record is not None:
                    self._order(self._layer(record))
        except Exception as e:  # noqa: BLE001 - a hint: the opens do it otherwise
            log.warning("preparing the start of a stack: %s", e)

    def fill_soon(self, hexes: list[str]) -> None:
        """Fill the objects ``hexes`` ahead of any open (``_fill_predicted``), in a pool
        thread."""
        def run() -> None:
            try:
                self._fill_predicted([h for h in hexes if is_hex64(h)])
            except Exception as e:  # noqa: BLE001 - a hint: the opens fill them otherwise
                log.warning("filling %d objects ahead: %s", len(hexes), e)
        if hexes:
            self._ahead_pool.submit(run)

    def _fill_predicted(self, hexes: list[str]) -> None:
        """Claim the unfilled ones of ``hexes`` and fill them in batches (``AHEAD_FILES``
        files, ``AHEAD_BYTES`` bytes), ``AHEAD_WORKERS`` reads in flight."""
        groups: dict[str, tuple[Any, list[FileRef]]] = {}
        for h in hexes:
            try:
                record, path, size = self.source(h)
            except LookupError:
                continue
            if 0 < size <= STREAM_ABOVE:
                layer = self._layer(record)
                groups.setdefault(layer.digest, (layer, []))[1].append(FileRef(path, h, size))
        for layer, refs in groups.values():
            claimed = self._claim(refs)
            self.predicted += len(claimed)
            batch: list[Any] = []
            size = 0
            for entry in claimed:
                if batch and (len(batch) >= AHEAD_FILES or size + entry.size > AHEAD_BYTES):
                    self._ahead_pool.submit(self._fill_ahead, layer, batch)
                    batch, size = [], 0
                batch.append(entry)
                size += entry.size
            if batch:
                self._ahead_pool.submit(self._fill_ahead, layer, batch)

    def _view(self, layer_hex: str) -> LayerView | None:
        """Layer ``layer_hex`` for the predictors: its tree and its import index."""
        with self._lock:
            record = self._records.get(layer_hex)
        if record is None:
            return None
        return LayerView(layer_hex, self._tree(self._layer(record)),
                         self._index(layer_hex, record))

    def _index(self, layer_hex: str, record: dict[str, Any]) -> Any:
        """The layer's import index (``pyindex``): over the presigned URL its create sent,
        else from its store when that is a directory (boto3 never loads here); None."""
        from runtime_shim.lazyfs import pyindex

        digest = str(record["layer"])
        url = self._index_urls.get(layer_hex)
        if url:
            from envbuild.store.lazy import _range_client

            resp = _range_client(4, 30.0).get(url, 0, pyindex.MAX_RECORD)
            return pyindex.read_index_bytes(resp.body, digest) if resp.ok else None
        if str(record["store"]).startswith("s3://"):
            return None
        return pyindex.read_local_index(str(record["store"]), digest)   # bounded

    def set_index_url(self, layer_hex: str, url: str) -> None:
        with self._lock:
            self._index_urls.setdefault(layer_hex, url)

    def _fill_ahead(self, layer: Any, claimed: list[FileRef]) -> None:
        """Fill the ``claimed`` files of ``layer`` (``_claim``) in one ``_load`` (each file
        verified against its TOC digest), written, then marked complete (unsynced:
        ``objects.boot_tag``). A file that cannot be had this way
        (a fault anywhere in the batch) is left to its own open."""
        try:
            entries = [layer.stat(r.path) for r in claimed]   # a TOC row each, decoded now
            if any(e.digest != "sha256:" + r.hexd for e, r in zip(entries, claimed)):
                raise ValueError("a file of the layer is not the object claimed for it")
            got = layer._load(entries)
            done = [r for r in claimed if r.path in got]
            odir = self.objdir()
            for r in done:
                odir.write(r.hexd, got[r.path])
            self._complete([r.hexd for r in done])
            self.ahead += len(done)
            for r in done:
                self._after_fill(r.hexd, got[r.path])   # an extension module's libraries
        except Exception as err:  # noqa: BLE001 - a hint: their own opens fill them (or fail)
            log.warning("filling ahead in %s: %s", layer.digest[:19], err)
        finally:   # whatever was claimed and not filled goes back to its own opens
            self._release([r.hexd for r in claimed])

    def _wpath(self, hexd: str) -> str:
        """Where a fill writes object ``hexd`` (through ``writer_mount``: no events)."""
        self.objects.path(hexd)   # checks the name
        return os.path.join(self.wdata, hexd)

    def _release(self, hexes: list[str]) -> None:
        """Drop claims; opens that waited for one get a fill of their own."""
        again = []
        with self._lock:
            waiting = self._waiting
            for hexd in hexes:
                fds = waiting.get(hexd)
                if fds is None:
                    continue   # completed (``_complete`` popped it)
                if fds:
                    again.append(hexd)
                else:
                    del waiting[hexd]
        for hexd in again:
            self._pool.submit(self._fill_and_answer, hexd)

    def _complete(self, hexes: list[str]) -> None:
        """Objects ``hexes`` are written with their fill state (``ObjectDir.write``):
        unmark them, let their readers on."""
        self.objdir().unmark(hexes)
        self.fills += len(hexes)
        fds: list[int] = []
        with self._lock:
            for hexd in hexes:
                fds += self._waiting.pop(hexd, ())
        self._finish(fds, ok=True)

    def _claim(self, refs: list[FileRef]) -> list[FileRef]:
        """Those of ``refs`` whose objects are placeholders no fill has claimed yet, now
        claimed (single-flight: opens of them wait for this fill); one ``getxattr`` an
        object (``ObjectDir.unfilled``), one lock a batch."""
        if not refs:
            return []
        fresh = self.objdir().unfilled([r.hexd for r in refs])
        out = []
        with self._lock:
            waiting = self._waiting
            for r in refs:
                if r.hexd in fresh and r.hexd not in waiting:
                    waiting[r.hexd] = []
                    out.append(r)
        return out

    def _order(self, layer: Any) -> LayerOrder:
        with self._lock:
            got = self._orders.get(layer.digest)
        if got is None:
            got = LayerOrder(self._tree(layer).values(), layer.reader.toc.frames)
            with self._lock:
                got = self._orders.setdefault(layer.digest, got)
        return got

    def _tree(self, layer: Any) -> dict[str, Any]:
        """Layer ``layer``'s tree (``tree_of``), its TOC decoded once, one decode at a time."""
        from runtime_shim.lazyfs.tree import tree_of

        with self._tree_lock:
            got = self._trees.get(layer.digest)
            if got is None:
                got = self._trees[layer.digest] = tree_of(layer.reader)
        return got

    def _layer(self, record: dict[str, Any]) -> Any:
        """The ``LazyLayer`` of a layer record (one per layer, keeping no pieces): over the
        presigned URL a create handed over (plain HTTP: no boto3 here), the store opened by
        its URL when there is none or it expired."""
        url, endpoint = str(record["store"]), record.get("s3_endpoint")
        digest = str(record["layer"])
        key = f"{url}\0{endpoint}\0{digest}"
        with self._lock:
            got = self._readers.get(key)
            ranges = self._ranges.get(digest)
        if got is None:
            from envbuild.store import open_store
            from envbuild.store._lazy_cache import MemoryChunkCache
            from envbuild.store.lazy import HttpRanges, LazyLayer

            def full() -> Any:
                return open_store(url, s3_endpoint=endpoint, create=False)
            source = HttpRanges(digest, ranges, full) if ranges else full()
            # the TOC the create fetched (``record_layer``): no read of it over the link
            tail = self.objects.layer_tail(digest[7:], int(record.get("tail") or 0))
            got = LazyLayer(source, digest, chunk_cache=MemoryChunkCache(0),
                            size=int(record.get("size") or 0) or None, tail=tail,
                            expected_toc_digest=record.get("toc_digest") or None)
            with self._lock:
                got = self._readers.setdefault(key, got)
        return got


def writer_mount(objects: ObjectStore, group: int) -> str:
    """The worker's own view of the object store, where its fills write: a bind mount of
    ``objects/data`` in a mount namespace of its own (gone with it), covered by an ignore
    mark, so a fill's writes raise no pre-content event (each was a round trip through the
    reading thread, the write blocked until it was answered); readers' opens, through the
    layers' overlays, still raise theirs. Called first thing (``unshare`` wants a process
    of one thread); where it cannot be made, the data dir itself (the reading thread then
    allows our own events by pid)."""
    from envbuild.libc import function
    from runtime_shim.isolation.mount import raw_mount

    clone_newns, ms_rec, ms_private, ms_bind = 0x00020000, 0x4000, 1 << 18, 4096
    target = os.path.join(objects.root, "tmp", "w")
    try:
        if function("unshare", argtypes=[ctypes.c_int])(clone_newns) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
        if raw_mount(None, b"/", None, ms_rec | ms_private, None) != 0:
            raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
        _detach_all_but(os.path.realpath(objects.data))
        os.makedirs(target, mode=0o700, exist_ok=True)
        if raw_mount(objects.data.encode(), target.encode(), None, ms_bind, None) != 0:
            raise OSError(ctypes.get_errno(), f"bind mount at {target}")
        fanotify.ignore_mount(group, target)
    except OSError as e:
        log.warning("filler worker: no private write mount (%s): its writes raise events", e)
        return objects.data
    return target


def _detach_all_but(path: str) -> None:
    """Detach, in this (new, private) mount namespace, every mount but ``/proc``, ``/dev``
    and those ``path`` lies under: the namespace's copies of the node's other mounts (sandboxes' disks on loop
    devices, other layers) would otherwise stay alive as long as the worker."""
    from runtime_shim.isolation.mount import raw_umount2

    mnt_detach = 2
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4:
                points.append(fields[4].encode("utf-8", "surrogateescape")
                              .decode("unicode_escape"))
    keep = {p for p in points if p in ("/", "/proc", "/dev") or path == p
            or path.startswith(p.rstrip("/") + "/")}
    for p in sorted(set(points) - keep, key=len, reverse=True):
        raw_umount2(os.fsencode(p), mnt_detach)   # gone already with its parent: no matter


def _mark_new(group: int, name: str, dir_fd: int | None = None) -> None:
    """Mark the placeholder ``name`` (relative to ``dir_fd`` if given)."""
    try:
        if dir_fd is None:
            fanotify.mark(group, name)
        else:
            fanotify.mark(group, name, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise OSError(e.errno, f"the node's unfilled objects are at the fanotify mark "
                               f"limit ({MARKS_SYSCTL})") from None


def _object_of(fd: int) -> str | None:
    """The object an event's fd is (its name: only objects are marked), None when it is
    not one (no mark of ours is on anything else)."""
    try:
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return None
    return name if is_hex64(name) else None


def _safe_source(worker: Worker, hexd: str) -> dict[str, Any]:
    try:
        record, path, _ = worker.source(hexd)
        return {"layer": record.get("layer"), "path": path}
    except LookupError:
        return {}


__all__ = ["FILL_WORKERS", "MAX_FDS", "MARKS_SYSCTL", "Worker"]
