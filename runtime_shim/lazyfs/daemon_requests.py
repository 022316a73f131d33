"""The node daemon's control requests: each ``op`` answered by its handler.

Protocol: ``runtime_shim.lazyfs.control`` (one connection, one request line, one reply line).
A bad client never takes the daemon down."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from envbuild.errors import EnvbuildError
from runtime_shim.lazyfs.control import REQUEST_TIMEOUT, _read_line
from runtime_shim.lazyfs.daemon_memory import _GC_PAUSES

log = logging.getLogger("envbuild.lazyfs")


def _refuse(conn: Any, why: str) -> None:
    """Answer ``why`` and close. The refused peer's request line is read first (at most
    64 KiB, 1 s): closing with it unread would make the peer's send fail (EPIPE) before it
    reads the answer, so a refused client would not learn why."""
    try:
        conn.settimeout(1.0)
        seen = 0
        while seen < 1 << 16:
            chunk = conn.recv(4096)
            seen += len(chunk)
            if not chunk or b"\n" in chunk:
                break
    except OSError:
        pass
    try:
        conn.sendall(json.dumps({"ok": False, "error": why}).encode() + b"\n")
    except OSError:
        pass
    finally:
        conn.close()


def _meta_building(root: str) -> int:
    from runtime_shim.lazyfs import metalayer

    return metalayer.building(root)


class _Requests:
    """The node daemon's part (a mixin of ``_NodeDaemon``) that answers control requests.
    Uses the daemon's state (``lock``, ``busy``, ``last``, ``ops``, ``by_digest``, its mode,
    limits, file cache, tree budget, metadata server and import prediction) and the handlers
    of its other parts (``_mount``, ``_start_prefetch``, ``_start_startup``)."""

    root: str
    lock: threading.Lock
    busy: int
    last: float
    mode: str
    mode_reason: str
    limits: Any
    files: Any
    tree_bytes: int
    tree_budget: int
    malloc: str
    metaserver: Any
    pyahead: Any
    ops: dict[str, Any]
    by_digest: dict[str, Any]
    _mount: Callable[[dict[str, Any]], dict[str, Any]]
    _start_prefetch: Callable[[dict[str, Any]], dict[str, Any]]
    _start_startup: Callable[[dict[str, Any]], dict[str, Any]]

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
            reply = self._answer(req)
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except Exception:  # noqa: BLE001 - a bad client must not take the daemon down
            log.exception("request failed")
        finally:
            conn.close()
            with self.lock:
                self.busy -= 1
                self.last = time.monotonic()

    def _answer(self, req: Any) -> dict[str, Any]:
        op = req.get("op") if isinstance(req, dict) else None
        if op == "ping":
            return self._ping()
        if op == "mount":
            return self._mount(req)
        if op == "prefetch":
            return self._start_prefetch(req)
        if op == "stats":   # a mount's counters (its root's stats xattr, when it has none)
            with self.lock:
                served = self.ops.get(str(req.get("mountpoint")))
            return ({"ok": True, "stats": served.lazy_stats()} if served is not None
                    else {"ok": False, "error": "no such lazy mount"})
        if op == "startup":  # a new stack's start-up files, fetched ahead (startup.py)
            return self._start_startup(req)
        if op == "meta":  # files already on the node, served without FUSE (metalayer)
            from runtime_shim.lazyfs import metalayer

            return metalayer.handle(self, req)
        return {"ok": False, "error": f"unknown request {op!r}"}

    def _ping(self) -> dict[str, Any]:
        return {
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
