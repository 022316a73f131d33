"""The native filler: fills the node's object placeholders (``objects``) on first access,
answering fanotify pre-content events (``fanotify``); no FUSE, nothing on the read path once
an object is complete.

Two processes, so that a killed filler never lets a reader see a hole::

    python -m runtime_shim.lazyfs.filler --node ROOT           the holder
        └─ python -m runtime_shim.lazyfs.filler --worker ...   the worker (respawned)

**The holder** creates the fanotify group and the control socket, holds both for its life,
and runs the worker with them (``pass_fds``); when the worker dies (SIGKILL, OOM, a bug) it
starts a new one. Marks belong to the group and the group lives while any process holds its
fd: with the holder alive, a dead worker's marks stay, readers of unfilled ranges wait in
the kernel (never read zeros), and the new worker resumes. The holder does nothing else (no
store, no parsing): it is the part that must not fail. With the worker alive, the holder's
death is harmless too (the worker holds the group); only both dying at once releases the
group: unfilled objects are then read unchecked, and being empty placeholders (``objects``)
they end at once (EOF, SIGBUS, ENOEXEC) rather than read as zeros — docs/native-lazy.md says
what would close that last gap (a pinned BPF LSM program).

**The worker**, on start: answers every permission event a dead predecessor read but did not
answer with EIO (the kernel keeps them queued on the group; they are matched by fd number,
and a worker's fds are below ``MAX_FDS``), then marks every placeholder (a restart resumes),
then serves. Per event: its own writes' events (pid = its own) are allowed at once by the
reading thread; any other is a fill of the whole object (single-flight per object) in a
pool thread: fetch the file from its layer (``LazyLayer``: ranged reads of its frames,
verified against the TOC digest, which is the object's name), write it into the placeholder
(a large file through a spool, copied in only once verified), fsync, set the fill state,
remove the mark, answer ``FAN_ALLOW``. The mark takes opens too (``fanotify.FILL_EVENTS``): a
file is filled when it is opened, so an ``mmap`` through overlayfs (which raises no
pre-content event of the lower file: checked on 6.18) finds it complete. A fill that fails
(store down, corrupt blob) answers EIO and logs one line; the mark stays, so the next open
tries again.

**Only root talks to the filler**: its socket is ``<node>/objects/filler.sock`` in a 0700
root-owned dir, and it answers only peers whose ``SO_PEERCRED`` uid is 0. Requests are one
JSON line each: ``{"op": "ping"}``, ``{"op": "mark", "layer": hex, "objects": [hex, ...]}``
(read the layer's source record, mark these placeholders: before a create mounts them).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from runtime_shim.lazyfs import fanotify
from runtime_shim.lazyfs.fillwindow import WINDOW_MAX_FILE, LayerOrder
from runtime_shim.lazyfs.objects import FILLED_XATTR, ObjectStore

log = logging.getLogger("envbuild.lazyfs.filler")

SOCKET = "filler.sock"
LOCK = "filler.lock"
LOG = "filler.log"
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
WRITE_PIECE = 1 << 20
#: The node-wide cap of root's fanotify marks the holder raises to, if lower: unfilled
#: objects of four hostile layers (262,144 members each).
MARKS_SYSCTL = "/proc/sys/fs/fanotify/max_user_marks"
MIN_MARKS = 1 << 20
#: Largest request line.
MAX_REQUEST = 1 << 20


# -- the holder -------------------------------------------------------------------------


def hold(node_root: str) -> int:
    """The holder's life: the group, the socket, a worker respawned until SIGTERM (ignored
    while native layers are mounted: ``node gc`` unmounts them first); never the OOM
    killer's choice."""
    objects = ObjectStore(node_root)
    objects.make_dirs()
    lock_fd = os.open(os.path.join(objects.root, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                      0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another holder serves this node
    try:   # the OOM killer takes anything but the holder (its death ends the group's life)
        with open("/proc/self/oom_score_adj", "w", encoding="ascii") as f:
            f.write("-1000")
    except OSError as e:
        log.warning("holder: oom_score_adj: %s", e)
    _raise_mark_limit()
    group = fanotify.open_group()
    sock_path = os.path.join(objects.root, SOCKET)
    if os.path.lexists(sock_path):
        os.unlink(sock_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    os.chmod(sock_path, 0o600)
    listener.listen(64)
    stopping = threading.Event()
    worker: list[subprocess.Popen[bytes]] = []

    def stop(sig: int, _frame: Any) -> None:
        from runtime_shim.isolation.mount import mounted_targets_under

        mounted = mounted_targets_under(os.path.join(node_root, "native"))
        if mounted:   # their unfilled objects would be read unchecked: `node gc` stops us
            log.warning("holder: signal %d ignored: %d native layers are mounted", sig,
                        len(mounted))
            return
        stopping.set()
        if worker:
            worker[0].terminate()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    pause = 0.2
    while not stopping.is_set():
        started = time.monotonic()
        worker[:] = [subprocess.Popen(
            [sys.executable, "-m", "runtime_shim.lazyfs.filler", "--worker", "--node",
             node_root, "--group-fd", str(group), "--socket-fd", str(listener.fileno())],
            pass_fds=(group, listener.fileno()))]
        code = worker[0].wait()
        if not stopping.is_set():   # a worker that keeps dying at once: back off to 5 s
            pause = 0.2 if time.monotonic() - started > 10 else min(5.0, pause * 2)
            log.warning("filler worker exited (%s); starting another in %.1f s", code, pause)
            time.sleep(pause)
    os.unlink(sock_path)
    return 0


def _raise_mark_limit(path: str = MARKS_SYSCTL) -> None:
    """Every unfilled object holds one fanotify mark, and a user's marks are capped
    node-wide (``fs.fanotify.max_user_marks``: 205,049 on this 24 GiB host, for all of
    root's fanotify users): raise it to ``MIN_MARKS`` if lower (a mark pins its inode, about
    1 KiB of kernel memory). Where it cannot be raised, creates past it fail in one line."""
    try:
        with open(path, encoding="ascii") as f:
            now = int(f.read())
        if now < MIN_MARKS:
            with open(path, "w", encoding="ascii") as f:
                f.write(str(MIN_MARKS))
            log.info("holder: %s raised from %d to %d", path, now, MIN_MARKS)
    except (OSError, ValueError) as e:
        log.warning("holder: %s: %s", path, e)


# -- the worker -------------------------------------------------------------------------


class Worker:
    """Marks placeholders, answers events, fills objects (one fill per object at a time)."""

    def __init__(self, node_root: str, group: int) -> None:
        self.objects = ObjectStore(node_root)
        self.group = group
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._by_ino: dict[tuple[int, int], str] = {}
        self._waiting: dict[str, list[int]] = {}   # object → event fds waiting for its fill
        self._readers: dict[str, Any] = {}
        self._sources: dict[str, tuple[dict[str, Any], str, int]] = {}  # hex → layer, path, size
        self._layers_loaded: set[str] = set()
        self._pool = ThreadPoolExecutor(FILL_WORKERS, thread_name_prefix="fill")
        self.fills = self.failures = self.ahead = 0
        self._orders: dict[str, LayerOrder] = {}
        self._ranges: dict[str, str] = {}   # layer digest → a presigned GET of its blob
        self._memory = threading.BoundedSemaphore(MEMORY_BUDGET // STREAM_ABOVE)

    def sweep(self) -> int:
        """Answer EIO to the events a dead worker read but never answered; how many."""
        return sum(fanotify.answer(self.group, fd, fanotify.deny_errno(errno.EIO))
                   for fd in range(MAX_FDS))

    def mark(self, hexd: str) -> bool:
        """Mark placeholder ``hexd`` (no-op for a complete object); True when marked."""
        path = self.objects.path(hexd)
        st = os.stat(path)
        if self.objects.complete(hexd):
            return False
        with self._lock:
            self._by_ino[(st.st_dev, st.st_ino)] = hexd
        try:
            fanotify.mark(self.group, path)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise OSError(e.errno, f"the node's unfilled objects are at the fanotify mark "
                                   f"limit ({MARKS_SYSCTL})") from None
        if self.objects.complete(hexd):  # filled meanwhile (another worker's last act)
            fanotify.mark(self.group, path, remove=True)
            return False
        return True

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
            fanotify.answer(self.group, event.fd, fanotify.FAN_ALLOW)
            os.close(event.fd)
            return
        try:
            st = os.fstat(event.fd)
            with self._lock:
                hexd = self._by_ino.get((st.st_dev, st.st_ino))
        except OSError:
            hexd = None
        if hexd is None:
            log.error("event for an unknown file (fd %d, pid %d): EIO", event.fd, event.pid)
            self._finish([event.fd], ok=False)
            return
        with self._lock:
            waiting = self._waiting.get(hexd)
            if waiting is not None:   # a fill of it is running: wait for that one
                waiting.append(event.fd)
                return
            self._waiting[hexd] = [event.fd]
        self._pool.submit(self._fill_and_answer, hexd)

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
                _write_into(self.objects.path(hexd), layer.read(path))   # verified by read
        else:
            spool = self.objects.tmp("fill")
            try:
                with open(spool, "wb") as f:
                    for piece in layer.stream(path):   # raises at the end if not verified
                        f.write(piece)
                _copy_into(spool, self.objects.path(hexd), size)
            finally:
                os.unlink(spool)
        os.setxattr(self.objects.path(hexd), FILLED_XATTR, b"1")
        self.fills += 1
        return True

    def _fill_window(self, layer: Any, entry: Any, hexd: str) -> None:
        """Fill ``entry`` and the unfilled files that follow it in the blob within
        ``MISS_WINDOW`` compressed bytes, in one ranged read (``LazyLayer._load``: each file
        verified against its TOC digest): a package's modules, a library's neighbours are
        then filled without an open each waiting for its own read. The opened file is
        answered first; the neighbours are written, synced in one ``syncfs`` (an fsync each
        was 0.4 ms a file here), then marked complete. A neighbour that cannot be had this
        way is left to its own open."""
        claimed = self._claim(self._order(layer).after(entry.path))
        got: dict[str, bytes] = {}
        try:
            try:
                got = layer._load([entry] + claimed)
            except Exception:   # noqa: BLE001 - a neighbour's fault must not fail this open
                if not claimed:
                    raise
                got = {entry.path: layer.read(entry.path)}
            _write_into(self.objects.path(hexd), got[entry.path])
            self._complete(hexd)   # the reader that opened it goes on now
            done = [e for e in claimed if e.path in got]
            for e in done:
                _write_into(self.objects.path(_hex(e)), got[e.path], sync=False)
            if done:
                _syncfs(self.objects.data)
            for e in done:
                self._complete(_hex(e))
                self.ahead += 1
        finally:   # whatever was claimed and not filled goes back to its own opens
            for e in claimed:
                self._release(_hex(e))

    def _release(self, hexd: str) -> None:
        """Drop a claim; opens that waited for it get a fill of their own."""
        with self._lock:
            fds = self._waiting.get(hexd)
            if fds is None:
                return   # completed (``_complete`` popped it)
            if not fds:
                del self._waiting[hexd]
                return
        self._pool.submit(self._fill_and_answer, hexd)

    def _complete(self, hexd: str) -> None:
        """Object ``hexd`` is written and synced: record it, unmark it, let its readers on."""
        os.setxattr(self.objects.path(hexd), FILLED_XATTR, b"1")
        fanotify.mark(self.group, self.objects.path(hexd), remove=True)
        self.fills += 1
        with self._lock:
            fds = self._waiting.pop(hexd, [])
        self._finish(fds, ok=True)

    def _claim(self, entries: list[Any]) -> list[Any]:
        """Those of ``entries`` whose objects are placeholders no fill has claimed yet, now
        claimed (single-flight: opens of them wait for this fill)."""
        out = []
        for e in entries:
            other = _hex(e)
            if not os.path.exists(self.objects.path(other)) or self.objects.complete(other):
                continue
            with self._lock:
                if other in self._waiting:
                    continue
                self._waiting[other] = []
            out.append(e)
        return out

    def _order(self, layer: Any) -> LayerOrder:
        with self._lock:
            got = self._orders.get(layer.digest)
        if got is None:
            got = LayerOrder(layer.entries())
            with self._lock:
                got = self._orders.setdefault(layer.digest, got)
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
            got = LazyLayer(source, digest, chunk_cache=MemoryChunkCache(0),
                            size=int(record.get("size") or 0) or None)
            with self._lock:
                got = self._readers.setdefault(key, got)
        return got


def _safe_source(worker: Worker, hexd: str) -> dict[str, Any]:
    try:
        record, path, _ = worker.source(hexd)
        return {"layer": record.get("layer"), "path": path}
    except LookupError:
        return {}


def _hex(entry: Any) -> str:
    return str(entry.digest).removeprefix("sha256:")


def _syncfs(path: str) -> None:
    """``syncfs(2)`` of the filesystem holding ``path``."""
    from envbuild.libc import function

    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if function("syncfs", argtypes=[ctypes.c_int])(fd) != 0:
            raise OSError(ctypes.get_errno(), f"syncfs {path}")
    finally:
        os.close(fd)


def _write_into(target: str, data: bytes, *, sync: bool = True) -> None:
    """Write verified ``data`` into the placeholder through our own fd (see ``_copy_into``);
    ``sync``: fsync it (else the caller syncs)."""
    fd = os.open(target, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
    try:
        view = memoryview(data)
        for off in range(0, len(view), WRITE_PIECE):  # one 64 MiB write took 0.97 s, 64
            os.pwrite(fd, view[off:off + WRITE_PIECE], off)   # writes of 1 MiB 0.06 s
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _copy_into(spool: str, target: str, size: int) -> None:
    """Copy the verified spool into the placeholder through our own fd (its events carry our
    pid: the reading thread allows them), then fsync: the fill state follows the bytes."""
    src = os.open(spool, os.O_RDONLY | os.O_CLOEXEC)
    dst = os.open(target, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)   # a killed fill's rest
    try:
        done = 0
        while done < size:
            n = os.copy_file_range(src, dst, size - done, done, done)
            if n <= 0:
                raise OSError(errno.EIO, f"copy into {target} stopped at {done} of {size}")
            done += n
        os.fsync(dst)
    finally:
        os.close(src)
        os.close(dst)


def serve_socket(listener: socket.socket, handle: Callable[[dict[str, Any]], dict[str, Any]]
                 ) -> None:
    """Answer root's requests on ``listener``, one connection at a time per thread."""
    from runtime_shim.lazyfs.control import peer_uid

    while True:
        conn, _ = listener.accept()
        if peer_uid(conn) != 0:
            conn.close()
            continue
        threading.Thread(target=_one_conn, args=(conn, handle), daemon=True).start()


def _one_conn(conn: socket.socket, handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    with conn:
        buf = b""
        while not buf.endswith(b"\n") and len(buf) < MAX_REQUEST:
            got = conn.recv(65536)
            if not got:
                return
            buf += got
        try:
            reply = handle(json.loads(buf))
        except Exception as e:  # noqa: BLE001 - the client gets the reason
            reply = {"ok": False, "error": str(e)}
        conn.sendall(json.dumps(reply).encode() + b"\n")


def work(node_root: str, group: int, sock_fd: int) -> int:
    """The worker's life (see the module docstring)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = MAX_FDS if hard == resource.RLIM_INFINITY else min(MAX_FDS, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    w = Worker(node_root, group)
    swept = w.sweep()
    for name in os.listdir(w.objects.root + "/tmp"):
        if name.startswith("fill-"):
            os.unlink(os.path.join(w.objects.root, "tmp", name))
    for layer_hex in w.objects.layer_records():
        try:
            w.load_layer(layer_hex)
        except (OSError, ValueError) as e:
            log.error("layer record %s: %s (its objects cannot be filled)", layer_hex[:16], e)
    marked = sum(w.mark(h) for h in w.objects.incomplete())
    log.info("filler worker %d: %d stale events answered EIO, %d placeholders marked",
             os.getpid(), swept, marked)

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") == "ping":
            return {"ok": True, "pid": os.getpid(), "holder": os.getppid(), "fills": w.fills,
                    "ahead": w.ahead, "failures": w.failures,
                    "boto3": "boto3" in sys.modules}
        if req.get("op") == "mark":
            if req.get("layer"):
                w.load_layer(str(req["layer"]))
                if req.get("ranges_url"):
                    w.set_ranges("sha256:" + str(req["layer"]), str(req["ranges_url"]))
            return {"ok": True, "marked": sum(w.mark(str(h)) for h in req.get("objects", ()))}
        return {"ok": False, "error": f"unknown op {req.get('op')!r}"}
    listener = socket.socket(fileno=sock_fd)
    threading.Thread(target=serve_socket, args=(listener, handle), daemon=True).start()
    w.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m runtime_shim.lazyfs.filler")
    p.add_argument("--node", required=True)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--group-fd", type=int)
    p.add_argument("--socket-fd", type=int)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s filler[%(process)d] %(levelname)s %(message)s")
    if args.worker:
        return work(os.path.abspath(args.node), args.group_fd, args.socket_fd)
    return hold(os.path.abspath(args.node))


if __name__ == "__main__":
    sys.exit(main())
