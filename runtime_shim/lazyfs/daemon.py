"""The node daemon: one process per node cache serving every lazy layer of the host, each its
own FUSE mount (protocol: ``runtime_shim.lazyfs.control``)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from envbuild.errors import EnvbuildError
from envbuild.store.lazy import ChunkCache, HttpRanges, LazyLayer, MemoryChunkCache
from runtime_shim.lazyfs import startup
from runtime_shim.lazyfs.chunks import TieredChunkCache
from runtime_shim.lazyfs.control import (
    DAEMON_IDLE_EXIT,
    REQUEST_TIMEOUT,
    ControlListener,
    _read_line,
    trusted_uids,
)
from runtime_shim.lazyfs.filecache import BoundedRanges, FetchLimits, FetchSettings, FileCache
from runtime_shim.lazyfs.frames import prefetch_in_order
from runtime_shim.lazyfs.fuseops import CACHE_TTL, make_operations
from runtime_shim.lazyfs.profile import (
    PROFILE_NAMESPACE,
    PROFILE_VERSION,
    PROFILE_WINDOW,
    _Trace,
)
from runtime_shim.lazyfs.tree import tree_of

log = logging.getLogger("envbuild.lazyfs")


#: Values of ``mode`` (ping reply, ``lazy/daemon.json``, each mount's state): how reads of
#: fetched files are served.
MODE_PASSTHROUGH = "passthrough"   # the kernel reads the node's file cache (passthrough.py)
MODE_FUSE = "fuse"                 # every read through the libfuse filesystem (fuseops.py)
#: The daemon's GIL switch interval (CPython's default is 5 ms). A miss is a chain of thread
#: hand-offs (FUSE reader, open worker, fetch, reply) while other threads decompress and
#: verify windows and readahead in pure Python; each hand-off can wait a whole interval for
#: the GIL, and a program's first command is a dozen misses one after the other.
SWITCH_INTERVAL = 0.0005
#: The daemon's cyclic-GC generation-0 threshold (CPython's default is 700). Each collection
#: holds the GIL, stopping every FUSE reply; with 700, a cold_start workload ran ~110 of them
#: (up to 27 ms each) and a full one (57 ms) over the mounts' trees.
GC_GEN0_THRESHOLD = 20_000
#: glibc malloc settings for the daemon (``tune_malloc``). Every fetched byte passes through
#: freshly allocated buffers (each response body, each frame's decompressed bytes, a file's
#: joined contents) on one of the daemon's dozens of threads; glibc gives each thread that
#: allocates its own arena (up to 8 per CPU), each arena's heap grows and is trimmed on its
#: own, so memory freed on one thread was not reused by the next and new buffers were new
#: pages, faulted in and zeroed (``perf record -g`` of the daemon in a cold_start lazy run:
#: 20 % of its samples in ``clear_page_erms``, from ZSTD's output and memmove). Measured per
#: lazy run (``cold_start.py --modes lazy --repeat 1``, 1gbit:10ms), the daemon's minor
#: faults: 100-113 k by default, ~102 k with one arena alone or the thresholds alone, 75-88 k
#: with both; sets of ``--modes full,lazy --repeat 3``: total 0.81-0.83 of full against
#: 0.91-1.05 (docs/lazy-loading.md, tenth pass). The threads allocate under the GIL anyway,
#: so the one arena's lock costs little.
MALLOC_ARENA_MAX = 1
MALLOC_MMAP_THRESHOLD = 32 << 20    # glibc's maximum on 64-bit: buffers up to this from the heap
MALLOC_TRIM_THRESHOLD = 256 << 20   # give memory back only when this much is free at the top
MALLOC_TOP_PAD = 64 << 20           # and grow the heap by this much at a time
#: glibc's own environment names for these: an operator who sets one keeps glibc's reading
_MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
               "MALLOC_TOP_PAD_")
#: How long after the first open of a file fetched ahead of its reader (a loader file, the
#: lock's command, a start-up file) the tar-order readahead follows it (``_follow_delay``).
#: Measured (cold_start, 1gbit:10ms, pairs taking turns, medians of 4-5): the first command
#: exits 0.07-0.13 s earlier than with the readahead at once, the total within the noise
#: either way; never following made the first command as early but the import 0.27 s slower
#: (that readahead brings what the import needs next: libraries, the stdlib).
AHEAD_FOLLOW_DELAY = 0.2
#: Libraries larger than this are left to their own open (``elfdeps``: fetched ahead only
#: when small enough not to hold up the link for the program's other misses).
ELF_PREFETCH_MAX = 16 << 20
#: ``$ENVBUILD_LAZY_PY_STARTUP=0``: predict no Python start-up files at create
#: (``_NodeDaemon._python_startup``); the interpreter's first open still does.
PY_STARTUP = os.environ.get("ENVBUILD_LAZY_PY_STARTUP", "1").strip().lower() not in ("0", "off")
#: Dependency levels fetched ahead of the loader (the program's libraries, theirs).
ELF_DEPTH = 2
#: Threads fetching loader files and start-up files ahead (each waits for its request).
ELF_WORKERS = 12


class _GcPauses:
    """The daemon's cyclic-GC settings and what its collections cost (the ping's ``gc``):
    every collection holds the GIL, so its time is time no FUSE request is answered."""

    def __init__(self) -> None:
        self.collections = 0
        self.seconds = 0.0
        self.longest = 0.0
        self._t0 = 0.0

    def install(self) -> None:
        import gc

        gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        import time

        # called with the GIL held, one collection at a time: no lock needed
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        took = time.perf_counter() - self._t0
        self.collections += 1
        self.seconds += took
        self.longest = max(self.longest, took)

    def snapshot(self) -> dict[str, float]:
        return {"collections": self.collections, "seconds": round(self.seconds, 4),
                "longest_s": round(self.longest, 4)}


_GC_PAUSES = _GcPauses()

#: What a layer's tree costs the daemon per TOC member (``tree.Node``, its path, the tables
#: that index it): measured 1.56 KB on a 190,000-member layer of short names.
TREE_BYTES_PER_ENTRY = 1600
#: The default of ``--tree-budget``/``$ENVBUILD_LAZY_TREE_BUDGET``: the memory all mounted
#: layers' trees may take (~1.3 million members: five layers of the TOC's largest size).
DEFAULT_TREE_BUDGET = 2 << 30
TREE_BUDGET_ENV = "ENVBUILD_LAZY_TREE_BUDGET"
#: Seconds after a mount's end before its tree's memory is given back (the work it started —
#: an import index read, a prefetch — holds the tree until it is done).
HEAP_RELEASE_DELAY = 1.0


def tune_malloc() -> str:
    """Keep the daemon's freed buffers for reuse (``MALLOC_*`` above) with glibc's
    ``mallopt``; returns what was done, for the ping reply: ``"tuned"``, or why not (not
    glibc; the operator set these in the environment, which wins)."""
    if any(k in os.environ for k in _MALLOC_ENV) \
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "set by the environment"
    try:
        mallopt = _glibc().mallopt
    except (OSError, AttributeError):
        return "not glibc"
    m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8  # <malloc.h>
    ok = all(mallopt(param, value) == 1 for param, value in (
        (m_arena_max, MALLOC_ARENA_MAX), (m_mmap_threshold, MALLOC_MMAP_THRESHOLD),
        (m_trim_threshold, MALLOC_TRIM_THRESHOLD), (m_top_pad, MALLOC_TOP_PAD)))
    return "tuned" if ok else "mallopt refused"


def _settle_heap() -> None:
    """After a mount's tree is built: move what the daemon holds (trees, tables) out of the
    cyclic GC's reach (``gc.freeze``), so that no collection walks tens of thousands of
    long-lived nodes while FUSE requests wait for the GIL."""
    import gc

    gc.freeze()


def _release_heap() -> None:
    """After an unmount (``_NodeDaemon.serve``, once its thread and the work it started are
    done): collect the unmounted tree's cycles now (``gc.unfreeze``, ``collect``, ``freeze``
    again) and give the freed pages back to the system."""
    import gc

    gc.unfreeze()
    gc.collect()   # the tree is cycles: gone now, not at some later collection
    gc.freeze()    # what is still held (other mounts' trees) out of the collector's reach
    # give the freed pages back (``tune_malloc`` keeps them otherwise): a tree is ~1.6 KB
    # a member, hundreds of MB for a big layer
    with contextlib.suppress(OSError, AttributeError):
        _glibc().malloc_trim(0)


@functools.lru_cache(maxsize=1)
def _glibc() -> Any:
    """The C library this process runs on, for glibc's malloc controls (``mallopt``,
    ``malloc_trim``: an ``AttributeError`` where it is not glibc). ``CDLL(None)``: the one
    already loaded, with no ``find_library`` (which spawns ``ldconfig``)."""
    import ctypes

    return ctypes.CDLL(None)


def _serve(box: list[Any]) -> None:
    """A mount's thread: run its serving function, whose closure holds the layer's tree, and
    drop it when the mount is gone (``box`` holds the only other reference), so that the
    daemon's next heap release (``_NodeDaemon.serve``) finds the tree unreachable."""
    serve = box.pop()
    serve()


def _cached_path(ops: Any, node: Any) -> str | None:
    """The node's file cache path of the regular file ``node`` of mount ``ops``, if its
    content is on the node (the fuse fallback has no file cache: None)."""
    files = getattr(ops, "files", None)
    return files.cached(node.digest) if files is not None and node.digest else None


def _node_bytes(ops: Any, node: Any, cached: str | None) -> bytes:
    """The content of ``node`` (a loader or command file fetched ahead): at most
    ``ELF_PREFETCH_MAX`` bytes of its cache file ``cached``, or, when it is not on the node,
    its frames loaded (verified) and the file read from them."""
    if cached is not None:
        with open(cached, "rb") as f:
            return f.read(ELF_PREFETCH_MAX)
    ops.lazy_frames.load([node], ahead=True)
    return ops.lazy_layer.read(node.read_path)


def _refuse(conn: Any, why: str) -> None:
    try:
        conn.settimeout(1.0)
        conn.sendall(json.dumps({"ok": False, "error": why}).encode() + b"\n")
    except OSError:
        pass
    finally:
        conn.close()


def owned_mountpoint(root: str, digest: object, requested: object) -> str:
    """Where the daemon of node ``root`` mounts layer ``digest``: ``<root>/lazy/<hex>``, and
    only there — a request naming another place (``requested``) is refused, as is a path that is
    not a real directory of the daemon's own user (a symlink, another user's dir)."""
    import stat

    from envbuild.errors import RuntimeShimError
    from envbuild.store import check_digest

    mp = os.path.join(root, "lazy", check_digest(digest))
    if requested != mp:
        raise RuntimeShimError(f"the lazy daemon mounts layer {digest} only at {mp}, not at "
                               f"{str(requested)[:300]!r}")
    for path in (os.path.join(root, "lazy"), mp):
        try:
            st = os.lstat(path)
        except OSError as e:
            raise RuntimeShimError(f"lazy mount point {path}: {e.strerror}") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise RuntimeShimError(f"lazy mount point {path} is not a directory of the "
                                   f"daemon's user (uid {st.st_uid}, mode {st.st_mode:o})")
    return mp


def _meta_building(root: str) -> int:
    from runtime_shim.lazyfs import metalayer

    return metalayer.building(root)


class _NodeDaemon:
    def __init__(self, root: str, chunk_cache_max: int, memory_cache: int,
                 fetch: FetchSettings | None = None,
                 tree_budget: int = DEFAULT_TREE_BUDGET) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.root = root
        self.tree_budget = tree_budget
        self.tree_bytes = 0   # what the mounted layers' trees are charged (``_charge_tree``)
        self.heap_dirty = 0.0  # when a mount last ended (its tree to free), 0: nothing to free
        self.cache = TieredChunkCache(MemoryChunkCache(memory_cache),
                                      ChunkCache(os.path.join(root, "chunks"), chunk_cache_max))
        self.limits = FetchLimits(fetch or FetchSettings.from_env())
        self.files = FileCache(os.path.join(root, "files"), self.limits, chunk_cache_max)
        self.open_workers = ThreadPoolExecutor(32, thread_name_prefix="lazy-open")
        self.mode, self.mode_reason = MODE_FUSE, "not probed"
        self.metaserver: Any = None   # metaserve.MetaServer, in passthrough mode
        self.malloc = "not tuned"     # what ``tune_malloc`` did (set when serving)
        self.lock = threading.Lock()
        self.mounts: dict[int, str] = {}      # id -> mountpoint
        self.threads: list[threading.Thread] = []
        self.busy = 0
        self.last = 0.0
        self.stop = False
        self._next = 0
        self._stores: dict[tuple[str, str | None], Any] = {}
        self.profiles: dict[str, dict[str, Any]] = {}  # key -> {"req", "traces", "saved"}
        self.ops: dict[str, Any] = {}  # mountpoint -> its Operations
        self.by_digest: dict[str, Any] = {}  # layer digest -> its Operations (ELF lookups)
        # each load waits for its request: enough threads that a program's libraries are all
        # requested at once (4 queued libm behind the loader's own two: ~20 ms; the node's
        # fetch bound still caps what is in flight)
        self.elf_pool = ThreadPoolExecutor(ELF_WORKERS, thread_name_prefix="lazy-elf")
        self._elf_seen: set[tuple[str, int]] = set()  # (mountpoint, ino) fetched ahead
        from runtime_shim.lazyfs import pyahead

        # an interpreter's start-up files (and, with $ENVBUILD_LAZY_PYDEPS=on, every module's
        # imports) fetched ahead of the importer (None with $ENVBUILD_LAZY_PYDEPS=off)
        self.pyahead = (pyahead.PyAhead(
            self._stack_layers,
            on_elf=lambda stack, ops, data: self.elf_pool.submit(
                self._elf_deps, list(stack), ops, data, ELF_DEPTH))
            if pyahead.enabled() else None)

    def _store(self, url: str, endpoint: str | None) -> Any:
        from envbuild.store import open_store

        with self.lock:
            store = self._stores.get((url, endpoint))
        if store is None:
            store = open_store(url, s3_endpoint=endpoint, create=False)  # a reader
            with self.lock:
                store = self._stores.setdefault((url, endpoint), store)
        return store

    def serve(self) -> int:
        import signal
        import time

        sys.setswitchinterval(SWITCH_INTERVAL)
        _GC_PAUSES.install()
        self.malloc = tune_malloc()
        listener = ControlListener.open(self.root)
        if listener is None:
            log.info("another daemon serves %s: exiting", self.root)
            return 0
        listener.sock.settimeout(0.1)

        def stop(signum: int, frame: Any) -> None:
            self.stop = True
        # Before any mount: libfuse installs its own handlers only where none is set, and
        # those would end just one of the sessions.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, stop)
        self._choose_mode()
        log.info("lazy layer daemon of %s up: %s mode%s, fetch concurrency %d, timeout %g s",
                 self.root, self.mode, f" ({self.mode_reason})" if self.mode_reason else "",
                 self.limits.settings.concurrency, self.limits.settings.timeout)
        self.last = time.monotonic()
        try:
            while not self.stop:
                try:
                    conn, uid = listener.accept()
                except TimeoutError:
                    with self.lock:
                        idle = (not self.mounts and not self.busy
                                and time.monotonic() - self.last > DAEMON_IDLE_EXIT)
                        release = 0 < self.heap_dirty < time.monotonic() - HEAP_RELEASE_DELAY
                        if release:
                            self.heap_dirty = 0.0
                    if idle:
                        break
                    if release:   # again a delay after the last end: work it started is done
                        _release_heap()
                    continue
                if uid not in trusted_uids():   # defence in depth: the dir is 0700 already
                    log.warning("refused a control connection from uid %d", uid)
                    _refuse(conn, f"permission denied: uid {uid} may not use this daemon")
                    continue
                with self.lock:
                    self.busy += 1
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        finally:
            listener.close()
        if self.stop:
            from runtime_shim.isolation.mount import unmount

            with self.lock:
                targets = list(self.mounts.values())
            for mp in targets:
                try:
                    unmount(mp)
                except EnvbuildError as e:
                    log.warning("%s", e)
        for t in list(self.threads):
            t.join(5)
        if self.metaserver is not None:
            self.metaserver.close()
        log.info("lazy layer daemon of %s exits", self.root)
        return 0

    def _choose_mode(self) -> None:
        """Passthrough when this kernel offers it (``passthrough.probe``), else the libfuse
        path; ``$ENVBUILD_LAZY_PASSTHROUGH`` forces either (``on``: passthrough or exit)."""
        from runtime_shim.lazyfs.passthrough import PASSTHROUGH_ENV, passthrough_wanted, probe

        ok, why = probe(os.path.join(self.root, "lazy", f".probe-{os.getpid()}"),
                        self.files.dir)
        if ok:
            self.mode, self.mode_reason = MODE_PASSTHROUGH, ""
            # files/ is the disk tier now: pieces stay in memory only (readahead, prefetch)
            # until an open writes their file, instead of being hashed and written twice
            self.cache.disk = None
            from runtime_shim.lazyfs import metaserve

            if metaserve.wanted():   # lookups answered off this interpreter's lock
                self.metaserver = metaserve.MetaServer.start()
        elif passthrough_wanted() is True:
            raise SystemExit(f"error: ${PASSTHROUGH_ENV}=on but passthrough is unavailable: "
                             f"{why}")
        else:
            self.mode, self.mode_reason = MODE_FUSE, why

    def _handle(self, conn: Any) -> None:
        import time

        try:
            conn.settimeout(REQUEST_TIMEOUT)  # a client that sends nothing holds no thread
            try:
                req = json.loads(_read_line(conn) or b"{}")
            except (EnvbuildError, ValueError) as e:
                conn.sendall(json.dumps({"ok": False, "error": f"bad request: {e}"}).encode()
                             + b"\n")
                return
            conn.settimeout(None)
            op = req.get("op") if isinstance(req, dict) else None
            if op == "ping":
                reply: dict[str, Any] = {
                    "ok": True, "pid": os.getpid(), "mode": self.mode,
                    "mode_reason": self.mode_reason,
                    "fetch_concurrency": self.limits.settings.concurrency,
                    "fetch_timeout": self.limits.settings.timeout,
                    "max_requests_in_flight": self.limits.max_in_flight,
                    "slot_wait": {k: round(v, 4) for k, v in self.limits.slot_wait.items()},
                    "files_fetched": self.files.fetches,
                    "tree_bytes": self.tree_bytes, "tree_budget": self.tree_budget,
                    "meta_building": _meta_building(self.root),
                    "cpu_seconds": round(sum(os.times()[:2]), 3),
                    "gc": _GC_PAUSES.snapshot(),
                    "malloc": self.malloc,
                    # a store client (boto3) in this process: only if a presigned URL failed
                    "boto3_loaded": "boto3" in sys.modules,
                    "fuse_requests": self._fuse_requests(),
                    "metadata_server": (self.metaserver.describe()
                                        if self.metaserver is not None else None),
                    "import_prediction": (self.pyahead.snapshot() if self.pyahead is not None
                                          else None),
                    "import_indexes": self._import_indexes()}
            elif op == "mount":
                reply = self._mount(req)
            elif op == "prefetch":
                reply = self._start_prefetch(req)
            elif op == "stats":   # a mount's counters (its root's stats xattr, when it has none)
                with self.lock:
                    served = self.ops.get(str(req.get("mountpoint")))
                reply = ({"ok": True, "stats": served.lazy_stats()} if served is not None
                         else {"ok": False, "error": "no such lazy mount"})
            elif op == "startup":  # a new stack's start-up files, fetched ahead (startup.py)
                reply = self._start_startup(req)
            elif op == "meta":  # files already on the node, served without FUSE (metalayer)
                from runtime_shim.lazyfs import metalayer

                reply = metalayer.handle(self, req)
            else:
                reply = {"ok": False, "error": f"unknown request {op!r}"}
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except Exception:  # noqa: BLE001 - a bad client must not take the daemon down
            log.exception("request failed")
        finally:
            conn.close()
            with self.lock:
                self.busy -= 1
                self.last = time.monotonic()

    def _mount(self, req: dict[str, Any]) -> dict[str, Any]:
        import time

        digest = req.get("digest")
        try:
            mp = owned_mountpoint(self.root, digest, req.get("mountpoint"))
        except EnvbuildError as e:
            log.warning("refused a mount: %s", e.message)
            return {"ok": False, "error": "\n".join(e.render_lines())}
        url, endpoint = req["store"], req.get("s3_endpoint")
        ready = threading.Event()
        t0 = time.monotonic()
        phases: dict[str, float] = {}
        try:
            if req.get("ranges_url"):  # the full store (boto3) only if the URL stops working
                store = HttpRanges(digest, req["ranges_url"], lambda: self._store(url, endpoint))
            else:
                store = self._store(url, endpoint)
            layer = LazyLayer(BoundedRanges(store, self.limits), digest, chunk_cache=self.cache,
                              expected_toc_digest=req.get("toc_digest") or None,
                              size=req.get("size"))
            phases["open"] = time.monotonic() - t0
            charge = self._charge_tree(digest, len(layer.reader.toc.entries))
        except EnvbuildError as e:
            log.error("serve %s: %s", digest, e.message)
            return {"ok": False, "error": "\n".join(e.render_lines())}
        try:
            nodes = tree_of(layer.reader)
            phases["tree"] = time.monotonic() - t0
            _settle_heap()
            prof = req.get("profile")
            trace = self._trace(prof, digest) if prof else None
            if self.mode == MODE_PASSTHROUGH:
                from runtime_shim.lazyfs.passthrough import PassthroughFS

                # a fetched program's libraries are fetched ahead of the loader, looked up in
                # the stack this layer is mounted for (its profile record names it; elfdeps)
                stack = list(prof["layers"]) if prof else None
                on_elf = ((lambda fs, data: self.elf_pool.submit(self._elf_deps, stack, fs,
                                                                 data, ELF_DEPTH))
                          if stack else None)
                py = self.pyahead
                on_open = ((lambda fs, node, path: py.opened_file(stack, fs, node, path))
                           if stack and py is not None else None)
                ops = PassthroughFS(layer, nodes, mp, self.files, workers=self.open_workers,
                                    trace=trace, on_init=ready.set, on_elf=on_elf,
                                    on_first_open=on_open,
                                    follow_delay=self._follow_delay,
                                    no_xattrs_enosys=True, metaserver=self.metaserver)
                ops.mount()
            else:
                ops = make_operations(layer, nodes, on_init=ready.set, trace=trace,
                                      limits=self.limits)
        except EnvbuildError as e:
            self._uncharge_tree(charge)
            log.error("serve %s: %s", digest, e.message)
            return {"ok": False, "error": "\n".join(e.render_lines())}
        failed: list[str] = []
        with self.lock:
            self._next += 1
            key = self._next
            self.mounts[key] = mp

        def run() -> None:
            log.info("serving %s (%d entries, TOC %d bytes) at %s (%s)", digest, len(nodes),
                     layer.stats.toc_bytes, mp, self.mode)
            try:
                if self.mode == MODE_PASSTHROUGH:
                    ops.serve()
                    return
                import mfusepy

                # The caching and inode options are also given as mount options: libfuse
                # parses them itself, which does not depend on mfusepy's view of libfuse's
                # config struct (the struct route alone left st_ino unset with libfuse 3.14:
                # hardlinks got two inodes).
                mfusepy.FUSE(ops, mp, foreground=True, nothreads=False, ro=True,
                             allow_other=True, default_permissions=True,
                             fsname=f"envbuild-lazy-{digest[7:19]}", subtype="envbuild",
                             use_ino=True, readdir_ino=True, kernel_cache=True,
                             entry_timeout=CACHE_TTL, attr_timeout=CACHE_TTL,
                             negative_timeout=CACHE_TTL)
            except BaseException as e:  # noqa: BLE001 - reported to the client
                failed.append(f"mount {mp}: libfuse failed ({e})")
            finally:
                if prof:
                    self._save_profile(prof["key"])
                self._uncharge_tree(charge)
                with self.lock:
                    self.heap_dirty = time.monotonic()
                    del self.mounts[key]
                    if self.ops.get(mp) is ops:
                        del self.ops[mp]
                    if self.by_digest.get(digest) is ops:
                        del self.by_digest[digest]
                    self._elf_seen = {k for k in self._elf_seen if k[0] != mp}
                    self.last = time.monotonic()
                if self.pyahead is not None:
                    self.pyahead.forget(mp)
                ops.lazy_readahead.stop()
                ready.set()
                log.info("unmounted %s; stats %s%s", mp, json.dumps(layer.stats.as_dict()),
                         "" if self.pyahead is None else
                         f"; import prediction {json.dumps(self.pyahead.snapshot())}")

        t = threading.Thread(target=_serve, args=([run],),
                             name=f"fuse-{digest[7:19]}", daemon=True)
        with self.lock:
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        t.start()
        if not ready.wait(req.get("timeout", 30)) or failed:
            why = failed[0] if failed else "the kernel did not send INIT in time"
            log.error("%s", why)
            return {"ok": False, "error": why}
        # where a lazy create's time goes (footer+TOC fetch, tree, mount handshake)
        log.info("mounted %s in %.3f s (footer+TOC %.3f s, tree %.3f s)", digest[:19],
                 time.monotonic() - t0, phases.get("open", 0), phases.get("tree", 0))
        with self.lock:
            self.ops[mp] = ops
            self.by_digest[digest] = ops
        if self.pyahead is not None and self.mode == MODE_PASSTHROUGH:
            # after the answer's work: the sandbox's first pycs open a few hundred ms later
            self.elf_pool.submit(self._read_index, ops, req)
        return {"ok": True, "pid": os.getpid(), "mode": self.mode}

    def _charge_tree(self, digest: str, entries: int) -> int:
        """Reserve the memory of a new mount's tree (``entries`` TOC members) against the
        daemon's ``tree_budget``, before the tree is built: a ``RuntimeShimError`` when it does
        not fit (a hostile layer of 190,000 members cost 300 MB). The mount's end gives it
        back (``_uncharge_tree``)."""
        from envbuild.errors import RuntimeShimError

        charge = entries * TREE_BYTES_PER_ENTRY
        with self.lock:
            if self.tree_bytes + charge <= self.tree_budget:
                self.tree_bytes += charge
                return charge
            used, mounts = self.tree_bytes, len(self.mounts)
        raise RuntimeShimError(
            f"lazy layer {digest}: its tree ({entries} members, ~{charge >> 20} MiB) would take "
            f"the lazy daemon over its memory budget ({used >> 20} of "
            f"{self.tree_budget >> 20} MiB used by {mounts} mounts)",
            hint=f"unmount unused layers (envbuild node gc), raise ${TREE_BUDGET_ENV}, or run "
                 "it without lazy (a full pull)")

    def _uncharge_tree(self, charge: int) -> None:
        with self.lock:
            self.tree_bytes -= charge

    def _read_index(self, ops: Any, req: dict[str, Any]) -> None:
        """Give the mount ``ops`` its layer's import index (``pyindex``; ``ops.py_index``):
        through the presigned URL the client sent, else from a store the daemon opens
        without boto3 (a directory). A hint: absent or unreadable, the layer predicts only
        interpreter start-up."""
        import time

        from runtime_shim.lazyfs import pyindex

        t0 = time.monotonic()
        digest = req["digest"]
        name = pyindex.record_name(digest)
        index = None
        try:
            if req.get("index_url"):
                from envbuild.store.lazy import _range_client

                # HttpRanges' client (its default settings): the layers' keep-alive connections
                resp = _range_client(4, 30.0).get(req["index_url"], 0, pyindex.MAX_RECORD)
                if resp.status in (200, 206):
                    index = pyindex.read_index_bytes(resp.body, digest)
                elif resp.status != 404:
                    log.warning("import index of %s: HTTP %s %s", digest[:19], resp.status,
                                resp.error or "")
            elif not str(req["store"]).startswith("s3://"):   # boto3 costs the GIL ~0.4 s
                rec = self._store(req["store"], req.get("s3_endpoint")).get_record(
                    pyindex.INDEX_NAMESPACE, name)
                index = pyindex.decode_index(rec, digest) if rec is not None else None
        except (EnvbuildError, OSError, ValueError) as e:
            log.warning("import index of %s: %s", digest[:19], getattr(e, "message", e))
        if index is not None:
            ops.py_index = index
            log.info("import index of %s: %d pycs in %.3f s", digest[:19], len(index),
                     time.monotonic() - t0)

    def _import_indexes(self) -> dict[str, int]:
        """Layer digest -> pycs in its import index, for the mounts that have one."""
        with self.lock:
            mounts = list(self.by_digest.items())
        return {d: len(ops.py_index) for d, ops in mounts
                if getattr(ops, "py_index", None) is not None}

    def _fuse_requests(self) -> dict[str, int]:
        """FUSE requests answered so far by opcode, summed over the passthrough mounts."""
        import collections

        with self.lock:
            mounts = list(self.ops.values())
        total: collections.Counter[str] = collections.Counter()
        for ops in mounts:
            counts = ops.requests_by_opcode() if hasattr(ops, "requests_by_opcode") else {}
            for k, v in list(counts.items()):
                total[str(k)] += v
        return dict(sorted(total.items()))

    def _stack_layers(self, stack: Sequence[str]) -> list[Any]:
        """The mounted layers of ``stack`` (bottom to top), top first."""
        with self.lock:
            layers = [self.by_digest.get(d) for d in reversed(stack)]
        return [x for x in layers if x is not None]

    def _follow_delay(self, fs: Any, node: Any) -> float | None:
        """When the first open of ``node`` of ``fs`` moves the tar-order readahead: at once
        (0) for a file nobody fetched ahead; never (None) for one an import prediction
        fetched (the importer follows the imports, not the blob: ``pyahead.TAR_FOLLOW``);
        ``AHEAD_FOLLOW_DELAY`` s later for a program's loader files, the lock's command and the
        start-up files (``_elf_seen``). Their readahead guesses well for what follows (the
        next libraries, the stdlib beside the interpreter), but run at once it delays the
        starting command's own opens: the daemon's one GIL. Lock-free: set lookups, asked on
        every first open."""
        py = self.pyahead
        if py is not None and py.predicted(fs, node):
            return None
        if (fs.mountpoint, node.ino) in self._elf_seen:
            return AHEAD_FOLLOW_DELAY
        return 0.0

    def _elf_deps(self, stack: list[str], fs: Any, data: bytes, depth: int) -> None:
        """Fetch the interpreter and libraries of the ELF ``data`` (fetched on ``fs``'s layer)
        that the stack ``stack`` (bottom to top) holds, each in its own background load, and,
        ``depth`` levels down, theirs (``runtime_shim.lazyfs.elfdeps``)."""
        from runtime_shim.lazyfs.elfdeps import Stack

        layers = self._stack_layers(stack) or [fs]
        try:
            deps = Stack(layers).dependencies(data)
        except Exception:  # noqa: BLE001 - a hint only: the loader's own opens fetch them
            log.exception("ELF dependencies in %s", fs.lazy_layer.digest)
            return
        for ops, node in deps:
            key = (ops.mountpoint, node.ino)
            with self.lock:
                if key in self._elf_seen or len(self._elf_seen) > 100_000:
                    continue
                self._elf_seen.add(key)
            self.elf_pool.submit(self._elf_load, stack, ops, node, depth)

    def _elf_load(self, stack: list[str], ops: Any, node: Any, depth: int) -> None:
        if not node.read_path or node.size > ELF_PREFETCH_MAX:
            return
        try:
            cached = _cached_path(ops, node)
            if cached is not None and depth <= 1:   # on the node already: nothing to fetch
                return
            data = _node_bytes(ops, node, cached)
        except EnvbuildError as e:  # its own open reports it
            log.warning("fetch ahead %s of %s: %s", node.read_path, ops.lazy_layer.digest, e)
            return
        if depth > 1 and data[:4] == b"\x7fELF":
            self._elf_deps(stack, ops, data, depth - 1)

    def _start_startup(self, req: dict[str, Any]) -> dict[str, Any]:
        """``{"op": "startup", "mountpoints": [bottom .. top], "env": {...}}``: fetch in the
        background the files a container start and a program's libc start-up read in that
        stack under the lock's environment ``env`` (``runtime_shim.lazyfs.startup``)."""
        mps, env, cmd = req.get("mountpoints"), req.get("env"), req.get("cmd") or []
        if not isinstance(mps, list) or not isinstance(env, dict) or len(mps) > 1024 \
                or not isinstance(cmd, list):
            return {"ok": False, "error": "startup: mountpoints (a list), env (a map), cmd "
                                          "(a list)"}
        env = {str(k): str(v) for k, v in list(env.items())[:4096]
               if isinstance(k, str) and isinstance(v, str)}
        program = cmd[0] if cmd and isinstance(cmd[0], str) else ""
        with self.lock:
            layers = [self.ops.get(mp) for mp in reversed(mps) if isinstance(mp, str)]
        layers = [x for x in layers if x is not None and hasattr(x, "lazy_frames")]
        if layers:
            self.elf_pool.submit(self._startup, layers, env, program)
        return {"ok": True, "layers": len(layers)}

    def _startup(self, layers: list[Any], env: dict[str, str], program: str = "") -> None:
        import time

        from runtime_shim.lazyfs.elfdeps import Stack
        from runtime_shim.lazyfs.startup import startup_files

        t0 = time.monotonic()
        st = Stack(layers)
        try:
            hits = startup_files(st, env)
        except Exception:  # noqa: BLE001 - a hint only: the opens fetch them anyway
            log.exception("start-up files")
            return
        by_ops: dict[int, tuple[Any, list[Any]]] = {}
        for ops, node in hits:
            if _cached_path(ops, node) is not None:
                continue   # on the node already
            with self.lock:
                if len(self._elf_seen) <= 100_000:
                    self._elf_seen.add((ops.mountpoint, node.ino))
            by_ops.setdefault(id(ops), (ops, []))[1].append(node)
        for ops, nodes in by_ops.values():   # one load per layer: adjacent frames merged
            self.elf_pool.submit(self._startup_load, ops, nodes)
        log.info("start-up files: %d (%d to fetch) found in %.3f s", len(hits),
                 sum(len(n) for _, n in by_ops.values()), time.monotonic() - t0)
        stack = [ops.lazy_layer.digest for ops in reversed(layers)]
        if self.pyahead is not None and PY_STARTUP:
            self._python_startup(stack, st, layers, env)
        if program:   # then the lock's command, its interpreter and their loader files
            self.elf_pool.submit(self._command_load, stack, layers, env, program,
                                 startup.MAX_SCRIPT_HOPS)

    def _python_startup(self, stack: list[str], st: Any, layers: list[Any],
                        env: dict[str, str]) -> None:
        """Predict, at create, the start-up files of the stack's Python: the interpreter
        ``python3`` on the lock's ``PATH`` (``encodings``, ``sitecustomize``, the site
        directories' ``.pth`` files) and each venv near the root (``startup.venv_configs``:
        its ``pyvenv.cfg``, its ``.pth`` files and their imports). Every Python program's
        start opens them one after the other, each a serial miss on a cold node (the
        cold_start workload: ~12 of them, 12–39 ms each, over its first two commands);
        predicted at the interpreter's first open, they were still in flight when asked.
        ``st``: the stack's ``elfdeps.Stack``, as the start-up files were looked up in."""
        py = self.pyahead
        assert py is not None
        hits = [startup.command_file(st, env, "python3")]
        hits += [st.lookup(path) for path in startup.venv_configs(layers)]
        n = 0
        for hit in hits:
            if hit is not None:
                n += py.expect(stack, *hit)
        log.info("python start-up: %d interpreters and venvs predicted", n)

    def _command_load(self, stack: list[str], layers: list[Any], env: dict[str, str],
                      program: str, hops: int) -> None:
        """Fetch the file ``program`` runs in the stack (``startup.command_file``); a
        script's ``#!`` interpreter in turn (``hops`` more), a program's loader files."""
        from runtime_shim.lazyfs.elfdeps import Stack

        hit = startup.command_file(Stack(layers), env, program)
        if hit is None:
            return
        ops, node = hit
        key = (ops.mountpoint, node.ino)
        with self.lock:
            if key in self._elf_seen or len(self._elf_seen) > 100_000:
                return
            self._elf_seen.add(key)
        if not node.read_path or node.size > ELF_PREFETCH_MAX:
            return
        try:
            data = _node_bytes(ops, node, _cached_path(ops, node))
        except (EnvbuildError, OSError) as e:  # its own open reports it
            log.warning("fetch ahead %s of %s: %s", node.read_path, ops.lazy_layer.digest, e)
            return
        interp = startup.shebang(data[:startup.SHEBANG_MAX])
        if interp and hops > 0:
            self._command_load(stack, layers, env, interp, hops - 1)
        elif data[:4] == b"\x7fELF":
            self._elf_deps(stack, ops, data, ELF_DEPTH)

    def _startup_load(self, ops: Any, nodes: list[Any]) -> None:
        try:
            ops.lazy_frames.load(nodes, wait=False, ahead=True)
        except EnvbuildError as e:  # their own opens report it
            log.warning("fetch ahead of start-up files of %s: %s", ops.lazy_layer.digest, e)

    def _start_prefetch(self, req: dict[str, Any]) -> dict[str, Any]:
        started = 0
        key = req.get("key")
        if isinstance(key, str):
            with self.lock:   # the stack has a profile: its mounts' reads need no saving
                rec = self.profiles.get(key)
                if rec is not None:
                    rec["saved"] = True
        for item in req.get("layers", ()):
            with self.lock:
                ops = self.ops.get(item["mountpoint"])
            if ops is not None and item.get("paths"):
                threading.Thread(target=self._prefetch,
                                 args=(ops, item["paths"], ops.lazy_layer.digest),
                                 name="prefetch", daemon=True).start()
                started += 1
        return {"ok": True, "started": started}

    def _prefetch(self, ops: Any, paths: Sequence[str], digest: str) -> None:
        import time

        t0 = time.monotonic()
        try:
            n = prefetch_in_order(ops.lazy_frames, ops.lazy_nodes, paths)
        except EnvbuildError as e:  # a foreground read will report it
            log.warning("prefetch of %s: %s", digest, e)
            return
        log.info("prefetched %d of %d profiled files of %s in %.2f s", n, len(paths), digest,
                 time.monotonic() - t0)

    def _trace(self, prof: dict[str, Any], digest: str) -> _Trace:
        import time

        with self.lock:
            rec = self.profiles.get(prof["key"])
            if rec is None:
                rec = self.profiles[prof["key"]] = {
                    "req": prof, "traces": {}, "saved": False,
                    "until": time.monotonic() + PROFILE_WINDOW}
                timer = threading.Timer(PROFILE_WINDOW, self._save_profile, (prof["key"],))
                timer.daemon = True
                timer.start()
            trace = rec["traces"][digest] = _Trace(rec["until"])
        return trace

    def _save_profile(self, key: str) -> None:
        with self.lock:
            rec = self.profiles.get(key)
            if rec is None or rec["saved"]:
                return
            rec["saved"] = True
        prof, traces = rec["req"], rec["traces"]
        with self.lock:
            layers = [{"digest": d, "files": list(traces[d].paths)}
                      for d in prof["layers"] if d in traces]
        if not any(x["files"] for x in layers):
            return
        record = {"version": PROFILE_VERSION, "layers": layers}
        files = sum(len(x["files"]) for x in layers)
        put_url = prof.get("put_url")
        if isinstance(put_url, str) and put_url:
            # a presigned PUT (``Presigner``): no store client in this process (boto3's would
            # hold the GIL for ~0.4 s while every FUSE request of the node waits)
            from envbuild.store._http import put_bytes
            from envbuild.store.base import StoreError, encode_record

            try:
                got = put_bytes(put_url, encode_record(record))
            except StoreError as e:
                log.warning("save lazy profile %s: %s", key, e)
                return
            if 200 <= got.status < 300:
                log.info("saved lazy profile %s (%d files) through its presigned URL", key,
                         files)
                return
            log.warning("save lazy profile %s through its presigned URL: %s; through the "
                        "store instead", key, got.error or f"HTTP {got.status}")
        try:
            store = self._store(prof["store"], prof.get("s3_endpoint"))
            store.put_record(PROFILE_NAMESPACE, key, record)
        except Exception as e:  # noqa: BLE001 - a hint only; never take a mount down for it
            log.warning("save lazy profile %s: %s", key, e)
            return
        log.info("saved lazy profile %s (%d files)", key, files)

