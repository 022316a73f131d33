"""The node daemon's fetches ahead of the readers: loader files, start-up files, commands.

A program's loader files (its ELF interpreter and libraries, ``elfdeps``), a new stack's
start-up files and the lock's command (``startup``), the Python start-up files predicted at
create (``pyahead``), each mount's import index (``pyindex``), and when the tar-order
readahead follows a file fetched ahead (``_follow_delay``)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envbuild.errors import EnvbuildError
from runtime_shim.lazyfs import startup

log = logging.getLogger("envbuild.lazyfs")

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
#: Most (mountpoint, inode) pairs remembered as fetched ahead (``_elf_seen``).
_SEEN_MAX = 100_000


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


class _FetchAhead:
    """The node daemon's part (a mixin of ``_NodeDaemon``) that fetches files ahead of their
    readers. Uses the daemon's ``lock``, its mounts (``ops``, ``by_digest``), ``elf_pool``,
    ``_elf_seen`` (what was fetched ahead, per mount), ``pyahead`` and ``_store``."""

    lock: threading.Lock
    ops: dict[str, Any]
    by_digest: dict[str, Any]
    elf_pool: ThreadPoolExecutor
    _elf_seen: set[tuple[str, int]]
    pyahead: Any
    _store: Callable[[str, str | None], Any]

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

    def _first_sight(self, ops: Any, node: Any) -> bool:
        """Mark ``node`` of mount ``ops`` as fetched ahead; False if it was already (or too
        many are remembered)."""
        key = (ops.mountpoint, node.ino)
        with self.lock:
            if key in self._elf_seen or len(self._elf_seen) > _SEEN_MAX:
                return False
            self._elf_seen.add(key)
        return True

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
            if self._first_sight(ops, node):
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
                if len(self._elf_seen) <= _SEEN_MAX:
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
        if not self._first_sight(ops, node):
            return
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
