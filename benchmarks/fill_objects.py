#!/usr/bin/env python3
"""The native filler's per-object CPU alone (issue 36): claim, write, fill state, unmark and
release of a batch of small objects, as a window or a prediction fills them, without the
store read, the decompression or the verification (``_load``) that precede them.

    sudo .venv/bin/python benchmarks/fill_objects.py [--objects 400] [--rounds 10] [--size 2048]

Two ways in one process, alternated round by round on fresh placeholders (made with
``mknod`` and marked for ``FILL_EVENTS`` in a real fanotify group, as ``Worker.place`` does;
the writes go through the worker's own write mount, ``writer_mount``, as in the filler):

- ``per-object``: the calls the worker made per object before ``fillbatch`` (an ``exists``
  and a ``complete`` by full path and a lock per claim; a write by path; the fill state by
  path; the unmark by path; a lock per completion and per release);
- ``batched``: ``Worker._claim`` / ``ObjectDir.write`` / ``Worker._complete`` /
  ``Worker._release``, as the worker runs them now.

Prints per round and the median of each: CPU (process time) and wall microseconds per
object, and the load average. Root and a kernel with pre-content events (>= 6.14) needed.
This process takes a private mount namespace of its own (``writer_mount``)."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import statistics
import tempfile
import time

from runtime_shim.lazyfs import fanotify
from runtime_shim.lazyfs.fillwindow import FileRef
from runtime_shim.lazyfs.fillworker import Worker, writer_mount
from runtime_shim.lazyfs.objects import FILLED_XATTR, ObjectStore, write_into


def per_object(w: Worker, refs: list[FileRef], data: bytes) -> None:
    """The worker's per-object calls before ``fillbatch`` (a replica of them)."""
    objects = w.objects
    claimed = []
    for e in refs:
        h = e.hexd
        if not os.path.exists(objects.path(h)) or objects.complete(h):
            continue
        with w._lock:
            if h in w._waiting:
                continue
            w._waiting[h] = []
        claimed.append(e)
    for r in claimed:
        objects.path(r.hexd)
        write_into(os.path.join(w.wdata, r.hexd), data)
    for r in claimed:
        os.setxattr(objects.path(r.hexd), FILLED_XATTR, objects.tag)
        fanotify.mark(w.group, objects.path(r.hexd), remove=True)
        w.fills += 1
        with w._lock:
            fds = w._waiting.pop(r.hexd, [])
        w._finish(fds, ok=True)
    for r in claimed:
        with w._lock:
            fds = w._waiting.get(r.hexd)
            if fds is not None and not fds:
                del w._waiting[r.hexd]


def batched(w: Worker, refs: list[FileRef], data: bytes) -> None:
    claimed = w._claim(refs)
    odir = w.objdir()
    for r in claimed:
        odir.write(r.hexd, data)
    w._complete([r.hexd for r in claimed])
    w._release([r.hexd for r in claimed])


def place(w: Worker, n: int, round_no: int) -> list[FileRef]:
    """``n`` fresh marked placeholders (outside the timing)."""
    dir_fd = os.open(w.objects.data, os.O_RDONLY | os.O_DIRECTORY)
    refs = []
    try:
        for i in range(n):
            h = f"{round_no:08x}{i:056x}"
            os.mknod(h, stat.S_IFREG | 0o444, dir_fd=dir_fd)
            fanotify.mark(w.group, h, dir_fd=dir_fd)
            refs.append(FileRef(f"pkg/m{i}.py", h, 1))
    finally:
        os.close(dir_fd)
    return refs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="fill-objects-", dir=args.dir)
    group = fanotify.open_group()
    try:
        store = ObjectStore(root)
        store.make_dirs()
        wdata = writer_mount(store, group)   # before any thread
        if wdata == store.data:
            raise SystemExit("no private write mount: the fills' writes would wait for us")
        w = Worker(root, group)
        w.wdata = wdata
        data = os.urandom(args.size)
        got: dict[str, list[tuple[float, float]]] = {"per-object": [], "batched": []}
        ways = [("per-object", per_object), ("batched", batched)]
        for k in range(2 * args.rounds):
            name, fn = ways[k % 2] if (k // 2) % 2 == 0 else ways[1 - k % 2]
            refs = place(w, args.objects, k)
            c0, t0 = time.process_time(), time.perf_counter()
            fn(w, refs, data)
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            assert all(w.objects.complete(r.hexd) for r in refs) and not w._waiting
            got[name].append((cpu * 1e6 / len(refs), wall * 1e6 / len(refs)))
            print(f"round {k:2d} {name:10s} cpu {got[name][-1][0]:6.1f} us/object  "
                  f"wall {got[name][-1][1]:6.1f} us/object", flush=True)
        for name, rows in got.items():
            print(f"{name:10s} median cpu {statistics.median(r[0] for r in rows):6.1f} "
                  f"us/object, wall {statistics.median(r[1] for r in rows):6.1f} us/object "
                  f"({len(rows)} rounds of {args.objects} objects of {args.size} bytes)")
        with open("/proc/loadavg") as f:
            print("load:", f.read().strip())
    finally:
        os.close(group)
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
