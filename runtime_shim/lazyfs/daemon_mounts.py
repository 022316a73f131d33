"""The node daemon's mounts: where, in which mode, and the bookkeeping as they come and go.

Where a layer may be mounted (``owned_mountpoint``), how its reads are served
(``MODE_PASSTHROUGH`` where the kernel offers it, else ``MODE_FUSE``), opening the layer and
charging its tree before anything is mounted, one thread per mount serving it, and the
daemon's tables when it goes away."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envbuild.errors import EnvbuildError
from envbuild.store.lazy import HttpRanges, LazyLayer
from runtime_shim.lazyfs.daemon_ahead import ELF_DEPTH
from runtime_shim.lazyfs.daemon_memory import _settle_heap
from runtime_shim.lazyfs.filecache import BoundedRanges
from runtime_shim.lazyfs.fuseops import CACHE_TTL, make_operations
from runtime_shim.lazyfs.profile import _Trace
from runtime_shim.lazyfs.tree import Node, tree_of

log = logging.getLogger("envbuild.lazyfs")

#: Values of ``mode`` (ping reply, ``lazy/daemon.json``, each mount's state): how reads of
#: fetched files are served.
MODE_PASSTHROUGH = "passthrough"   # the kernel reads the node's file cache (passthrough.py)
MODE_FUSE = "fuse"                 # every read through the libfuse filesystem (fuseops.py)


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


def _serve(box: list[Any]) -> None:
    """A mount's thread: run its serving function, whose closure holds the layer's tree, and
    drop it when the mount is gone (``box`` holds the only other reference), so that the
    daemon's next heap release (``_NodeDaemon.serve``) finds the tree unreachable."""
    serve = box.pop()
    serve()


def _error(e: EnvbuildError) -> dict[str, Any]:
    return {"ok": False, "error": "\n".join(e.render_lines())}


class _Mounts:
    """The node daemon's part (a mixin of ``_NodeDaemon``) that mounts layers (the ``mount``
    request) and keeps its tables (``mounts``, ``ops``, ``by_digest``, ``threads``) as they
    come and go. Uses the daemon's caches, limits, pools and the other parts' hooks."""

    root: str
    lock: threading.Lock
    mode: str
    mode_reason: str
    cache: Any
    files: Any
    limits: Any
    metaserver: Any
    pyahead: Any
    open_workers: ThreadPoolExecutor
    elf_pool: ThreadPoolExecutor
    mounts: dict[int, str]
    ops: dict[str, Any]
    by_digest: dict[str, Any]
    threads: list[threading.Thread]
    heap_dirty: float
    last: float
    _next: int
    _elf_seen: set[tuple[str, int]]
    _store: Callable[[str, str | None], Any]
    _charge_tree: Callable[[str, int], int]
    _uncharge_tree: Callable[[int], None]
    _trace: Callable[[dict[str, Any], str], _Trace]
    _save_profile: Callable[[str], None]
    _elf_deps: Callable[[list[str], Any, bytes, int], None]
    _follow_delay: Callable[[Any, Any], float | None]
    _read_index: Callable[[Any, dict[str, Any]], None]

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

    def _mount(self, req: dict[str, Any]) -> dict[str, Any]:
        import time

        digest = req.get("digest")
        try:
            mp = owned_mountpoint(self.root, digest, req.get("mountpoint"))
        except EnvbuildError as e:
            log.warning("refused a mount: %s", e.message)
            return _error(e)
        assert isinstance(digest, str)   # owned_mountpoint checked it
        ready = threading.Event()
        t0 = time.monotonic()
        phases: dict[str, float] = {}
        try:
            layer = self._open_layer(req, digest)
            phases["open"] = time.monotonic() - t0
            charge = self._charge_tree(digest, len(layer.reader.toc.entries))
        except EnvbuildError as e:
            log.error("serve %s: %s", digest, e.message)
            return _error(e)
        try:
            nodes = tree_of(layer.reader)
            phases["tree"] = time.monotonic() - t0
            _settle_heap()
            prof = req.get("profile")
            trace = self._trace(prof, digest) if prof else None
            ops = self._operations(layer, nodes, mp, prof, trace, ready)
        except EnvbuildError as e:
            self._uncharge_tree(charge)
            log.error("serve %s: %s", digest, e.message)
            return _error(e)
        failed = self._start_serving(layer, nodes, mp, ops, prof, charge, ready)
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

    def _open_layer(self, req: dict[str, Any], digest: str) -> LazyLayer:
        """The layer a ``mount`` request names, opened (footer, TOC) through the node's fetch
        bound: an error here is a reply, never a mount."""
        url, endpoint = req["store"], req.get("s3_endpoint")
        if req.get("ranges_url"):  # the full store (boto3) only if the URL stops working
            store = HttpRanges(digest, req["ranges_url"], lambda: self._store(url, endpoint))
        else:
            store = self._store(url, endpoint)
        return LazyLayer(BoundedRanges(store, self.limits), digest, chunk_cache=self.cache,
                         expected_toc_digest=req.get("toc_digest") or None,
                         size=req.get("size"))

    def _operations(self, layer: LazyLayer, nodes: dict[str, Node], mp: str,
                    prof: dict[str, Any] | None, trace: _Trace | None,
                    ready: threading.Event) -> Any:
        """The filesystem serving ``layer`` at ``mp`` in the daemon's mode: a passthrough
        mount (mounted here) or the libfuse ``Operations`` (mounted by its thread)."""
        if self.mode != MODE_PASSTHROUGH:
            return make_operations(layer, nodes, on_init=ready.set, trace=trace,
                                   limits=self.limits)
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
        return ops

    def _start_serving(self, layer: LazyLayer, nodes: dict[str, Node], mp: str, ops: Any,
                       prof: dict[str, Any] | None, charge: int,
                       ready: threading.Event) -> list[str]:
        """Serve the mount in a thread of its own until it goes away; returns the list its
        failure to mount is put in (``ready`` is set either way)."""
        failed: list[str] = []
        digest = layer.digest
        with self.lock:
            self._next += 1
            key = self._next
            self.mounts[key] = mp

        def run() -> None:
            log.info("serving %s (%d entries, TOC %d bytes) at %s (%s)", digest, len(nodes),
                     layer.stats.toc_bytes, mp, self.mode)
            try:
                self._run_mount(ops, mp, digest)
            except BaseException as e:  # noqa: BLE001 - reported to the client
                failed.append(f"mount {mp}: libfuse failed ({e})")
            finally:
                if prof:
                    self._save_profile(prof["key"])
                self._uncharge_tree(charge)
                self._unmounted(key, mp, digest, ops)
                ready.set()
                log.info("unmounted %s; stats %s%s", mp, json.dumps(layer.stats.as_dict()),
                         "" if self.pyahead is None else
                         f"; import prediction {json.dumps(self.pyahead.snapshot())}")

        t = threading.Thread(target=_serve, args=([run],),
                             name=f"fuse-{digest[7:19]}", daemon=True)
        with self.lock:
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        t.start()
        return failed

    def _run_mount(self, ops: Any, mp: str, digest: str) -> None:
        """Serve the mount ``ops`` at ``mp`` until it goes away (the mount's thread)."""
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

    def _unmounted(self, key: int, mp: str, digest: str, ops: Any) -> None:
        """The mount ``key`` of ``digest`` at ``mp`` is gone: out of the tables, its tree's
        memory to give back (``heap_dirty``), its readahead stopped."""
        import time

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
