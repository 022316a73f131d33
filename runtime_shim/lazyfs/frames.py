"""Fetching a lazy layer's frames for the filesystem: one fetch per frame at a time, each
ranged read reported to waiting readers as it lands (``_Frames``), large files streamed in
parallel frames (``_Frames.stream``), tar-order, directory and extension-module readahead
(``_Readahead``, background requests that yield to a reader's) and profile prefetch in a few
coalesced reads (``prefetch_in_order``)."""

from __future__ import annotations

import bisect
import heapq
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from envbuild.errors import EnvbuildError
from envbuild.store.lazy import LazyLayer, background
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
#: Deferred tar-order readaheads waiting (``_Readahead.schedule_after(delay=...)``); more are
#: dropped (a hint only).
MAX_LATER = 256
#: Compressed bytes the background readahead fetches past a miss's window, in tar order.
#: 768 KiB: replayed on the cold_start workload's opens, 2.5 MB less than 1 MiB for one miss
#: more — margin under the 15 % byte budget, which the 1 MiB readahead touched (0.150-0.151).
READAHEAD_WINDOW = 768 << 10
#: Ranged reads of a profile prefetch in flight at once, per layer (the node's fetch
#: semaphore bounds them all).
PREFETCH_WORKERS = 6
#: Compressed bytes between two files of a profile that one read may span (fetched and
#: dropped): measured on the cold_start workload, 16 KiB -> 142 reads / 40.0 MB, 64 KiB ->
#: 78 / 42.1 MB, 128 KiB -> 63 / 43.7 MB.
PROFILE_GAP = 64 << 10
#: Largest read of a profile prefetch (compressed bytes): several in flight share the link,
#: and each is reported to waiting readers when it lands.
PROFILE_RUN = 2 << 20
#: Parallel reads of one large profiled file (above ``PROFILE_RUN``).
PROFILE_FILE_WORKERS = 3
#: Files larger than this end a tar-order window (they are fetched when opened).
WINDOW_MAX_FILE = 1 << 20
#: A reader whose file's frames are in another fetch's flight (a prediction's, a window's,
#: the readahead's coalesced read) waits this long, then fetches them itself in a ranged read
#: of its own ("hedged"): a small pyc queued at the end of a 1.5 MB read, on a link and a GIL
#: busy with the other loads, waited 50–140 ms where its own GET takes ~15–25 ms.
#: ``$ENVBUILD_LAZY_HEDGE_MS`` (0: never).
HEDGE_AFTER = max(0.0, float(os.environ.get("ENVBUILD_LAZY_HEDGE_MS", "25") or 0) / 1000)
#: Files larger than this are not hedged (their bytes would go over the link twice).
HEDGE_MAX_BYTES = 256 << 10
#: Parallel requests of an extension module's siblings (``_Readahead.schedule_extensions``).
EXTENSION_WORKERS = 4


class _Frames:
    """Which frames of a layer are loaded (every file inside them verified and cached) or being
    fetched, so a read waits for a fetch in flight (readahead, prefetch) instead of repeating
    it. Small files share frames (lazy framing): loading a frame caches every file wholly
    inside it, which costs no extra request."""

    def __init__(self, layer: LazyLayer, nodes: dict[str, Node], *,
                 on_loaded: Callable[[list[Node]], None] | None = None,
                 report_all: bool = True,
                 present: Callable[[Node], bool] | None = None) -> None:
        self.layer = layer
        #: whether a file's contents are on the node already (the node's file cache): the
        #: guesses (windows, readahead) leave such files out; None: nothing is
        self.present = present
        self.cv = threading.Condition()
        self.loaded: set[int] = set()
        self.inflight: set[int] = set()
        self.mates: dict[int, list[Node]] = {}
        for node in {id(n): n for n in nodes.values()}.values():
            if len(node.frames) == 1 and node.read_path:
                self.mates.setdefault(node.frames[0], []).append(node)
        self.nodes = nodes
        #: called (in the loading thread) with the files a load made wholly present; with
        #: ``report_all`` False, only with those a ``load(..., ahead=True)`` asked for (files
        #: predicted to be opened soon), not the window's or the readahead's guesses
        self.on_loaded = on_loaded
        self.report_all = report_all
        self._ahead: set[int] = set()   # id(node) of files asked for ahead, not yet reported
        #: a file that a background guess's load of ``node`` brings along (``load`` with
        #: ``wait=False``, not ``ahead``: a window, the readahead), or None when there is
        #: none to fetch (the producer filters with ``to_fetch``)
        self.companion: Callable[[Node], Node | None] | None = None
        self.profiled = False   # a recorded profile is being prefetched: no tar-order guesses
        self.hedged = 0   # reads a waiting reader sent for frames already in flight (``_hedge``)
        self._order: list[Node] | None = None   # regular files in blob (tar) order, on demand
        self._pos: dict[int, int] = {}          # id(node) -> index in _order
        self._starts: list[int] = []            # first frame of each file of _order

    def _tar_order(self) -> list[Node]:
        if self._order is None:
            files = sorted({id(n): n for n in self.nodes.values()
                            if n.read_path and n.frames}.values(), key=lambda n: n.frames[0])
            self._pos = {id(n): i for i, n in enumerate(files)}
            self._starts = [n.frames[0] for n in files]
            self._order = files
        return self._order

    def ahead_loaded(self, node: Node, distance: int) -> bool:
        """Whether the file about ``distance`` compressed bytes after ``node`` in the blob
        (the first one starting there or later) is loaded or being fetched — then a reader
        at ``node`` is at least that far behind the readahead (cheap: a bisection, no lock
        wait, so that every open of a fetched file can ask). True past the blob's end."""
        order = self._tar_order()
        k = bisect.bisect_left(self._starts, node.frames[-1] + distance)
        if k >= len(order):
            return True
        loaded, inflight = self.loaded, self.inflight
        return all(f in loaded or f in inflight for f in order[k].frames)

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

    def on_node(self, node: Node) -> bool:
        """Whether ``node``'s contents are on the node already (``present``): a guess need
        not fetch its frames (its open is answered from the file cache)."""
        return self.present is not None and self.present(node)

    def missing(self, node: Node) -> bool:
        return any(f not in self.loaded for f in node.frames)

    def to_fetch(self, node: Node) -> bool:
        """Whether a guess should fetch ``node``: some of its frames are missing and its
        contents are not on the node already (``on_node``)."""
        return self.missing(node) and not self.on_node(node)

    def claim(self, nodes: Sequence[Node]) -> set[int]:
        """Mark the frames of ``nodes`` that are neither loaded nor being fetched as being
        fetched (by the caller, who must then ``fetch`` them); returns them."""
        with self.cv:
            mine = {f for n in nodes for f in n.frames
                    if f not in self.loaded and f not in self.inflight}
            self.inflight |= mine
        return mine

    def fetch(self, nodes: Sequence[Node], mine: set[int], *,
              workers: int | None = None, max_run: int | None = None,
              merge_gap: int | None = None) -> None:
        """Fetch the frames ``mine`` (claimed with ``claim``) of ``nodes``: each ranged read's
        frames are marked loaded as soon as it completed and the files it completes are
        verified (a reader waiting for one file of a batch waits for its own read only); on
        failure the rest are released (a waiting reader then tries itself). ``on_loaded`` is
        told of the files each read made wholly present (``report_all``; else of those asked
        for ahead)."""
        if not mine:
            return
        ok = False
        mates = [m for f in sorted(mine) for m in self.mates.get(f, ())]
        related = [*nodes, *mates]
        arrived: set[int] = set()

        def on_frames(offsets: list[int]) -> None:
            got = mine.intersection(offsets)
            arrived.update(got)
            self._report(self._settle(got, True, related))

        try:
            paths = [n.read_path for n in nodes if any(f in mine for f in n.frames)]
            self.layer.prefetch(paths + [m.read_path for m in mates], workers=workers,
                                on_frames=on_frames, max_run=max_run, merge_gap=merge_gap)
            ok = True
        finally:
            # frames no read reported (a failure; or a fake layer that reports nothing)
            self._report(self._settle(mine - arrived, ok, related))

    def _report(self, done: list[Node]) -> None:
        if not self.report_all:
            with self.cv:
                done = [n for n in done if id(n) in self._ahead]
                self._ahead.difference_update(id(n) for n in done)
        if done and self.on_loaded is not None:
            try:
                self.on_loaded(done)
            except Exception:  # noqa: BLE001 - a hint to a cache; the frames are loaded
                log.exception("after loading %d files of %s", len(done), self.layer.digest)

    def _settle(self, mine: set[int], ok: bool, nodes: Sequence[Node]) -> list[Node]:
        """The fetch of ``mine`` ended (``ok``: loaded); wake the waiters. Returns those of
        ``nodes`` now wholly loaded."""
        if not mine:
            return []
        with self.cv:
            self.inflight -= mine
            done: list[Node] = []
            if ok:
                self.loaded |= mine
                done = [n for n in {id(n): n for n in nodes}.values()
                        if any(f in mine for f in n.frames)
                        and all(f in self.loaded for f in n.frames)]
            self.cv.notify_all()
        return done

    def stream(self, node: Node) -> Iterable[bytes]:
        """The verified contents of ``node`` for writing its cache file: a large file whose
        frames no one is fetching is streamed (``LazyLayer.stream``: frames in parallel,
        hashed in order as they arrive; verified when the iterator ends), its frames marked
        loaded once it verified; otherwise its frames are loaded (waiting for those in
        flight) and it is read whole."""
        mine = self.claim([node])
        if len(node.frames) < 2 or len(mine) < len(set(node.frames)):
            self.fetch([node], mine)
            self.load([node])
            return (self.layer.read(node.read_path),)
        return self._streaming(node, mine)

    def _streaming(self, node: Node, mine: set[int]) -> Iterator[bytes]:
        ok = False
        try:
            yield from self.layer.stream(node.read_path)
            ok = True
        finally:
            self._settle(mine, ok, ())  # its cache file is being written by our consumer

    def load(self, nodes: Sequence[Node], *, wait: bool = True,
             workers: int | None = None, max_run: int | None = None,
             merge_gap: int | None = None, ahead: bool = False) -> None:
        """Load the frames of ``nodes``; ``wait=False`` (background): only those no one is
        fetching, and return at once if there are none. ``workers``: parallel requests
        (default: the layer's) of at most ``max_run`` bytes spanning gaps of at most
        ``merge_gap`` bytes (defaults: the layer's). ``ahead``: ``nodes`` are predicted to
        be opened soon (start-up files, a program's libraries, an import prediction, a
        profile), so ``on_loaded`` is told of them even without ``report_all``: when their
        frames land, whoever fetches them, or now if they are loaded already."""
        if self.companion is not None and not wait and not ahead:   # a guess in the background
            # the companion is None when it need not be fetched (``to_fetch``)
            extra = [c for n in nodes if (c := self.companion(n)) is not None]
            if extra:
                nodes = [*nodes, *extra]
        if ahead and not self.report_all:
            with self.cv:
                self._ahead.update(id(n) for n in nodes if n.read_path)
                present = [n for n in nodes if n.frames
                           and all(f in self.loaded for f in n.frames)]
            self._report(present)
        waited: float | None = None   # when this reader began waiting for others' fetches
        hedge = wait and HEDGE_AFTER > 0 and sum(n.size for n in nodes) <= HEDGE_MAX_BYTES
        while True:
            with self.cv:
                missing = {f for n in nodes for f in n.frames if f not in self.loaded}
                if not missing:
                    return
                if not (missing - self.inflight):
                    if not wait:
                        return
                    if not hedge:
                        self.cv.wait()
                        continue
                    now = time.monotonic()
                    waited = now if waited is None else waited
                    if now - waited < HEDGE_AFTER:
                        self.cv.wait(HEDGE_AFTER - (now - waited))
                        continue
                    hedge = False   # once: then wait for whichever read lands first
            if waited is not None and not hedge:
                waited = None
                self._hedge(nodes, missing)
                continue
            self.fetch(nodes, self.claim(nodes), workers=workers, max_run=max_run,
                       merge_gap=merge_gap)
            if not wait:
                return

    def _hedge(self, nodes: Sequence[Node], frames: set[int]) -> None:
        """Fetch ``frames`` of ``nodes``, which another fetch has in flight, in a read of our
        own (``HEDGE_AFTER``): marked loaded when it lands, left in flight for the other
        fetch (which settles them as usual). A failure is left to that fetch."""
        def on_frames(offsets: list[int]) -> None:
            with self.cv:
                self.loaded |= frames.intersection(offsets)
                self.cv.notify_all()

        with self.cv:
            self.hedged += 1
        try:
            self.layer.prefetch([n.read_path for n in nodes], on_frames=on_frames)
        except EnvbuildError as e:
            log.debug("hedged read of %s in %s: %s", [n.read_path for n in nodes],
                      self.layer.digest, e.message)
            return
        on_frames(list(frames))   # all verified and cached (a read may report none)



def prefetch_in_order(frames: _Frames, nodes: dict[str, Node], paths: Sequence[str], *,
                      gap: int = PROFILE_GAP, max_run: int = PROFILE_RUN,
                      workers: int = PREFETCH_WORKERS) -> int:
    """Load the regular files among ``paths`` (a recorded profile: the files a run read, in
    order) in few large ranged reads: the files sorted by blob offset, neighbours at most
    ``gap`` compressed bytes apart coalesced into reads of at most ``max_run`` bytes (the gap
    bytes are fetched and dropped: one request costs more than 64 KiB of transfer), the reads
    started in the order of their earliest file in the profile (what the workload needs
    first arrives first), ``workers`` at a time, as background work (a reader's own misses go
    first). Each read is reported to waiting readers as soon as it landed and verified
    (``_Frames.fetch``), so a reader needing a file of an in-flight read waits for that read
    only; frames someone else is fetching are skipped. Marks ``frames`` as profiled (the
    tar-order readahead stops guessing). Returns the files asked for (``coalesced_runs``
    makes the reads)."""
    frames.profiled = True
    runs = coalesced_runs(frames, nodes, paths, gap=gap, max_run=max_run)
    if not runs:
        return 0
    wanted = sum(len(r) for r in runs)

    def load(run: list[Node]) -> None:
        with background():
            # a large file alone is several reads of max_run: those in parallel
            frames.load(run, wait=False, workers=PROFILE_FILE_WORKERS, max_run=max_run,
                        merge_gap=gap, ahead=True)

    with ThreadPoolExecutor(max(1, min(workers, len(runs))),
                            thread_name_prefix="lazy-prefetch") as pool:
        for f in [pool.submit(load, run) for run in runs]:
            f.result()
    return wanted


def coalesced_runs(frames: _Frames, nodes: dict[str, Node], paths: Sequence[str], *,
                   gap: int = PROFILE_GAP, max_run: int = PROFILE_RUN) -> list[list[Node]]:
    """The regular files among ``paths`` whose frames are missing and whose contents are not
    on the node already (``_Frames.on_node``), as ``prefetch_in_order`` reads them: sorted
    by blob offset, neighbours at most ``gap`` compressed bytes apart in one run of at most
    ``max_run`` bytes, the runs in the order of their earliest file in ``paths``."""
    wanted: dict[int, tuple[int, Node]] = {}
    for k, p in enumerate(paths):
        n = nodes.get(p.strip("/"))
        if (n is None or not n.read_path or not n.frames or id(n) in wanted
                or not frames.to_fetch(n)):
            continue
        wanted[id(n)] = (k, n)
    runs: list[tuple[int, list[Node]]] = []   # (earliest profile index, files), blob order
    start = end = 0
    for k, n in sorted(wanted.values(), key=lambda kn: kn[1].frames[0]):
        n_start = n.frames[0]
        n_end = n_start + frames.layer.compressed_size(n.read_path)
        if runs and n_start - end <= gap and n_end - start <= max_run:
            first, run = runs[-1]
            runs[-1] = (min(first, k), run + [n])
            end = max(end, n_end)
        else:
            runs.append((k, [n]))
            start, end = n_start, n_end
    runs.sort(key=lambda r: r[0])
    return [run for _, run in runs]


#: A Python extension module (``*.cpython-311-x86_64-linux-gnu.so``, ``*.abi3.so``).
_EXTENSION = re.compile(r"\.(cpython-[^/]*|abi3)\.so$")
#: Compressed bytes an extension module's first open may fetch of its siblings.
EXTENSION_BUDGET = 16 << 20
#: Largest ranged read of that fetch: a large library's frames come in several reads in
#: parallel (decompressed in parallel), each reported to waiting readers as it completes.
EXTENSION_RUN = 1 << 20


def extension_siblings(nodes: dict[str, Node], path: str) -> tuple[list[str], list[Node]]:
    """For the extension module at ``path``: the directories whose files its package will
    load too (``(dirs, files)``): the other extension modules of its directory (a package
    imports its compiled modules together: pandas/_libs has 27, ``import pandas`` loads 25)
    and, for a module of ``site-packages/P/``, the wheel's vendored shared libraries in
    ``site-packages/P.libs/`` (auditwheel's layout: what the modules link against, e.g.
    numpy's OpenBLAS), those first. Modules named like tests (numpy's ``_umath_tests``) are
    left out. Empty when ``path`` is no extension module."""
    if not _EXTENSION.search(path):
        return [], []
    directory = path.rpartition("/")[0]
    dirs, out = [directory], []
    parts = path.split("/")
    if "site-packages" in parts[:-2]:
        k = parts.index("site-packages")
        dirs.append("/".join(parts[:k + 1] + [parts[k + 1] + ".libs"]))
    for d in reversed(dirs):  # the vendored libraries first: the module's loader needs them
        node = nodes.get(d)
        if node is None or node.children is None:
            continue
        for name in node.children:
            n = nodes.get(f"{d}/{name}" if d else name)
            if n is not None and n.read_path and n.frames and (
                    d != directory or (_EXTENSION.search(name) and "test" not in name)):
                out.append(n)
    return dirs, out


class _Readahead:
    """Directory readahead: after a file of directory D was fetched, fetch D's other small
    regular files (at most ``max_file`` bytes each: 128 KiB, replayed on the cold_start
    workload's opens one miss fewer and 1.7 MB less than 256 KiB) in the background, once per
    directory, at most ``budget`` bytes. Tar order
    keeps a directory's files together, so this is a few merged ranged reads; it serves
    programs that open a package's files one by one (Python imports, shared libraries).
    Extension readahead (``schedule_extensions``): the first open of a Python extension
    module fetches its siblings (``extension_siblings``)."""

    def __init__(self, layer: LazyLayer, nodes: dict[str, Node], frames: _Frames, *,
                 max_file: int = 128 << 10, budget: int = 2 << 20) -> None:
        self.layer, self.nodes, self.frames = layer, nodes, frames
        self.max_file, self.budget = max_file, budget
        self.done: set[str] = set()
        self.queue: list[str] = []
        self.extensions: list[Node] = []
        self.ext_done: set[str] = set()
        self.cv = threading.Condition()
        self.after: list[Node] = []
        self.later: list[tuple[float, int, Node]] = []   # (due, tiebreak, node): a heap
        self.stopped = False
        threading.Thread(target=self._run, name="lazy-readahead", daemon=True).start()
        threading.Thread(target=self._run_extensions, name="lazy-readahead-ext",
                         daemon=True).start()
        for _ in range(BACKGROUND_WORKERS):
            threading.Thread(target=self._run_after, name="lazy-readahead-tar",
                             daemon=True).start()

    def stop(self) -> None:
        """The mount is gone: end the background threads once their current fetch is done.
        Until then they hold the layer's tree; a daemon that served many mounts kept every
        tree and 2 + ``BACKGROUND_WORKERS`` idle threads per mount for its whole life (issue
        34, item 7: 300 MB per hostile 190k-member layer, kept after unmount)."""
        with self.cv:
            self.stopped = True
            self.queue.clear()
            self.extensions.clear()
            self.after.clear()
            self.later.clear()
            self.cv.notify_all()

    def schedule_after(self, node: Node, *, delay: float = 0.0) -> None:
        """Tar-order readahead: fetch the ``READAHEAD_WINDOW`` of small files that follow
        ``node`` in the blob, in the background — when the ``MISS_WINDOW`` after it is not
        all loaded yet (so a program reading files in tar order stays ahead of its reads,
        in requests of about a window each). Nothing is woken while the file half a window
        ahead is loaded already (most opens of a reader going through fetched files).
        ``delay``: not before that many seconds from now (``_NodeDaemon._follow_delay``)."""
        if node.frames and self.frames.ahead_loaded(node, MISS_WINDOW // 2):
            return
        with self.cv:
            if delay > 0:
                if len(self.later) < MAX_LATER:
                    heapq.heappush(self.later, (time.monotonic() + delay, id(node), node))
            else:
                self.after.append(node)
            self.cv.notify_all()

    def _run_after(self) -> None:
        with background():
            self._loop_after()

    def _loop_after(self) -> None:
        while True:
            with self.cv:
                while True:
                    if self.stopped:
                        return
                    now = time.monotonic()
                    while self.later and self.later[0][0] <= now:   # deferred ones now due
                        self.after.append(heapq.heappop(self.later)[2])
                    if self.after:
                        break
                    self.cv.wait(self.later[0][0] - now if self.later else None)
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

    def schedule_extensions(self, node: Node) -> None:
        """``node`` was opened: when it is a Python extension module whose directory was not
        seen yet, fetch its siblings (``extension_siblings``) in the background."""
        if self.frames.profiled or not _EXTENSION.search(node.read_path):
            return
        directory = node.read_path.rpartition("/")[0]
        with self.cv:
            if directory in self.ext_done:
                return
            self.ext_done.add(directory)
            self.extensions.append(node)
            self.cv.notify_all()

    def _load_extensions(self, node: Node) -> None:
        dirs, siblings = extension_siblings(self.nodes, node.read_path)
        with self.cv:
            self.ext_done.update(dirs)
        todo = [n for n in siblings if n is not node and self.frames.to_fetch(n)]
        # bounded by compressed bytes: what the frames cost on the link
        sized, spent = [], 0
        for n in todo:
            spent += self.layer.compressed_size(n.read_path)
            if spent > EXTENSION_BUDGET:
                break
            sized.append(n)
        if not sized:
            return
        try:
            self.frames.load(sized, wait=False, workers=EXTENSION_WORKERS,
                             max_run=EXTENSION_RUN)
        except EnvbuildError as e:  # a foreground read will report it
            log.warning("extension readahead of %s: %s", node.read_path, e)

    def _run_extensions(self) -> None:
        # its own thread: a library the loader needs next must not wait behind a directory
        with background():
            self._loop_extensions()

    def _loop_extensions(self) -> None:
        while True:
            with self.cv:
                while not self.extensions and not self.stopped:
                    self.cv.wait()
                if self.stopped:
                    return
                node = self.extensions.pop()
            self._load_extensions(node)

    def _run(self) -> None:
        with background():
            self._loop()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.stopped:
                    self.cv.wait()
                if self.stopped:
                    return
                directory = self.queue.pop()  # the latest first: what runs now
            d = self.nodes.get(directory)
            if d is None or d.children is None:  # not a directory
                continue
            prefix = directory + "/" if directory else ""
            todo, total = [], 0
            for name in d.children:
                n = self.nodes.get(prefix + name)
                if (n is None or not n.read_path or n.size > self.max_file
                        or not self.frames.to_fetch(n)):
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

