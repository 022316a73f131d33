"""Meta layers: files already on the node served by overlayfs alone, with no FUSE round trip.

A lazy layer is a FUSE mount (``runtime_shim.lazyfs.passthrough``): even once a file's bytes
are in the node's file cache (``<node>/files/<hex>``), every ``open`` of it asks the daemon
for the passthrough backing fd (~26 µs against ~8 µs for an unpacked dir). The composefs
model removes that round trip for the files already fetched: for each lazy layer the daemon
builds a *meta tree* — a directory tree with, for every regular file of the layer whose
verified contents are in the file cache, a sparse file of the same size and metadata (mode,
owner, mtime, xattrs, hardlinks as one inode) carrying ``trusted.overlay.metacopy`` and a
``trusted.overlay.redirect`` to ``/<hex>`` — and mounts it once per node as a read-only
overlay with the cache as a data-only lower layer::

    <node>/meta/trees/<layer hex>/g-<key>  the meta tree (directories + metacopy files), on
                                           the node's tree tmpfs (``TREES``)
    <node>/meta/<layer hex>/g-<key>/data   hardlinks to files/<hex>: the data-only layer
                                    mnt    overlay lowerdir=TREE::data, ro, metacopy=on
    <node>/meta/<layer hex>/current.json   {"version": 1, "gen": "g-<key>", "digests": [...]}

The sandbox's overlay then takes ``mnt`` as an extra lower dir *directly above* the layer's
FUSE mount (``lazy_layer_dirs``): a lookup of a fetched file stops at ``mnt`` (a regular file
ends an overlay lookup), its opens and reads are the kernel's (two overlays over ext4); every
other name — unfetched files, symlinks, devices, whiteouts, directories' other entries —
falls through to the FUSE mount as before. The pair sits where the layer sat, so whiteouts
and opaque directories of the layers above hide its files exactly as before, and the layer's
own opaque directories (on its FUSE mount, below ``mnt``) still end the merge below it.

Why a nested overlay and not metacopy files straight in the sandbox's overlay: following
``metacopy`` needs ``metacopy=on`` on that overlay, which the kernel only allows with
``redirect_dir=on`` when there is an upper dir — both make copy-ups write metadata-only files
and directory redirects into the sandbox's upper dir, which would then no longer be a plain
diff (``runtime_shim.isolation.mount.OVERLAY_PLAIN_OPTIONS``). The inner overlay has no upper dir, so
``metacopy=on,redirect_dir=follow`` only *reads* redirects, and the sandbox's overlay keeps its
plain options: a copy-up out of ``mnt`` copies the data. Stacking depth: the FUSE mount is 1
(passthrough), ``mnt`` is 1 (over ext4), the sandbox's overlay is 2, the kernel's limit. The
inner overlay has no other lower layer, so an absolute redirect cannot be answered by a name
in some other layer (with the meta tree in the sandbox's overlay, a lower layer's root file
named ``<hex>`` would have been taken as the data of an upper layer's file).

Generations: the tree is built once per (layer, set of fetched files) and shared read-only by
every later sandbox. The next generation (``key`` = hash of the digest set) is built by the
daemon in the background when a lazy sandbox closes (``refresh_soon``) or once fetches have
been quiet for ``REFRESH_QUIET`` s, or when a create finds new verified files and no fetch in
flight (during a burst's fetches nothing is built). A create never builds, nor waits for a
build that is running or promised (a sandbox just closed): it takes the generation there is,
or the FUSE mount alone for a layer that has none yet, and starts the build it found due in
the background — the next create gets the new generation. A closing sandbox waits (at most
``CLOSE_WAIT`` s) for the build its close started, so that the next create finds it done. The
data
dir holds hardlinks, so the file cache's eviction cannot pull a file from under a live
generation. A superseded generation no mount refers to is unmounted and deleted
after ``GRACE`` s (``collect``); the node's eviction (``NodeCache.unmount_lazy``) removes at
once those no mount refers to, and every generation of a layer no live sandbox uses.

Hostile layers: the tree holds only directories and regular files this module creates under
names checked one component at a time (no ``""``, ``.``, ``..``, NUL, or more than 255 bytes;
a path longer than ``MAX_PATH`` is skipped), so nothing can leave the tree; the TOC's
``trusted.overlay.*`` xattrs are never copied (the inner overlay would follow them); a file
whose metadata cannot be set is left to the FUSE mount. Building is linear in the fetched
files (``$ENVBUILD_LAZY_METALAYER=off`` disables it all).

Where the parts live: planning and building a tree in ``metatree``; the generations on disk
(layout, mounts, locks, removal) in ``metagen``; here the daemon's side (``MetaLayers``, the
``meta`` request) and the client's (``meta_dirs``, ``refresh_soon``), and this module
re-exports the others' public names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from envbuild.atomic import write_atomic
from envbuild.oci import is_hex64
from runtime_shim.lazyfs.metagen import (
    META_VERSION,
    TREES,
    TREES_OPTIONS,
    _ensure_trees,
    _is_mount,
    _layer_flock,
    _mount_gen,
    _read_current,
    _remove_generation,
    _tree_of,
    _valid,
    collect,
    mount_generation,
    remove_unused,
)
from runtime_shim.lazyfs.metatree import (
    MAX_PATH,
    METACOPY_XATTR,
    REDIRECT_XATTR,
    MetaEntry,
    build,
    plan,
    safe_path,
)

log = logging.getLogger("envbuild.lazyfs")

#: ``off`` disables meta layers (sandboxes get the FUSE mounts only); ``on``/unset uses them.
ENV_SWITCH = "ENVBUILD_LAZY_METALAYER"
#: The daemon's background refresh: how often it looks, and how long fetches must have been
#: quiet (a create builds as soon as no fetch is in flight; in the background a build would
#: compete with a running workload for CPU).
REFRESH_EVERY = 1.0
REFRESH_QUIET = 2.0
#: How long a closing lazy sandbox waits for the meta build of what it fetched (then the
#: build goes on in the background; the next create takes the generation there is).
CLOSE_WAIT = 2.0
#: Layers built at once after a sandbox closed (``refresh_now``): one — three at once took as
#: long in all (the GIL) and competed more with the FUSE threads serving the next sandbox.
REFRESH_WORKERS = 1
#: A superseded generation no mount refers to is removed by later builds after this long.
GRACE = 60.0


def enabled() -> bool:
    """Whether sandboxes get meta layers (``$ENVBUILD_LAZY_METALAYER`` is not ``off``)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() not in ("off", "0", "no", "false")


def describe(node_root: str | os.PathLike[str]) -> list[str]:
    """``envbuild node ls``: one line per layer with a meta layer (its current generation,
    how many files it serves, whether it is mounted), then the switch if it is off."""
    meta = os.path.join(os.fspath(node_root), "meta")
    lines = []
    try:
        names = sorted(n for n in os.listdir(meta) if is_hex64(n))
    except FileNotFoundError:
        names = []
    for hexd in names:
        current = _read_current(os.path.join(meta, hexd))
        if current is None:
            continue
        gen_dir = os.path.join(meta, hexd, current[0])
        state = "mounted" if _is_mount(os.path.join(gen_dir, "mnt")) else "not mounted"
        lines.append(f"meta sha256:{hexd}  {current[0]}, {len(current[1])} files, {state}")
    if not enabled():
        lines.append(f"meta layers: off (${ENV_SWITCH})")
    return lines





class MetaLayers:
    """The daemon's meta layers (one per node daemon): ``request`` answers the ``meta``
    control request — for each lazy layer, the ``mnt`` of its current generation, built or
    refreshed first when new files of the layer were verified and fetches have settled."""

    def __init__(self, root: str, files: Any) -> None:
        self.root = root
        self.files = files  # FileCache: verified digests, the directory
        self._lock = threading.Lock()
        self._layer_locks: dict[str, threading.Lock] = {}
        # layers a background build was promised for (``refresh_now``): a create takes the
        # generation there is instead of building (or waiting for) the same one itself
        self._pending: set[str] = set()
        # per mount (dropped with it): digest of each regular inode, and their set
        self._digests: weakref.WeakKeyDictionary[Any, tuple[dict[int, str], frozenset[str]]] = \
            weakref.WeakKeyDictionary()

    def _layer_lock(self, hexd: str) -> threading.Lock:
        with self._lock:
            return self._layer_locks.setdefault(hexd, threading.Lock())

    def _layer_digests(self, ops: Any) -> tuple[dict[int, str], frozenset[str]]:
        """Digest of each regular inode of a mount (by ``id(node)``), computed once per mount."""
        with self._lock:
            got = self._digests.get(ops)
        if got is not None:
            return got
        by_node: dict[int, str] = {}
        for node in ops.lazy_nodes.values():
            if stat.S_ISREG(node.mode) and id(node) not in by_node:
                by_node[id(node)] = node.digest  # the TOC's, on the node: no Entry decode
        digests = frozenset(d for d in by_node.values() if d)
        with self._lock:
            self._digests[ops] = (by_node, digests)
        return by_node, digests

    def request(self, ops_of: Callable[[str], Any], req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        out = []
        stale: list[tuple[str, Any]] = []
        for item in req.get("layers", ()):
            try:
                mp = str(item["mountpoint"])
                ops = ops_of(mp)
                # a build is due only once fetches have been quiet (as for the background
                # refresh): the files this very create fetches ahead (startup.py) land while
                # it runs, and a build then would compete with its container and first command
                out.append(self.layer(ops, str(item["digest"]), mp, quiet=REFRESH_QUIET,
                                      build=False))
                if out[-1].pop("stale", False):
                    stale.append((mp, ops))
            except Exception as e:  # noqa: BLE001 - a meta layer is an optimisation only
                log.warning("meta layer of %s: %s", item.get("digest"), e)
                out.append({"digest": item.get("digest"), "dir": "", "files": 0,
                            "error": str(e)})
        if stale:   # new files on the node: built for the next create, not this one
            self.promise(ops.lazy_layer.digest for _, ops in stale)
            threading.Thread(target=self.refresh_now, args=(stale,), name="meta-refresh-new",
                             daemon=True).start()
        # a create waits for this answer: how long it took is part of the create's time
        log.info("meta request: %d layers (%d with a meta layer, %d to build) in %.3f s",
                 len(out), sum(1 for x in out if x.get("dir")), len(stale),
                 time.monotonic() - t0)
        return {"ok": True, "layers": out}

    def building(self) -> int:
        """How many layers have a build running or promised (the daemon's ping reply)."""
        with self._lock:
            return len(self._pending) + sum(lk.locked() for lk in self._layer_locks.values())

    def promise(self, digests: Iterable[str]) -> None:
        """A background build of these layers is coming (``refresh_now``): until it ran, a
        create takes the generation there is rather than building the same one itself."""
        with self._lock:
            self._pending.update(d.removeprefix("sha256:") for d in digests)

    def layer(self, ops: Any, digest: str, mountpoint: str, *, quiet: float = 0.0,
              promised: bool = False, build: bool = True) -> dict[str, Any]:
        """The current generation of layer ``digest`` served by ``ops`` (the ``Operations``
        of its mount at ``mountpoint``), built first if new files were fetched and none for
        ``quiet`` seconds and none is in flight. Never waits for another build: while one of
        the layer runs, or is promised (``promise``; ``promised``: this is that build), the
        answer is at once the generation there is (none: the FUSE mount alone) — a create
        right after a sandbox closed must not pay for the build its close started.
        ``build=False`` (a create): never build here; the reply says ``stale`` when a build
        is due (the caller starts it in the background, for the next create)."""
        hexd = digest.removeprefix("sha256:")
        if not is_hex64(hexd):
            raise ValueError(f"bad layer digest {digest!r}")
        reply: dict[str, Any] = {"digest": digest, "dir": "", "files": 0, "built": False}
        if ops is None or not hasattr(ops, "lazy_nodes"):
            return reply
        layer_dir = os.path.join(self.root, "meta", hexd)
        lock = self._layer_lock(hexd)
        with self._lock:
            elsewhere = hexd in self._pending and not promised
        if elsewhere or not lock.acquire(blocking=False):
            current = _read_current(layer_dir)  # being (re)built: the one there is
            if current is not None and _valid(os.path.join(layer_dir, current[0])) \
                    and _is_mount(os.path.join(layer_dir, current[0], "mnt")):
                reply.update(dir=os.path.join(layer_dir, current[0], "mnt"),
                             files=len(current[1]), generation=current[0])
            return reply
        try:
            if promised:
                with self._lock:
                    self._pending.discard(hexd)
            with _layer_flock(self.root, "gc", shared=True), _layer_flock(self.root, hexd):
                if not _is_mount(mountpoint):  # unmounted meanwhile (the node's eviction)
                    return reply
                return self._layer(ops, hexd, layer_dir, quiet, reply, build)
        finally:
            lock.release()

    def _layer(self, ops: Any, hexd: str, layer_dir: str, quiet: float,
               reply: dict[str, Any], build: bool = True) -> dict[str, Any]:
        by_node, layer_set = self._layer_digests(ops)
        current = _read_current(layer_dir)
        have: frozenset[str] = frozenset()
        if current is not None:
            gen_dir = os.path.join(layer_dir, current[0])
            if _valid(gen_dir):
                if not _is_mount(os.path.join(gen_dir, "mnt")):
                    _mount_gen(gen_dir)  # e.g. after the daemon's restart
                have = current[1]
            else:
                current = None
        verified = self.files.verified() & layer_set
        wanted = have | verified
        # settled: no file being fetched now (a create during a burst's fetches builds
        # nothing), and none landed for ``quiet`` s (a fetch renames a file into the cache
        # dir: its mtime is the last one)
        try:
            settled = not self.files.fetching() and (
                not quiet or time.time() - os.stat(self.files.dir).st_mtime >= quiet)
        except OSError:
            settled = False
        if wanted != have and wanted and settled and not build:
            reply["stale"] = True
        elif wanted != have and wanted and settled:
            t0 = time.monotonic()
            gen = self._build(layer_dir, ops, by_node, wanted, current)
            reply["built"], reply["seconds"] = True, round(time.monotonic() - t0, 4)
            current = (gen, wanted)
        if current is not None:
            reply["dir"] = os.path.join(layer_dir, current[0], "mnt")
            reply["files"] = len(current[1])
            reply["generation"] = current[0]
        return reply

    def _build(self, layer_dir: str, ops: Any, by_node: dict[int, str],
               wanted: frozenset[str], current: tuple[str, frozenset[str]] | None) -> str:
        key = hashlib.sha256("\n".join(sorted(wanted)).encode()).hexdigest()[:16]
        gen = f"g-{key}"
        gen_dir = os.path.join(layer_dir, gen)
        if _valid(gen_dir):  # built before (e.g. by a daemon that died since)
            if not _is_mount(os.path.join(gen_dir, "mnt")):
                _mount_gen(gen_dir)
        else:
            t0 = time.monotonic()
            if os.path.isdir(gen_dir):  # its tree is gone (the tmpfs was unmounted)
                _remove_generation(gen_dir)
            _ensure_trees(os.path.dirname(layer_dir))
            os.makedirs(layer_dir, mode=0o700, exist_ok=True)
            tmp = os.path.join(layer_dir, f".tmp-{uuid.uuid4().hex[:12]}")
            os.mkdir(tmp, 0o700)
            os.makedirs(_tree_of(tmp), mode=0o700)
            try:
                for sub in ("data", "mnt"):
                    os.mkdir(os.path.join(tmp, sub), 0o700)
                dirs, files = plan(ops.lazy_nodes, lambda n: by_node.get(id(n), ""), wanted)
                old_data = os.path.join(layer_dir, current[0], "data") if current else None

                def sources(hexd: str) -> list[str]:
                    own = [os.path.join(old_data, hexd)] if old_data else []
                    return own + [os.path.join(self.files.dir, hexd)]

                placed = build(_tree_of(tmp), os.path.join(tmp, "data"), dirs, files, sources)
                os.rename(_tree_of(tmp), _tree_of(gen_dir))
                os.rename(tmp, gen_dir)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(_tree_of(tmp), ignore_errors=True)
                raise
            _mount_gen(gen_dir)
            log.info("meta layer %s of %s: %d files (%d dirs) in %.3f s", gen,
                     os.path.basename(layer_dir)[:12], placed, len(dirs), time.monotonic() - t0)
        doc = {"version": META_VERSION, "gen": gen, "digests": sorted(wanted)}
        write_atomic(os.path.join(layer_dir, "current.json"), json.dumps(doc))
        collect(layer_dir, gen, grace=GRACE)
        return gen


    def refresh_now(self, mounts: list[tuple[str, Any]]) -> None:
        """Build the next generation of every mounted layer that has new files (a lazy sandbox
        just closed: its fetches are done), ``REFRESH_WORKERS`` layers at a time (one: more
        at once took as long in all, under the GIL), the largest first, so the window in which
        a create gets the FUSE mount alone is short."""
        from concurrent.futures import ThreadPoolExecutor

        def one(item: tuple[str, Any]) -> None:
            mp, ops = item
            try:
                self.layer(ops, ops.lazy_layer.digest, mp, promised=True)
            except Exception as e:  # noqa: BLE001 - the next create tries again
                log.warning("meta layer refresh of %s: %s", mp, e)
            finally:
                with self._lock:
                    self._pending.discard(ops.lazy_layer.digest.removeprefix("sha256:"))

        # the largest layers first: they take longest
        order = sorted(mounts, key=lambda m: -len(getattr(m[1], "lazy_nodes", ())))
        with ThreadPoolExecutor(max(1, min(REFRESH_WORKERS, len(order))),
                                thread_name_prefix="meta-build") as pool:
            list(pool.map(one, order))

    def refresh(self, mounts: Callable[[], list[tuple[str, Any]]],
                stopped: Callable[[], bool]) -> None:
        """Background (a daemon thread, from the first ``meta`` request on): every
        ``REFRESH_EVERY`` s, build the next generation of each mounted layer whose fetches
        have been quiet for ``REFRESH_QUIET`` s, so the next create finds it ready."""
        seen: tuple[int, float] | None = None
        while not stopped():
            time.sleep(REFRESH_EVERY)
            try:  # nothing fetched or evicted since the last look: nothing to do
                now = (len(self.files.verified()), os.stat(self.files.dir).st_mtime)
            except OSError:
                continue
            if now == seen or self.files.fetching() or time.time() - now[1] < REFRESH_QUIET:
                continue
            seen = now
            for mp, ops in mounts():
                try:
                    self.layer(ops, ops.lazy_layer.digest, mp, quiet=REFRESH_QUIET)
                except Exception as e:  # noqa: BLE001 - the next create tries again
                    log.warning("meta layer refresh of %s: %s", mp, e)


_registry: dict[str, MetaLayers] = {}
_registry_lock = threading.Lock()


def handle(daemon: Any, req: dict[str, Any]) -> dict[str, Any]:
    """The daemon's ``meta`` request (``runtime_shim.lazyfs.daemon``): in passthrough mode,
    each layer's current meta generation; on the fuse fallback there is no file cache, so
    none."""
    if getattr(daemon, "mode", "") != "passthrough":
        return {"ok": True, "layers": [{"digest": x.get("digest"), "dir": "", "files": 0}
                                       for x in req.get("layers", ())]}
    with _registry_lock:
        meta = _registry.get(daemon.root)
        if meta is None:
            meta = _registry[daemon.root] = MetaLayers(daemon.root, daemon.files)

            def mounts() -> list[tuple[str, Any]]:
                with daemon.lock:
                    return list(daemon.ops.items())
            threading.Thread(target=meta.refresh, args=(mounts, lambda: daemon.stop),
                             name="meta-refresh", daemon=True).start()

    def ops_of(mp: str) -> Any:
        with daemon.lock:
            return daemon.ops.get(mp)
    if req.get("refresh"):
        with daemon.lock:
            now = list(daemon.ops.items())
        # promised before the answer: a create meanwhile takes what there is
        meta.promise(ops.lazy_layer.digest for _, ops in now)
        t = threading.Thread(target=meta.refresh_now, args=(now,), name="meta-refresh-now",
                             daemon=True)
        t.start()
        wait = req.get("wait")
        if isinstance(wait, (int, float)) and wait > 0:   # the closing sandbox waits (bounded)
            t.join(min(float(wait), CLOSE_WAIT))
        return {"ok": True, "done": not t.is_alive()}
    return meta.request(ops_of, req)


def building(root: str) -> int:
    """Layers of the daemon of node ``root`` with a meta build running or promised (0 before
    its first ``meta`` request): the daemon's ping reply, for callers that wait for builds."""
    with _registry_lock:
        meta = _registry.get(root)
    return meta.building() if meta is not None else 0


def refresh_soon(node_root: str | os.PathLike[str], wait: float = CLOSE_WAIT) -> None:
    """Client side (a lazy sandbox closed): ask the node daemon to build the meta layers of
    what was fetched now, and wait for that build at most ``wait`` s (0: not at all) — the
    sandbox that fetched the files pays for making them fast for the next one, off any
    create's path (a create never waits for a build: it would take the FUSE mounts alone,
    and a build running beside the next sandbox's workload competed with it for the node's
    CPU). Never raises; a no-op without a daemon."""
    from runtime_shim.lazyfs.control import daemon_request

    if not enabled():
        return
    try:
        daemon_request(node_root, {"op": "meta", "refresh": True, "wait": wait}, wait + 2.0)
    except Exception as e:  # noqa: BLE001 - an optimisation only
        log.debug("meta layer refresh: %s", e)


def _tell(node_root: str | os.PathLike[str], request: dict[str, Any], timeout: float) -> None:
    from runtime_shim.lazyfs.control import daemon_request

    try:
        daemon_request(node_root, request, timeout)
    except Exception as e:  # noqa: BLE001 - a hint: nothing waits for it
        log.debug("meta layers (hint): %s", e)


def meta_dirs(node_root: str | os.PathLike[str], layers: list[tuple[str, str]],
              timeout: float = 30.0) -> list[str]:
    """Client side (``lazy_layer_dirs``): the meta layer dir of each ``(digest, mountpoint)``
    (``""`` for none), asked of the node daemon in one request. Never raises: without an
    answer every layer is served by its FUSE mount alone."""
    from runtime_shim.lazyfs.control import daemon_request

    if not enabled() or not layers:
        return ["" for _ in layers]
    request = {"op": "meta", "layers": [{"digest": d, "mountpoint": mp} for d, mp in layers]}
    root = os.path.abspath(node_root)
    if not any(os.path.isdir(os.path.join(root, "meta", d.removeprefix("sha256:")))
               for d, _ in layers):
        # No layer has a generation on disk (a stack new to the node): there is nothing to
        # serve, and waiting for the answer kept a cold create behind the daemon's work on the
        # mounts it just made (17-90 ms measured). The request still goes, unanswered here:
        # it may start a build that is due, for the next create.
        threading.Thread(target=_tell, args=(node_root, request, timeout), daemon=True,
                         name="lazy-meta-hint").start()
        return ["" for _ in layers]
    try:
        reply = daemon_request(node_root, request, timeout)
    except Exception as e:  # noqa: BLE001 - an optimisation: the FUSE mounts serve anyway
        log.warning("meta layers: %s", e)
        return ["" for _ in layers]
    got = (reply or {}).get("layers") or []
    out = []
    for i, (digest, _) in enumerate(layers):
        x = got[i] if i < len(got) and isinstance(got[i], dict) else {}
        d = x.get("dir") if x.get("digest") == digest else ""
        out.append(d if d and trusted_meta_dir(root, digest, d) else "")
    return out


def trusted_meta_dir(node_root: str, digest: str, claimed: object) -> bool:
    """Whether a meta dir the daemon named for layer ``digest`` is one to stack under a
    sandbox: exactly ``<node>/meta/<hex>/g-<16 hex>/mnt`` (no ``..``, no other name), with no
    symlink on the way, and a read-only overlay mount really there. A reply is hostile until
    checked: a prefix test let ``<node>/meta/<hex>/../../../usr`` through (issue 34, item 1)."""
    hexd = digest.removeprefix("sha256:")
    if not isinstance(claimed, str) or not is_hex64(hexd):
        return False
    pattern = re.escape(os.path.join(node_root, "meta", hexd)) + r"/g-[0-9a-f]{16}/mnt"
    if not re.fullmatch(pattern, claimed) or os.path.realpath(claimed) != claimed:
        log.warning("meta layers: the daemon named %r for %s: ignored", claimed[:300], digest)
        return False
    return _is_mount(claimed)



__all__ = ["CLOSE_WAIT", "ENV_SWITCH", "GRACE", "MAX_PATH", "METACOPY_XATTR", "META_VERSION",
           "MetaEntry", "MetaLayers", "REDIRECT_XATTR", "REFRESH_EVERY", "REFRESH_QUIET",
           "REFRESH_WORKERS", "TREES", "TREES_OPTIONS", "build",
           "building", "collect", "describe", "enabled", "handle", "meta_dirs",
           "mount_generation", "plan", "refresh_soon", "remove_unused", "safe_path",
           "trusted_meta_dir"]
