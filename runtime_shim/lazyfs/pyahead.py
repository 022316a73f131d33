"""Python import prediction in the daemon: when a ``.pyc`` of a lazy layer is first opened,
the files of the modules it imports at module level (``pydeps.predict``) are fetched in the
background, and each predicted pyc that lands is scanned in turn, so the prefetch runs
ahead of the single-threaded importer instead of the importer waiting on one miss after
the other.

Order: the importer runs a module's imports depth first, in bytecode order, so the scans
are taken from a heap keyed by the import path's indices (lexicographic order = the order
the importer will reach them), newest reader-opened module first (what runs now). One
thread scans (pure Python, CPU); loads go to a small pool as background requests (a
reader's own misses go first), one coalesced ``prefetch_in_order`` per layer and module.
Extension modules among the predictions start their directory's extension readahead
(``_Readahead.schedule_extensions``: siblings and the wheel's vendored libraries).

Bounded: at most ``MAX_FILES`` predicted files per stack, files larger than ``MAX_FILE`` are
left to their own open, each file predicted once per mount (``seen``), and the scan heap
holds at most ``MAX_QUEUE`` pycs. By default an interpreter's start-up is predicted, and the
imports of every pyc of a layer with an import index (``pyindex``: each pyc's imports, scanned
when the layer was packed; read by the daemon after the mount). An indexed pyc needs no bytes
to be resolved, so each predicted pyc of an indexed layer is queued for resolution as soon as
it is predicted: a module's whole import closure is known at its first open. With
``$ENVBUILD_LAZY_PYDEPS=on`` the pycs of layers without an index are scanned as they land
(``mode``; measurements in ``docs/notes/lazy-loading-log.md``: exact, but not faster on a
CPU-saturated host); ``$ENVBUILD_LAZY_PYINDEX=0`` leaves the indexes unused.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
import re
import select
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envbuild.errors import EnvbuildError
from envbuild.store.lazy import background
from runtime_shim.lazyfs import pydeps, pyindex, pystartup
from runtime_shim.lazyfs.frames import (
    _EXTENSION,
    PROFILE_FILE_WORKERS,
    PROFILE_RUN,
    coalesced_runs,
)

log = logging.getLogger("envbuild.lazyfs")

ENV_SWITCH = "ENVBUILD_LAZY_PYDEPS"
#: Predicted files per stack (a whole site-packages is far more than an import touches).
MAX_FILES = 6000
#: A predicted file larger than this is left to its own open (numpy's ufunc module: 10 MB).
MAX_FILE = 32 << 20
#: Pycs waiting to be scanned.
MAX_QUEUE = 20_000
#: Parallel loads (each a coalesced prefetch of one module's predictions in one layer).
LOAD_WORKERS = 4
#: Whether opens of predicted files still move the tar-order readahead (measured: not
#: moving it, 2 MB and 0.1 s of daemon CPU less, no slower).
TAR_FOLLOW = False
#: Import levels scanned ahead of the pycs a reader opened (0: no limit); a predicted pyc
#: deeper than that is scanned when the reader opens it. Measured: 2 levels kept 31-32 of
#: the import's 31-38 misses (no limit: 9-20) and cost about as much.
AHEAD_DEPTH = 0
#: Loads running at once per layer (each takes everything predicted since the last began).
DRAINS = 2
#: Compressed bytes between two predicted files that one read may span (fetched and dropped).
GAP = 64 << 10   # as a profile's (measured: 256 KiB, one drain -> +4 MB, no faster)
#: Ranged reads of predicted files in flight (all layers).
READ_WORKERS = 6
#: A predicted extension module up to this size is read to fetch its libraries (elfdeps:
#: lib-dynload's ``_lzma``, ``_hashlib``, ``_ssl`` need liblzma, libcrypto); larger ones
#: (numpy's 10 MB ufunc module) link what ``elfdeps`` does not search (their wheel's
#: ``P.libs``, which the extension readahead fetches), and reading them back costs CPU.
ELF_MAX = 2 << 20
#: Roots (sys.path entries) remembered per stack from the pycs readers opened.
MAX_ROOTS = 16
#: Seconds a scan in the helper process may take before it is killed (and restarted).
SCAN_TIMEOUT = 5.0
#: Helper processes started per daemon (one at a time) before scans run in the daemon.
SCAN_STARTS = 3
#: The helper's address-space limit (bytes): a hostile pyc cannot make it take the node's memory.
SCAN_MEMORY = 1 << 30
_STARTUP = re.compile(r"(^|/)(bin/python3\.\d{1,2}|pyvenv\.cfg)$")
_MAX_LINE = 8 << 20


def mode() -> str:
    """``$ENVBUILD_LAZY_PYDEPS``: ``on`` (the imports of every fetched pyc predicted),
    ``startup`` (the default: an interpreter's start-up files — ``encodings``,
    ``sitecustomize``, the site dirs' ``.pth`` files and their imports — on the first open of
    ``bin/python3.N`` or a ``pyvenv.cfg``, a dozen files, and the imports of the pycs of
    indexed layers; no scan helper) or ``off`` (nothing, indexes included). Full
    prediction is not the default: on a CPU-saturated 2-core host its work in the daemon
    cost the import more than the misses it removed (``docs/notes/lazy-loading-log.md``)."""
    value = os.environ.get(ENV_SWITCH, "").strip().lower()
    if value in ("on", "1", "yes", "true"):
        return "on"
    if value in ("off", "0", "no", "false"):
        return "off"
    return "startup"


def enabled() -> bool:
    """Whether the daemon predicts anything (``mode()`` is not ``off``)."""
    return mode() != "off"


is_pyc = pydeps.is_pyc


class PyAhead:
    """The node daemon's import prediction (module docstring). ``layers_of(stack)`` gives the
    mounted layers (``PassthroughFS``) of a stack, top first."""

    def __init__(self, layers_of: Callable[[Sequence[str]], list[Any]],
                 on_elf: Callable[[Sequence[str], Any, bytes], object] | None = None) -> None:
        self.layers_of = layers_of
        self.on_elf = on_elf   # a predicted extension module landed: its libraries (elfdeps)
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.heap: list[tuple[Any, ...]] = []
        self.gen = 0
        self.tick = itertools.count()
        self.seen: set[tuple[str, int]] = set()        # (mountpoint, ino) predicted
        self.opened: set[tuple[str, int]] = set()      # predicted files a reader opened
        self.queued: set[tuple[str, int]] = set()      # pycs (and .pth) queued for a scan
        self.tar_follow = TAR_FOLLOW
        self.count: dict[tuple[str, ...], int] = {}    # stack -> files predicted
        self.roots: dict[tuple[str, ...], list[str]] = {}
        self.tags: dict[tuple[str, ...], str] = {}     # stack -> its interpreter's pyc tag
        self.stats = {"pyc_scanned": 0, "files_predicted": 0, "predicted_opened": 0,
                      "unpredicted_opens": 0, "bytes_predicted": 0, "scan_seconds": 0.0,
                      "resolve_seconds": 0.0}
        self.loads = ThreadPoolExecutor(LOAD_WORKERS, thread_name_prefix="lazy-py-load")
        self.reads = ThreadPoolExecutor(READ_WORKERS, thread_name_prefix="lazy-py-read")
        #: whether fetched pycs are scanned for their imports (``mode() == "on"``); else
        #: only interpreter start-up is predicted
        self.scan_imports = mode() == "on"
        self.scanner = _Scanner()
        if self.scan_imports:
            threading.Thread(target=self.scanner.start, name="lazy-py-helper",
                             daemon=True).start()
        self.stacks: dict[tuple[str, ...], tuple[list[int], pydeps.CachedStack]] = {}
        # mountpoint -> (its layer, predicted files waiting for a load), loads running
        self.pending: dict[str, tuple[Any, list[tuple[tuple[Any, ...], tuple[str, ...], Any]]]] = {}
        self.draining: dict[str, int] = {}
        threading.Thread(target=self._run, name="lazy-py-scan", daemon=True).start()

    # -- told by a mount ------------------------------------------------------------------------

    def opened_file(self, stack: Sequence[str], fs: Any, node: Any, path: str) -> None:
        """A reader opened ``node`` of ``fs`` for the first time (its cache file at ``path``):
        counts hits, and a pyc not predicted yet is scanned first of all."""
        key = (fs.mountpoint, node.ino)
        py = is_pyc(node.read_path)
        if py and not self.scan_imports:
            py = _indexed(fs, node)   # its imports are known without its bytes
        with self.lock:
            if key in self.seen:
                if key not in self.opened:
                    self.opened.add(key)
                    self.stats["predicted_opened"] += 1
                if py and key not in self.queued:
                    # predicted beyond AHEAD_DEPTH: scan now
                    self.queued.add(key)
                    self.gen += 1
                    self._push((-self.gen, ()), "pyc", tuple(stack), fs, node, path)
                return
            if py or node.read_path.endswith(".py") or _EXTENSION.search(node.read_path):
                self.stats["unpredicted_opens"] += 1
            if py:
                kind = "pyc"
            elif is_pyc(node.read_path):
                return
            elif _STARTUP.search(node.read_path):
                kind = "startup"   # an interpreter or a venv's pyvenv.cfg: start-up files
            else:
                return
            self.seen.add(key)
            self.queued.add(key)
            self.gen += 1
            self._push((-self.gen, ()), kind, tuple(stack), fs, node, path)

    def expect(self, stack: Sequence[str], fs: Any, node: Any) -> bool:
        """Predict the start-up files of an interpreter or a venv's ``pyvenv.cfg`` before its
        first open (``_NodeDaemon._python_startup``, at create): what that open would queue,
        queued now. False if ``node`` is neither, or was seen already."""
        if not _STARTUP.search(node.read_path):
            return False
        key = (fs.mountpoint, node.ino)
        with self.lock:
            if key in self.seen:
                return False
            # not marked seen here: the scan thread claims the file itself with the files
            # its start opens (``_startup(itself=True)``)
            self.gen += 1
            self._push((-self.gen, ()), "expected", tuple(stack), fs, node, None)
        return True

    def predicted(self, fs: Any, node: Any) -> bool:
        """Whether ``node`` of ``fs`` was fetched as a prediction (a reader's open of it then
        does not move the tar-order readahead: it follows the imports, not the blob;
        ``_NodeDaemon._follow_delay``).
        Lock-free: a set lookup (the FUSE reader thread asks on every first open)."""
        return (fs.mountpoint, node.ino) in self.seen and not self.tar_follow

    def forget(self, mountpoint: str) -> None:
        with self.lock:
            self.seen = {k for k in self.seen if k[0] != mountpoint}
            self.opened = {k for k in self.opened if k[0] != mountpoint}
            self.queued = {k for k in self.queued if k[0] != mountpoint}
            self.pending.pop(mountpoint, None)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.stats)

    # -- the scan loop ----------------------------------------------------------------------------

    def _push(self, key: tuple[Any, ...], kind: str, stack: tuple[str, ...], fs: Any,
              node: Any, path: str | None) -> None:
        """(Lock held.) Queue ``node`` of ``fs`` (``kind``: a ``pyc`` to scan, a ``pth`` to
        read for its imports, a ``startup`` file) (``path``: its cache file, or None to read
        it from the layer)."""
        if len(self.heap) < MAX_QUEUE:
            heapq.heappush(self.heap, (key, next(self.tick), kind, stack, fs, node, path))
            self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.heap:
                    self.cv.wait()
                key, _, kind, stack, fs, node, path = heapq.heappop(self.heap)
            try:
                if kind == "pyc":
                    self._scan(key, stack, fs, node, path)
                elif kind == "pth":
                    self._pth(key, stack, fs, node, path)
                else:
                    self._startup(key, stack, fs, node, itself=kind == "expected")
            except Exception:  # noqa: BLE001 - a hint only: the importer's opens fetch
                log.exception("import prediction after %s", node.read_path)

    def _scan(self, key: tuple[Any, ...], stack: tuple[str, ...], fs: Any, node: Any,
              path: str | None) -> None:
        import time

        index = _index_of(fs)
        known = index.imports(node.read_path) if index is not None else None
        data = b""
        if known is None:
            if not self.scan_imports or node.size > pydeps.MAX_PYC:
                return
            got = _read(fs, node, path)
            if got is None:
                return
            data = got
        st = self._stack(stack, fs)
        # its source first, before the scan: the importer opens it next (to hash it, for a
        # checked-hash pyc; to compile it, for a pyc whose timestamp does not match)
        first = pydeps.pyc_info(st, node.read_path)
        src = st.lookup(first.source) if first is not None else None
        if src is not None:
            self._claim(key, stack, [src], source=True)
        t0 = time.monotonic()
        imports = list(known) if known is not None else self.scanner.scan(data)
        t1 = time.monotonic()
        with self.lock:
            roots = list(self.roots.get(stack, ()))
        info, files = pydeps.predict(st, node.read_path, data, roots, imports=imports)
        with self.lock:
            self.stats["pyc_scanned"] += 1
            self.stats["scan_seconds"] += t1 - t0
            self.stats["resolve_seconds"] += time.monotonic() - t1
            if info is not None and info.root not in roots:
                rs = self.roots.setdefault(stack, [])
                if len(rs) < MAX_ROOTS:
                    rs.append(info.root)
        self._claim(key, stack, files, after=node)

    def _startup(self, key: tuple[Any, ...], stack: tuple[str, ...], fs: Any,
                 node: Any, *, itself: bool = False) -> None:
        """The start-up files of an interpreter or a venv (``node``, opened or, ``itself``,
        expected at create: then fetched too, first)."""
        st = self._stack(stack, fs)
        tag, sites, files = pystartup.startup_files(st, node.read_path)
        if itself:
            files = [(fs, node), *files]
        with self.lock:
            if tag:
                self.tags[stack] = tag
            rs = self.roots.setdefault(stack, [])
            for site in sites:
                if site not in rs and len(rs) < MAX_ROOTS and _children_exist(st, site):
                    rs.append(site)
        self._claim(key, stack, files, after=node)

    def _pth(self, key: tuple[Any, ...], stack: tuple[str, ...], fs: Any, node: Any,
             path: str | None) -> None:
        data = _read(fs, node, path, pystartup.MAX_PTH)
        if not data:
            return
        st = self._stack(stack, fs)
        m = re.search(r"python3\.(\d{1,2})/", node.read_path)
        with self.lock:
            tag = f"cpython-3{m[1]}" if m else self.tags.get(stack, "")
            roots = list(self.roots.get(stack, ()))
        if not tag:
            return
        site = node.read_path.rpartition("/")[0]
        where = list(dict.fromkeys([site, *pydeps.stdlib_roots(tag), *roots]))
        files: list[tuple[Any, Any]] = []
        for name in pystartup.pth_imports(data):
            for k in range(1, name.count(".") + 2):
                files += pydeps.module_files(st, where, ".".join(name.split(".")[:k]), tag)[1]
        self._claim(key, stack, files, after=node)

    def _claim(self, key: tuple[Any, ...], stack: tuple[str, ...],
               files: list[tuple[Any, Any]], *, after: Any = None, source: bool = False
               ) -> None:
        """Mark ``files`` (``(ops, node)``) predicted and load those not predicted before,
        one load per layer in the order of its first file (the importer's order)."""
        with self.lock:
            todo: list[tuple[Any, Any]] = []
            for ops, n in files:
                k = (ops.mountpoint, n.ino)
                if k in self.seen or not n.read_path or n.size > MAX_FILE:
                    continue
                if self.count.get(stack, 0) >= MAX_FILES:
                    break
                self.seen.add(k)
                self.count[stack] = self.count.get(stack, 0) + 1
                self.stats["files_predicted"] += 1
                self.stats["bytes_predicted"] += n.size
                todo.append((ops, n))
        if after is not None:
            _trace(todo, after)
        if not todo:
            return
        base = key[1]
        with self.lock:
            for i, (ops, n) in enumerate(todo):
                mp = ops.mountpoint
                if mp not in self.pending:
                    self.pending[mp] = (ops, [])
                at = (key[0], (*base, i))
                self.pending[mp][1].append((at, stack, n))
                k = (mp, n.ino)
                if k not in self.queued and _indexed(ops, n):
                    # its imports are in the layer's index: resolved now, ahead of its fetch
                    # (no scan waits for bytes: the whole import closure is known at once)
                    self.queued.add(k)
                    self._push(at, "pyc", stack, ops, n, None)
            for mp in {ops.mountpoint for ops, _ in todo}:
                if self.draining.get(mp, 0) < DRAINS:
                    self.draining[mp] = self.draining.get(mp, 0) + 1
                    self.loads.submit(self._drain, mp)

    def _drain(self, mp: str) -> None:
        """Load what was predicted in the layer mounted at ``mp`` until nothing is pending:
        each round takes all of it at once (in the importer's order), so predictions made
        while a load was in flight go in one coalesced load instead of one each."""
        while True:
            with self.lock:
                ops, batch = self.pending.get(mp, (None, []))
                if not batch:
                    self.pending.pop(mp, None)
                    self.draining[mp] -= 1
                    return
                self.pending[mp] = (ops, [])
            batch.sort(key=lambda e: e[0])
            try:
                self._load(ops, batch)
            except Exception:  # noqa: BLE001 - a hint only: the importer's opens fetch
                log.exception("import prediction: load in %s", ops.lazy_layer.digest)

    def _stack(self, stack: tuple[str, ...], fs: Any) -> pydeps.CachedStack:
        """The stack's layers with remembered lookups (renewed when its mounts change)."""
        from runtime_shim.lazyfs.elfdeps import Stack

        layers = self.layers_of(stack) or [fs]
        ids = [id(x) for x in layers]
        with self.lock:
            got = self.stacks.get(stack)
            if got is not None and got[0] == ids:
                return got[1]
            st = pydeps.CachedStack(Stack(layers))
            if len(self.stacks) > 64:
                self.stacks.clear()
            self.stacks[stack] = (ids, st)
            return st

    def _load(self, ops: Any, batch: list[tuple[tuple[Any, ...], tuple[str, ...], Any]]
              ) -> None:
        """Fetch the files of ``batch`` (``(heap key, stack, node)``, in order) of the layer
        ``ops`` in coalesced background reads; then queue its pycs and .pth files for their
        imports and tell ``on_elf`` of its extension modules."""
        nodes = [n for _, _, n in batch]
        fetch, cached = [], {}
        for n in nodes:
            hit = ops.files.cached(n.digest) if n.digest else None
            if hit is not None:
                cached[id(n)] = hit
            else:
                fetch.append(n)
            if _EXTENSION.search(n.read_path):
                ops.readahead.schedule_extensions(n)   # siblings, vendored libraries
        if fetch:
            try:
                # coalesced reads as a profile's (without marking the layer profiled), in
                # this object's pool (a pool per load cost a thread start per read)
                runs = coalesced_runs(ops.lazy_frames, ops.lazy_nodes,
                                      [n.read_path for n in fetch], gap=GAP)
                for f in [self.reads.submit(_load_run, ops, run) for run in runs]:
                    f.result()
            except EnvbuildError as e:   # the importer's own open reports it
                log.warning("import prediction: fetch in %s: %s", ops.lazy_layer.digest,
                            e.message)
                return
        if self.on_elf is not None:
            for _, stack, n in batch:
                if _EXTENSION.search(n.read_path) and n.size <= ELF_MAX:
                    data = _read(ops, n, cached.get(id(n)), ELF_MAX)
                    if data is not None and data[:4] == b"\x7fELF":
                        self.on_elf(stack, ops, data)
        with self.lock:
            for key, stack, n in batch:
                kind = ("pyc" if is_pyc(n.read_path) and self.scan_imports
                        else "pth" if n.read_path.endswith(".pth") else "")
                k = (ops.mountpoint, n.ino)
                if kind and (not AHEAD_DEPTH or len(key[1]) < AHEAD_DEPTH) \
                        and k not in self.queued:
                    self.queued.add(k)
                    self._push(key, kind, stack, ops, n, cached.get(id(n)))


def _load_run(ops: Any, run: list[Any]) -> None:
    # background requests: a reader's own misses go first (measured: as reader requests,
    # no faster); a large file alone is several reads in parallel
    with background():
        ops.lazy_frames.load(run, wait=False, workers=PROFILE_FILE_WORKERS, max_run=PROFILE_RUN,
                             merge_gap=GAP, ahead=True)


def _index_of(fs: Any) -> Any:
    """The import index of the layer mounted as ``fs`` (``pyindex.ImportIndex``, set by the
    daemon once read) or None."""
    return getattr(fs, "py_index", None) if pyindex.USE_INDEX else None


def _indexed(fs: Any, node: Any) -> bool:
    """Whether ``node`` is a pyc whose imports the index of ``fs``'s layer holds."""
    index = _index_of(fs)
    return index is not None and node.read_path in index.pycs and is_pyc(node.read_path)


def _children_exist(stack: Any, path: str) -> bool:
    return any(ops.lazy_nodes.get(path) is not None for ops in stack.layers)


def _read(fs: Any, node: Any, path: str | None, limit: int = pydeps.MAX_PYC) -> bytes | None:
    try:
        if path is not None:
            with open(path, "rb") as f:
                return f.read(limit + 1)
        if fs.lazy_frames.missing(node):
            return None   # its load failed: nothing to scan
        return bytes(fs.lazy_layer.read(node.read_path))
    except (OSError, EnvbuildError):
        return None


def _trace(todo: list[tuple[Any, Any]], after: Any) -> None:
    """``$ENVBUILD_LAZY_OPEN_TRACE``: one ``predict`` line per predicted file."""
    from runtime_shim.lazyfs import passthrough_open

    if passthrough_open._TRACE is None:
        return
    import time

    with passthrough_open._trace_lock, open(passthrough_open._TRACE, "a") as f:
        for ops, n in todo:
            f.write(f"{time.monotonic():.6f} 0 predict {ops.lazy_layer.digest[7:19]} {n.size} "
                    f"{n.read_path} <- {after.read_path}\n")


class _Scanner:
    """``pydeps.scan`` in a helper process (``python -I -S pydeps.py --scan``): the
    scan is pure-Python CPU work over every pyc an import touches, which inside the daemon
    holds its GIL against the threads answering the sandbox's opens (measured: opens of
    fetched files 0.30 s -> 0.83 s per workload). The helper reads length-prefixed pycs on
    stdin and answers one JSON line each; it runs with an address-space limit
    (``SCAN_MEMORY``), a scan that takes longer than ``SCAN_TIMEOUT`` kills it, and it exits
    when the daemon does (EOF on stdin). After ``SCAN_STARTS`` helpers died, scans run in
    the daemon."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.lock = threading.Lock()

    def start(self) -> None:
        """Start the helper now (at the daemon's start: not on the first pyc's open)."""
        with self.lock:
            self._proc()

    def scan(self, data: bytes) -> list[pydeps.Import]:
        with self.lock:
            proc = self._proc()
            if proc is None:
                return pydeps.scan(data)
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(struct.pack(">I", len(data)) + data)
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], SCAN_TIMEOUT)
                line = proc.stdout.readline(_MAX_LINE) if ready else b""
                if not line.endswith(b"\n"):
                    raise OSError("no answer")
                return _decode(line)
            except (OSError, ValueError) as e:
                log.warning("import prediction: the scan helper failed (%s): restarting it", e)
                self._stop()
                return []

    def _proc(self) -> subprocess.Popen[bytes] | None:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self._stop()
        if self.starts >= SCAN_STARTS:
            return None
        self.starts += 1
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", pydeps.__file__, "--scan",
                 str(SCAN_MEMORY)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                close_fds=True, cwd="/")
        except OSError as e:
            log.warning("import prediction: no scan helper (%s): scanning in the daemon", e)
            self.starts = SCAN_STARTS
            return None
        return self.proc

    def _stop(self) -> None:
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self.proc = None


def _decode(line: bytes) -> list[pydeps.Import]:
    """The helper's answer (a JSON list of ``[name, level, [fromlist...]]``), checked."""
    raw = json.loads(line)
    out = []
    if not isinstance(raw, list):
        raise ValueError("not a list")
    for item in raw[:pydeps.MAX_IMPORTS]:
        if (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                and type(item[1]) is int and isinstance(item[2], list)):
            out.append(pydeps.Import(item[0], item[1],
                                     tuple(x for x in item[2] if isinstance(x, str))))
    return out
