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
they end at once (EOF, SIGBUS, ENOEXEC) rather than read as zeros — docs/lazy-loading.md says
what would close that last gap (a pinned BPF LSM program).

**The worker**, on start: answers every permission event a dead predecessor read but did not
answer with EIO (the kernel keeps them queued on the group; they are matched by fd number,
and a worker's fds are below ``MAX_FDS``), then marks every placeholder (a restart resumes),
then serves. Per event: its own writes' events (pid = its own) are allowed at once by the
reading thread; any other is a fill of the whole object (single-flight per object) in a pool
thread: fetch the file from its layer (``LazyLayer``: ranged reads of its frames, verified
against the TOC digest, which is the object's name), write it into the placeholder (a large
file through a spool, copied in only once verified), set the fill state (this boot's tag,
unsynced: ``objects.boot_tag``), remove the mark, answer ``FAN_ALLOW``. The mark takes opens
too (``fanotify.FILL_EVENTS``): a file is filled when it is opened, so an ``mmap`` through
overlayfs (which raises no pre-content event of the lower file: checked on 6.18) finds it
complete. A fill that fails (store down, corrupt blob) answers EIO and logs one line; the
mark stays, so the next open tries again.

**Only root talks to the filler**: its socket is ``<node>/objects/filler.sock`` in a 0700
root-owned dir, and it answers only peers whose ``SO_PEERCRED`` uid is 0. Requests are one
JSON line each: ``{"op": "ping"}``, ``{"op": "place", "layer": hex, "ranges_url": URL,
"fill": [hex, ...]}`` (read the layer's source record, make and mark the placeholders of its
objects the node lacks: before a create mounts the layer; then fill the objects ``fill``
names, the files a sandbox's start reads), ``{"op": "stack", "layers": [hex, ...]}`` (a
sandbox's layers, top first, for predictions), ``{"op": "evict", "layers": [hex, ...],
"max_bytes": N}`` (``node gc``: forget those layers, which the client holds locked, drop
their records, unlink the objects no other record names; with ``max_bytes``, empty idle
complete objects back into marked placeholders: ``objgc``).
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from runtime_shim.lazyfs import fanotify
from runtime_shim.lazyfs.fillworker import MARKS_SYSCTL, MAX_FDS, Worker, writer_mount
from runtime_shim.lazyfs.objects import ObjectStore

log = logging.getLogger("envbuild.lazyfs.filler")

SOCKET = "filler.sock"
LOCK = "filler.lock"
LOG = "filler.log"
#: Root's fanotify marks the holder raises ``MARKS_SYSCTL`` to, if lower: unfilled objects
#: of four hostile layers (262,144 members each).
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


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of the connected Unix socket ``sock``."""
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


def serve_socket(listener: socket.socket, handle: Callable[[dict[str, Any]], dict[str, Any]]
                 ) -> None:
    """Answer root's requests on ``listener``, one connection at a time per thread."""
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
    wdata = writer_mount(ObjectStore(node_root), group)   # before any thread starts
    w = Worker(node_root, group)
    w.wdata = wdata
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
    gc.freeze()   # the layer records (a tuple an object) never die: no collection scans them
    log.info("filler worker %d: %d stale events answered EIO, %d placeholders marked",
             os.getpid(), swept, marked)

    listener = socket.socket(fileno=sock_fd)
    threading.Thread(target=serve_socket, args=(listener, lambda req: _handle(w, req)),
                     daemon=True).start()
    w.run()
    return 0


def _handle(w: Worker, req: dict[str, Any]) -> dict[str, Any]:
    """One request to the worker (module docstring)."""
    if req.get("op") == "ping":
        return {"ok": True, "pid": os.getpid(), "holder": os.getppid(), "fills": w.fills,
                "ahead": w.ahead, "predicted": w.predicted, "failures": w.failures,
                "own_events": w.own_events,
                "boto3": "boto3" in sys.modules}
    if req.get("op") == "place":
        layer = str(req.get("layer"))
        if req.get("ranges_url"):
            w.set_ranges("sha256:" + layer, str(req["ranges_url"]))
        if req.get("index_url"):
            w.set_index_url(layer, str(req["index_url"]))
        placed = w.place(layer)
        gc.freeze()
        # what every sandbox's start reads of it (``fillhints.START_FILES``), filled now:
        # the layer's first create does not wait for them
        w.fill_soon([str(h) for h in req.get("fill") or ()][:16])
        return {"ok": True, "placed": placed}
    if req.get("op") == "evict":   # ``node gc``: ``objgc`` (its request and its races)
        from runtime_shim.lazyfs.objgc import serve_evict

        return serve_evict(w, req)
    if req.get("op") == "stack":   # a sandbox's layers, top first: predictions' stack
        w.add_stack([str(h) for h in req.get("layers", ())][:1024])
        return {"ok": True}
    return {"ok": False, "error": f"unknown op {req.get('op')!r}"}


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
