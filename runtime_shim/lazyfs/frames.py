"""Fetching a lazy layer's frames for the filesystem: one fetch per frame at a time
(``Frames``), directory readahead (``Readahead``) and profile prefetch in order
(``prefetch_in_order``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from envbuild.errors import EnvbuildError
from envbuild.store.lazy import LazyLayer
from runtime_shim.lazyfs.tree import Node

log = logging.getLogger("envbuild.lazyfs")

#: Parallel requests of a background load (readahead, profile prefetch); reads use the layer's.
BACKGROUND_WORKERS = 2
#: Compressed bytes a read miss fetches in one ranged GET: the missed file plus the files that
#: follow it in tar order (a package's modules, a library's neighbours). About one
#: bandwidth-delay product of a busy cell's link (1 Gbit/s x 10 ms = 1.25 MB): the extra bytes
#: cost about one more round trip's time, and a program that opens the neighbours next (an
#: import, a test run, ``grep -r``) finds them without a request.
MISS_WINDOW = 1 << 20
#: Compressed bytes the background readahead fetches past a miss's window, in tar order.
READAHEAD_WINDOW = 1 << 20
#: Batches of a profile prefetch in flight at once, per layer.
PREFETCH_WORKERS = 3
#: Files larger than this end a tar-order window (they are fetched when opened).
WINDOW_MAX_FILE = 1 << 20


class _Frames:
    """Which frames of a layer are loaded (every file inside them verified and cached) or being
    fetched, so a read waits for a fetch in flight (readahead, prefetch) instead of repeating
    it. Small files share frames (lazy framing): loading a frame caches every file wholly
    inside it, which costs no extra request."""

    def __init__(self, layer: LazyLayer, nodes: dict[str, Node]) -> None:
        self.layer = layer
        self.cv = threading.Condition()
        self.loaded: set[int] = set()
        self.inflight: set[int] = set()
        self.mates: dict[int, list[str]] = {}
        for node in {id(n): n for n in nodes.values()}.values():
            if len(node.frames) == 1:
                self.mates.setdefault(node.frames[0], []).append(node.read_path)
        self.nodes = nodes
        self.profiled = False   # a recorded profile is being prefetched: no tar-order guesses
        self._order: list[Node] | None = None   # regular files in blob (tar) order, on demand
        self._pos: dict[int, int] = {}          # id(node) -> index in _order

    def _tar_order(self) -> list[Node]:
        if self._order is None:
            files = sorted({id(n): n for n in self.nodes.values()
                            if n.read_path and n.frames}.values(), key=lambda n: n.frames[0])
            self._pos = {id(n): i for i, n in enumerate(files)}
            self._order = files
        return self._order

    def following(self, node: Node, budget: int) -> list[Node]:
        """The small regular files after ``node`` in blob order (``node`` itself not
        included) within ``budget`` compressed bytes of its last frame whose frames are
        neither loaded nor being fetched. Stops at a large file."""
        order = self._tar_order()
        i = self._pos.get(id(node))
        if i is None:
            return []
        out: list[Node] = []
        end = node.frames[-1] + budget
        with self.cv:
            for j in range(i + 1, len(order)):
                n = order[j]
                if n.size > WINDOW_MAX_FILE or n.frames[-1] > end:
                    break
                if any(f not in self.loaded and f not in self.inflight for f in n.frames):
                    out.append(n)
        return out

    def missing(self, node: Node) -> bool:
        return any(f not in self.loaded for f in node.frames)

    def load(self, nodes: Sequence[Node], *, wait: bool = True,
             workers: int | None = None) -> None:
        """Load the frames of ``nodes``; ``wait=False`` (background): only those no one is
        fetching, and return at once if there are none. ``workers``: parallel requests
        (default: the layer's)."""
        while True:
            with self.cv:
                missing = {f for n in nodes for f in n.frames if f not in self.loaded}
                if not missing:
                    return
                mine = missing - self.inflight
                if not mine:
                    if not wait:
                        return
                    self.cv.wait()
                    continue
                self.inflight |= mine
            ok = False
            try:
                paths = [n.read_path for n in nodes if any(f in mine for f in n.frames)]
                paths += [p for f in sorted(mine) for p in self.mates.get(f, ())]
                self.layer.prefetch(paths, workers=workers)
                ok = True
            finally:
                with self.cv:
                    self.inflight -= mine
                    if ok:
                        self.loaded |= mine
                    self.cv.notify_all()
            if not wait:
                return



def prefetch_in_order(frames: _Frames, nodes: dict[str, Node], paths: Sequence[str], *,
                      first_batch: int = 512 << 10, max_batch: int = 2 << 20,
                      workers: int = PREFETCH_WORKERS) -> int:
    """Load the regular files among ``paths`` in their order, in batches of about
    ``max_batch`` bytes (the first ``first_batch``: what starts first arrives soonest), each
    batch one merged ranged read as far as the files are adjacent, ``workers`` batches in
    flight at once (submitted in order), skipping frames someone else is fetching (a reader
    waits for those). Small batches keep a reader that needs a file of a batch in flight
    waiting for little more than its own bytes, and decoded frames arrive as a stream; the
    few ``workers`` leave most of the node's fetch slots to reads. Marks ``frames`` as
    profiled (the tar-order readahead stops guessing). Returns the files asked for."""
    from concurrent.futures import ThreadPoolExecutor

    frames.profiled = True
    batches: list[list[Node]] = []
    batch: list[Node] = []
    size = count = 0
    limit = first_batch
    for p in paths:
        n = nodes.get(p.strip("/"))
        if n is None or not n.read_path or not frames.missing(n):
            continue
        batch.append(n)
        size += n.size
        count += 1
        if size >= limit:
            batches.append(batch)
            batch, size, limit = [], 0, max_batch
    if batch:
        batches.append(batch)
    if not batches:
        return count
    with ThreadPoolExecutor(max(1, min(workers, len(batches))),
                            thread_name_prefix="lazy-prefetch") as pool:
        for f in [pool.submit(frames.load, b, wait=False, workers=1) for b in batches]:
            f.result()
    return count


class _Readahead:
    """Directory readahead: after a file of directory D was fetched, fetch D's other small
    regular files in the background, once per directory, at most ``budget`` bytes. Tar order
    keeps a directory's files together, so this is a few merged ranged reads; it serves
    programs that open a package's files one by one (Python imports, shared libraries)."""

    def __init__(self, layer: LazyLayer, nodes: dict[str, Node], frames: _Frames, *,
                 max_file: int = 256 << 10, budget: int = 2 << 20) -> None:
        self.layer, self.nodes, self.frames = layer, nodes, frames
        self.max_file, self.budget = max_file, budget
        self.done: set[str] = set()
        self.queue: list[str] = []
        self.cv = threading.Condition()
        self.after: list[Node] = []
        threading.Thread(target=self._run, name="lazy-readahead", daemon=True).start()
        for _ in range(BACKGROUND_WORKERS):
            threading.Thread(target=self._run_after, name="lazy-readahead-tar",
                             daemon=True).start()

    def schedule_after(self, node: Node) -> None:
        """Tar-order readahead: fetch the ``READAHEAD_WINDOW`` of small files that follow
        ``node`` in the blob, in the background — when the ``MISS_WINDOW`` after it is not
        all loaded yet (so a program reading files in tar order stays ahead of its reads,
        in requests of about a window each)."""
        with self.cv:
            self.after.append(node)
            self.cv.notify_all()

    def _run_after(self) -> None:
        while True:
            with self.cv:
                while not self.after:
                    self.cv.wait()
                node = self.after.pop()  # the latest first: what runs now
                del self.after[:-8]      # a reader far ahead made older positions moot
            if self.frames.profiled or not self.frames.following(node, MISS_WINDOW):
                continue
            todo = self.frames.following(node, READAHEAD_WINDOW)
            try:
                self.frames.load(todo, wait=False, workers=BACKGROUND_WORKERS)
            except EnvbuildError as e:  # a foreground read will report it
                log.warning("readahead after %s: %s", node.read_path, e)

    def schedule(self, directory: str) -> None:
        with self.cv:
            if directory in self.done:
                return
            self.done.add(directory)
            self.queue.append(directory)
            self.cv.notify_all()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                directory = self.queue.pop()  # the latest first: what runs now
            d = self.nodes.get(directory)
            if d is None or not d.is_dir:
                continue
            prefix = directory + "/" if directory else ""
            todo, total = [], 0
            for name in d.children:
                n = self.nodes.get(prefix + name)
                if (n is None or not n.read_path or n.size > self.max_file
                        or not self.frames.missing(n)):
                    continue
                total += n.size
                if total > self.budget:
                    break
                todo.append(n)
            if not todo:
                continue
            try:
                self.frames.load(todo, wait=False, workers=BACKGROUND_WORKERS)
            except EnvbuildError as e:  # a foreground read will report it
                log.warning("readahead of %s: %s", directory or "/", e)

