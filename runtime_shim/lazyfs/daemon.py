"""The node daemon: one process per node cache serving every lazy layer of the host, each its
own FUSE mount (protocol: ``runtime_shim.lazyfs.control``).

``_NodeDaemon`` is made of parts, one concern each: its control requests
(``daemon_requests``), its mounts (``daemon_mounts``), its fetches ahead of the readers
(``daemon_ahead``), its lazy profiles (``daemon_profiles``) and its memory — GC, malloc and
the trees' budget (``daemon_memory``). This module holds the process: its state, the accept
loop on the control socket, and the shutdown."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from envbuild.errors import EnvbuildError
from envbuild.store.lazy import ChunkCache, MemoryChunkCache
from runtime_shim.lazyfs.chunks import TieredChunkCache
from runtime_shim.lazyfs.control import DAEMON_IDLE_EXIT, ControlListener, trusted_uids
from runtime_shim.lazyfs.daemon_ahead import (
    AHEAD_FOLLOW_DELAY,
    ELF_DEPTH,
    ELF_PREFETCH_MAX,
    ELF_WORKERS,
    PY_STARTUP,
    _FetchAhead,
)
from runtime_shim.lazyfs.daemon_memory import (
    _GC_PAUSES,
    DEFAULT_TREE_BUDGET,
    GC_GEN0_THRESHOLD,
    HEAP_RELEASE_DELAY,
    MALLOC_ARENA_MAX,
    MALLOC_MMAP_THRESHOLD,
    MALLOC_TOP_PAD,
    MALLOC_TRIM_THRESHOLD,
    SWITCH_INTERVAL,
    TREE_BUDGET_ENV,
    TREE_BYTES_PER_ENTRY,
    _GcPauses,
    _release_heap,
    _settle_heap,
    _TreeBudget,
    tune_malloc,
)
from runtime_shim.lazyfs.daemon_mounts import (
    MODE_FUSE,
    MODE_PASSTHROUGH,
    _Mounts,
    owned_mountpoint,
)
from runtime_shim.lazyfs.daemon_profiles import _Profiles
from runtime_shim.lazyfs.daemon_requests import _refuse, _Requests
from runtime_shim.lazyfs.filecache import FetchLimits, FetchSettings, FileCache

log = logging.getLogger("envbuild.lazyfs")

__all__ = [
    "AHEAD_FOLLOW_DELAY", "DEFAULT_TREE_BUDGET", "ELF_DEPTH", "ELF_PREFETCH_MAX", "ELF_WORKERS",
    "GC_GEN0_THRESHOLD", "HEAP_RELEASE_DELAY", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD",
    "MALLOC_TOP_PAD", "MALLOC_TRIM_THRESHOLD", "MODE_FUSE", "MODE_PASSTHROUGH", "PY_STARTUP",
    "SWITCH_INTERVAL", "TREE_BUDGET_ENV", "TREE_BYTES_PER_ENTRY", "_GcPauses", "_NodeDaemon",
    "_release_heap", "_settle_heap", "owned_mountpoint", "tune_malloc",
]


class _NodeDaemon(_Requests, _Mounts, _FetchAhead, _Profiles, _TreeBudget):
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
        try:
            self._accept(listener)
        finally:
            listener.close()
        self._shut_down()
        log.info("lazy layer daemon of %s exits", self.root)
        return 0

    def _accept(self, listener: ControlListener) -> None:
        """Answer control connections (each in a thread of its own) from trusted peers until
        told to stop or idle for ``DAEMON_IDLE_EXIT`` s; meanwhile give an ended mount's
        memory back (``HEAP_RELEASE_DELAY`` after the last end)."""
        import time

        self.last = time.monotonic()
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
                # answered on a thread of its own: it reads the refused request first (up to
                # 1 s), which must not hold up the accept loop
                threading.Thread(target=_refuse, args=(
                    conn, f"permission denied: uid {uid} may not use this daemon"),
                    daemon=True).start()
                continue
            with self.lock:
                self.busy += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _shut_down(self) -> None:
        """Unmount everything when told to stop (a signal), then wait a little for the
        mounts' threads and close the metadata server."""
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
