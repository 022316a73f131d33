"""A node daemon's warm pools: ready sandboxes a ``create`` of their spec takes instead of
starting one.

``WarmPools`` is a part of ``runtime_shim.fleet.daemon.NodeDaemon`` (a mixin: it shares the
daemon's lock, entries and slot reservations); a pooled sandbox is an ``Entry`` whose ``pool``
is its pool key, and is invisible to every call but ``claim`` until it is claimed. The pool
thread (``_pool_loop``) refills every pool to its target in the background.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

from runtime_shim.fleet.leases import Entry, EntryTable
from runtime_shim.fleet.model import CreateSpec, DaemonConfig

#: Seconds a warm pool waits after a claim before it starts the replacement.
REFILL_DELAY = 0.05


class WarmPools:
    """The warm-pool calls and thread of a node daemon (module docstring)."""

    config: DaemonConfig
    _lock: threading.Lock
    _entries: EntryTable
    _pools: dict[str, tuple[CreateSpec, int]]  # key -> (spec, target)
    _reserved: int
    _stop: threading.Event
    _refill: threading.Event

    if TYPE_CHECKING:  # NodeDaemon's
        def _start_one(self, spec: CreateSpec, pool: str | None = None) -> Entry: ...

        def _close_entry(self, e: Entry) -> None: ...

    def warm(self, spec: CreateSpec, per_node: int) -> str:
        """Keep ``per_node`` ready sandboxes of ``spec`` here (0 stops the pool and closes its
        sandboxes); refilled in the background. The pool key."""
        key = spec.pool_key()
        with self._lock:
            if per_node > 0:
                self._pools[key] = (spec, per_node)
            else:
                self._pools.pop(key, None)
                drop = [k for k, e in self._entries.items() if e.pool == key]
                entries = [self._entries.pop(k) for k in drop]
        if per_node <= 0:
            for e in entries:
                with contextlib.suppress(Exception):
                    self._close_entry(e)
        self._refill.set()
        return key

    def warm_count(self, key: str) -> int:
        with self._lock:
            return self._entries.pool_count(key)

    def _claim_warm(self, spec: CreateSpec, count: int) -> list[Entry]:
        key = spec.pool_key()
        with self._lock:
            return [self._entries.pop(k) for k in self._entries.pool_ids(key, count)]

    def _pool_loop(self) -> None:
        while not self._stop.is_set():
            if self._refill.wait(1.0):
                # woken by a claim: let its reply leave (and the claimer's next command run)
                # before a start takes this process's GIL and the node's CPU
                self._stop.wait(REFILL_DELAY)
            self._refill.clear()
            with self._lock:
                pools = list(self._pools.items())
            for key, (spec, target) in pools:
                if self._fill(key, spec, target):
                    return

    def _fill(self, key: str, spec: CreateSpec, target: int) -> bool:
        """Start sandboxes into pool ``key`` until it holds ``target`` (or the node is full,
        the pool changed, or a start failed). True once the daemon is stopping."""
        while not self._stop.is_set():
            with self._lock:
                have = self._entries.pool_count(key)
                used = len(self._entries) + self._reserved
                if (have >= target or used >= self.config.slots
                        or self._pools.get(key, (None, 0))[1] != target):
                    return False
                self._reserved += 1
            try:
                entry = self._start_one(spec, pool=key)
            except Exception:  # noqa: BLE001 - a failing pool retries next round
                with self._lock:
                    self._reserved -= 1
                return False
            with self._lock:
                self._reserved -= 1
                stopped = self._stop.is_set()
                dropped = key not in self._pools  # warm(per_node=0) meanwhile
                if not stopped and not dropped:
                    self._entries[entry.sandbox.id] = entry
            if stopped or dropped:  # nobody else will close it
                with contextlib.suppress(Exception):
                    self._close_entry(entry)
                return stopped
        return False


__all__ = ["REFILL_DELAY", "WarmPools"]
