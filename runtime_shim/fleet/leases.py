"""A node daemon's bookkeeping of its sandboxes: their entries, leases and on-disk records,
and re-adoption after a restart.

On-disk record (version ``FLEET_RECORD_VERSION``): next to each sandbox's ``sandbox.json``, a
``fleet.json`` ``{version, id, node_id, lock, backend, lazy, ttl, lease_expires, exec_log,
labels, pool}``, written before the daemon reports the sandbox. A daemon that starts (after a
crash, or Ray's restart of it) re-adopts every sandbox of its node dir that has a record, a
live lease and still runs (``Sandbox.attach``), and removes every other one (no record: a
create cut short; lease past; not running; a backend that cannot be attached, e.g. a microVM
whose QEMU died with the old daemon). Nothing is left for nobody (``adopt``).

Leases: a sandbox lives until closed or until ``lease_expires`` (``ttl`` seconds after create,
attach or ``renew``); the daemon's reaper thread closes expired ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from envbuild.atomic import write_atomic
from envbuild.errors import EnvbuildError
from runtime_shim.fleet.model import CreateSpec, SandboxRecord, fleet_id, memory_of
from runtime_shim.node.layout import NodeLayout
from runtime_shim.node.model import ExecResult, Limits

FLEET_RECORD = "fleet.json"
FLEET_RECORD_VERSION = 1


@dataclasses.dataclass
class Entry:
    """One sandbox a daemon owns: its SDK handle, what it was made of and its lease."""

    sandbox: Any  # runtime_shim.sdk.sandbox.Sandbox
    spec: CreateSpec
    lease_expires: float
    exec_log: str | None
    pool: str | None = None  # the pool key while it waits in a warm pool
    seq: int = 0  # exec log entries written
    first: ExecResult | None = None  # a batch's first exec, until it is handed back
    token: str | None = None  # its data-plane token (runtime_shim.fleet.dataplane)
    log_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class EntryTable(dict[str, Entry]):
    """A daemon's entries by SDK id, with what admission and status ask on every create kept
    up to date as entries come and go: the memory they count (``memory``), the pooled ones
    by pool key (``pooled``) and their leases' ends in a heap (``expired``), so neither a
    create nor the reaper scans every sandbox of the node (2,400 of them on a cell's node).
    An entry's ``spec`` and ``pool`` change only while it is out of the table; a lease
    renewed in it is told with ``leased``."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = 0
        self.pooled: dict[str, dict[str, None]] = {}  # pool key -> ids, oldest first
        self.pooled_total = 0
        self._leases: list[tuple[float, str]] = []  # (lease end, id); stale ones skipped

    def __setitem__(self, key: str, entry: Entry) -> None:
        if key in self:
            self._forget(key, super().__getitem__(key))
        super().__setitem__(key, entry)
        self.memory += memory_of(entry.spec)
        if entry.pool:
            self.pooled.setdefault(entry.pool, {})[key] = None
            self.pooled_total += 1
        self.leased(key)

    def leased(self, key: str) -> None:
        """Entry ``key``'s lease was set or renewed."""
        entry = self.get(key)
        if entry is not None and not entry.pool and entry.lease_expires:
            heapq.heappush(self._leases, (entry.lease_expires, key))

    def expired(self, now: float) -> list[str]:
        """The ids of the (non-pooled) entries whose lease ended by ``now``."""
        out = []
        while self._leases and self._leases[0][0] <= now:
            _, key = heapq.heappop(self._leases)
            e = self.get(key)
            if e is not None and not e.pool and e.lease_expires and e.lease_expires <= now:
                out.append(key)
        return out

    def pop(self, key: str, *default: Any) -> Any:
        if key not in self:
            return super().pop(key, *default)
        entry = super().pop(key)
        self._forget(key, entry)
        return entry

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def _forget(self, key: str, entry: Entry) -> None:
        self.memory -= memory_of(entry.spec)
        if entry.pool:
            ids = self.pooled.get(entry.pool, {})
            ids.pop(key, None)
            if not ids:
                self.pooled.pop(entry.pool, None)
            self.pooled_total -= 1

    def pool_count(self, key: str) -> int:
        return len(self.pooled.get(key, ()))

    def pool_ids(self, key: str, count: int) -> list[str]:
        """Up to ``count`` ids of pool ``key``, oldest first."""
        return list(itertools.islice(self.pooled.get(key, ()), count))

    def clear(self) -> None:
        super().clear()
        self.memory, self.pooled, self.pooled_total, self._leases = 0, {}, 0, []

    def _unsupported(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("EntryTable keeps its counters through []=, pop and clear")

    update = setdefault = popitem = _unsupported


def record_of(e: Entry, node_id: str) -> SandboxRecord:
    """What a daemon on ``node_id`` reports of ``e``."""
    meta = read_json(e.sandbox.paths.meta) or {}
    return SandboxRecord(id=fleet_id(e.sandbox.id, node_id), node_id=node_id,
                         lock=e.spec.lock, backend=e.spec.backend,
                         created=float(meta.get("created", 0.0)),
                         ready=float(meta.get("ready", 0.0)),
                         lease_expires=e.lease_expires, exec_log=e.exec_log,
                         labels=e.spec.labels)


def write_record(e: Entry, node_id: str) -> None:
    """``e``'s ``fleet.json`` (module docstring), replaced whole."""
    spec = e.spec
    record = {"version": FLEET_RECORD_VERSION, "id": e.sandbox.id, "node_id": node_id,
              "spec": {"lock": spec.lock, "backend": spec.backend, "lazy": spec.lazy,
                       "network": list(spec.network) if isinstance(spec.network, tuple)
                       else spec.network,
                       "limits": dataclasses.asdict(spec.limits) if spec.limits else None,
                       "seccomp": spec.seccomp, "ttl": spec.ttl,
                       "exec_log": spec.exec_log, "labels": [list(x) for x in spec.labels]},
              "lease_expires": e.lease_expires, "exec_log": e.exec_log, "pool": e.pool}
    path = e.sandbox.paths.root / FLEET_RECORD
    write_atomic(path, json.dumps(record))


def adopt(layout: NodeLayout, store: Any, runtime: str, entries: dict[str, Entry]
          ) -> tuple[list[str], list[str]]:
    """Re-adopt the node dir's live sandboxes into ``entries``, remove the rest (module
    docstring): ``(adopted ids, removed ids)``."""
    from runtime_shim.sdk.sandbox import list_sandboxes, remove_sandbox

    adopted: list[str] = []
    reaped: list[str] = []
    now = time.time()
    for info in list_sandboxes(layout):
        entry = _adoptable(layout, store, runtime, info, now)
        if entry is not None:
            entries[info.id] = entry
            adopted.append(info.id)
            continue
        with contextlib.suppress(EnvbuildError, OSError):
            remove_sandbox(layout, info.id, runtime)
        reaped.append(info.id)
    # a pooled sandbox's pool is gone with the old daemon: close it, keep the claimed ones
    for k in [k for k, e in entries.items() if e.pool]:
        with contextlib.suppress(Exception):
            entries.pop(k).sandbox.close()
        adopted.remove(k)
        reaped.append(k)
    return adopted, reaped


def _adoptable(layout: NodeLayout, store: Any, runtime: str, info: Any, now: float
               ) -> Entry | None:
    """The entry of a listed sandbox that has a current record and can be attached, or None."""
    from runtime_shim.sdk.sandbox import Sandbox

    record = read_json(info.path / FLEET_RECORD)
    if not (record and record.get("version") == FLEET_RECORD_VERSION and (
            record.get("pool") or record.get("lease_expires", 0) > now)):
        return None
    entry = None
    with contextlib.suppress(EnvbuildError, OSError):
        sb = Sandbox.attach(info.id, store=store, node_dir=str(layout.root), runtime=runtime)
        spec = spec_from_record(record["spec"])
        entry = Entry(sandbox=sb, spec=spec,
                      lease_expires=float(record.get("lease_expires", 0.0)),
                      exec_log=record.get("exec_log"), pool=record.get("pool"))
        if entry.exec_log:
            from runtime_shim.fleet import execlog

            entry.seq = execlog.length(store, entry.exec_log)
    return entry


def read_json(path: os.PathLike[str] | str) -> dict | None:
    """A JSON object file, or None (missing, unreadable, not an object)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def spec_from_record(obj: Mapping[str, Any]) -> CreateSpec:
    """The ``CreateSpec`` of a fleet record's ``spec``."""
    limits = obj.get("limits")
    network = obj.get("network", False)
    return CreateSpec(lock=obj["lock"], backend=obj.get("backend", "container"),
                      lazy=bool(obj.get("lazy")),
                      network=tuple(network) if isinstance(network, list) else bool(network),
                      limits=Limits(**limits) if limits else None, seccomp=obj.get("seccomp"),
                      ttl=obj.get("ttl"), exec_log=bool(obj.get("exec_log")),
                      labels=tuple((str(k), str(v)) for k, v in obj.get("labels", ())))


__all__ = ["FLEET_RECORD", "FLEET_RECORD_VERSION", "Entry", "EntryTable", "adopt", "read_json", "record_of",
           "spec_from_record", "write_record"]
