"""The node daemon: one per Ray node that offers ``envbuild_node``, owning that node's sandboxes.

``NodeDaemon`` is a plain class (so it is usable and testable without Ray) that the fleet runs
as a named, detached Ray actor (``actor_name(node_id)`` in namespace ``NAMESPACE``, started by
``runtime_shim.fleet.client.start_daemons``, ``num_cpus=0`` plus one unit of ``envbuild_node``
so exactly one fits a node). It makes every sandbox with the SDK (``Sandbox.create``), so any
backend in ``runtime_shim.backends.base``'s registry works unchanged, against one node dir
(``DaemonConfig.node_dir``, a template in which ``{node_id}`` is the Ray node id, so several Ray
nodes on one test host do not collide) and one shared store (S3, or a directory for a
single-host cluster).

This module holds the daemon's calls (queries, create/claim/close, the sandbox methods) and its
capacity and admission bookkeeping; the on-disk record, leases and re-adoption after a restart
are in ``runtime_shim.fleet.leases``, the warm pools in ``runtime_shim.fleet.pools``, the data
it takes and returns in ``runtime_shim.fleet.model``.

Admission control: at most ``max_starting`` sandboxes of the node are STARTING at once; more
wait in a queue (a burst becomes a queue, not timeouts). Capacity: ``slots`` sandboxes and
``memory_bytes`` of ``Limits.memory_bytes`` per node; a batch that does not fit is refused
whole (``RuntimeShimError`` ``fleet-full``) before anything is started.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import os
import queue
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envbuild.errors import (
    EnvbuildError,
    RuntimeShimError,
    SandboxNotFound,
)
from runtime_shim.fleet.dataplane import DataServer, answer
from runtime_shim.fleet.leases import (
    FLEET_RECORD,
    FLEET_RECORD_VERSION,
    Entry,
    EntryTable,
    adopt,
    record_of,
    write_record,
)
from runtime_shim.fleet.model import (
    ACTOR_PREFIX,
    DEFAULT_TTL,
    NAMESPACE,
    CreateSpec,
    DaemonConfig,
    FirstExec,
    NodeStatus,
    SandboxRecord,
    actor_name,
    check_sdk_id,
    fleet_id,
    matches,
    memory_of,
    open_url,
    split_fleet_id,
)
from runtime_shim.fleet.pools import REFILL_DELAY, WarmPools
from runtime_shim.fleet.streams import Streams
from runtime_shim.fleet.workers import CreateWorkers, child_of, start_sandbox
from runtime_shim.node import diskpool
from runtime_shim.node.layout import NodeLayout
from runtime_shim.node.model import ExecResult, SandboxInfo


class NodeDaemon(WarmPools):
    """The sandboxes of one node (see the module docstring). Thread-safe: the Ray actor runs
    it with many concurrent calls (``max_concurrency``)."""

    def __init__(self, config: DaemonConfig, node_id: str | None = None) -> None:
        from runtime_shim.sdk.sandbox import open_store

        if node_id is None:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        self.config = config
        self.node_id = node_id
        diskpool.hold_pools()  # a node's long-lived owner: empty pools kept for their grace
        self._renice_threads()
        # the real path: the SDK finds a sandbox's mounts by it (a symlinked node dir would hide them)
        self.layout = NodeLayout(os.path.realpath(config.node_dir_for(node_id)))
        self.layout.ensure()
        self.store = open_store(open_url(config.store, config.s3_endpoint))
        self._lock = threading.Lock()
        self._entries = EntryTable()
        self._reserved = 0  # slots of batches being started
        self._reserved_memory = 0
        self._starting = 0
        self._queued = 0
        self._admit = threading.BoundedSemaphore(max(1, config.max_starting))
        # every batch's starts, on threads kept (a pool per batch cost thread starts on every
        # call, and a thread per queued start); twice the admission so that first execs,
        # which run on them after the start, do not hold the next starts back
        self._starter = ThreadPoolExecutor(max_workers=2 * max(1, config.max_starting),
                                           thread_name_prefix="fleet-start")
        self._locks: dict[str, Any] = {}  # lock digest -> ResolvedLock (content-addressed)
        self._pulled = 0
        self._counted: set[str] = set()
        self._pools: dict[str, tuple[CreateSpec, int]] = {}  # key -> (spec, target)
        self._stop = threading.Event()
        self.adopted, self.reaped = adopt(self.layout, self.store, config.runtime, self._entries)
        self._workers = CreateWorkers(config.workers, config, str(self.layout.root)) \
            if config.workers > 0 else None
        self.worker_pids = self._workers.start() if self._workers else []
        self._data = DataServer(config.data_host, self._data_answer, Streams(self).serve) \
            if config.data_host else None
        self._refill = threading.Event()
        threading.Thread(target=self._reap_loop, name="fleet-reaper", daemon=True).start()
        self._pool_thread = threading.Thread(target=self._pool_loop, name="fleet-pool",
                                             daemon=True)
        self._pool_thread.start()

    def _renice_threads(self) -> None:
        """Every thread of this process to ``config.niceness`` (Linux keeps a nice value per
        thread and a new thread inherits its creator's, so the threads Ray made before us
        are set one by one). Needs CAP_SYS_NICE to lower it; without, Ray's value stays."""
        want = self.config.niceness
        if want is None:
            return
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:
            with contextlib.suppress(OSError):  # a thread gone meanwhile, or no CAP_SYS_NICE
                os.setpriority(os.PRIO_PROCESS, tid, want)

    # -- queries ---------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "node_dir": str(self.layout.root),
                "store": self.config.store, "pid": os.getpid(), "adopted": self.adopted,
                "reaped": self.reaped, "workers": self.worker_pids,
                "data_addr": self._data.address if self._data else None}

    def status(self, layers: Sequence[str] = (), pool_keys: Sequence[str] = ()) -> NodeStatus:
        from runtime_shim.node.nodecache import NodeCache

        node = NodeCache(self.layout.node)
        cached = tuple(d for d in layers if node.on_node(d))
        with self._lock:
            used = len(self._entries) + self._reserved
            memory_used = self._reserved_memory + self._entries.memory
            warm = self._entries.pooled_total
            pools = tuple((k, self._entries.pool_count(k)) for k in pool_keys)
            return NodeStatus(node_id=self.node_id, node_dir=str(self.layout.root),
                              store=self.config.store, slots=self.config.slots, used=used,
                              starting=self._starting, queued=self._queued,
                              memory_bytes=self._memory_budget(), memory_used=memory_used,
                              warm=warm, pulled_bytes=self._pulled, cached=cached,
                              pid=os.getpid(), pools=pools)

    def list_sandboxes(self, labels: Sequence[tuple[str, str]] = ()) -> list[SandboxRecord]:
        with self._lock:
            entries = [(k, e) for k, e in self._entries.items() if not e.pool]
        return [self._record(e) for _, e in entries if matches(e.spec, labels)]

    # -- lifecycle -------------------------------------------------------------------------

    def create_batch(self, spec: CreateSpec, count: int, first: FirstExec | None = None
                     ) -> list[Any]:
        """Start ``count`` sandboxes of ``spec`` on this node (warm ones first): all of them,
        or none (those made are closed, the first error is raised). Their records; with
        ``first`` (``(cmd, exec kwargs)``), ``(record, ExecResult)`` pairs: that command run
        in each sandbox as soon as it is ready, in the same call (an exec that raises fails
        the batch like a start that does)."""
        if count < 1:
            return []
        lock = self._resolve(spec.lock)  # LockNotFound before anything is reserved
        self._reserve(spec, count)
        made: list[Entry] = []
        try:
            claimed = self._claim_warm(spec, count)
            made.extend(claimed)
            self._count_pulled(lock)
            rest = count - len(claimed)
            if rest:
                with self._lock:
                    self._queued += rest  # until each reaches _start_one's admission
                futures = [self._starter.submit(self._start_one, spec, None, first, True)
                           for _ in range(rest)]
                errors: list[BaseException] = []
                for f in futures:
                    try:
                        made.append(f.result())
                    except BaseException as err:  # noqa: BLE001 - the first re-raised
                        errors.append(err)
                if errors:
                    raise errors[0]
            for entry in claimed:  # a claimed sandbox starts its lease and log now
                self._activate(entry, spec)
                if first is not None:
                    entry.first = self._run_first(entry, first)
        except BaseException:
            for entry in made:
                with contextlib.suppress(Exception):
                    self._close_entry(entry)
            raise
        finally:
            self._release(spec, count)
        with self._lock:
            for entry in made:
                self._entries[entry.sandbox.id] = entry
        self._refill.set()
        return [self._answer(entry, first) for entry in made]

    def claim(self, spec: CreateSpec, count: int, first: FirstExec | None = None
              ) -> list[Any]:
        """Up to ``count`` ready sandboxes of ``spec`` from this node's warm pool (maybe
        none; never starts one): the client's one-call fast path for a warmed spec. With
        ``first``, each runs that command before the reply (``(record, ExecResult)`` pairs, as
        ``create_batch``), and the pool's refill starts only after it: a claimer's first
        command does not share the node's CPU with the start of its replacement."""
        claimed = self._claim_warm(spec, count)
        try:
            for entry in claimed:
                self._activate(entry, spec)
                if first is not None:
                    entry.first = self._run_first(entry, first)
        except BaseException:  # all or none, as create_batch: none is left half-claimed
            self._close_entries(claimed)
            raise
        else:
            with self._lock:
                for entry in claimed:
                    self._entries[entry.sandbox.id] = entry
            return [self._answer(e, first) for e in claimed]
        finally:
            if claimed:
                self._refill.set()

    def _run_first(self, entry: Entry, first: FirstExec) -> ExecResult:
        cmd, kwargs = first
        result = entry.sandbox.exec(cmd, **kwargs)
        self._log(entry, "exec", cmd=cmd, kwargs=kwargs, result=result)
        return result

    def _answer(self, entry: Entry, first: FirstExec | None) -> Any:
        record = self._handed(entry)
        if first is None:
            return record
        result, entry.first = entry.first, None
        return record, result

    def _resolve(self, digest: str) -> Any:
        """The ``ResolvedLock`` of a lock digest, read from the store once (a digest names
        one content forever)."""
        lock = self._locks.get(digest)
        if lock is None:
            from runtime_shim.node.locks import resolve

            lock = resolve(self.store, digest)
            if digest == lock.digest:
                self._locks[digest] = lock
        return lock

    def _new_sandbox(self, spec: CreateSpec) -> Any:
        """One started sandbox of ``spec`` on this node, in a create worker if there are any
        (``runtime_shim.fleet.workers``): the node's own work (``benchmarks/cell_sim.py``
        puts a simulated node here)."""
        return start_sandbox(spec, store=self.store, node_dir=str(self.layout.root),
                             runtime=self.config.runtime, workers=self._workers)

    def _start_one(self, spec: CreateSpec, pool: str | None = None,
                   first: FirstExec | None = None, queued: bool = False) -> Entry:
        """Start one sandbox once admitted (``queued``: already counted as queued)."""
        if not queued:
            with self._lock:
                self._queued += 1
        with self._admit:
            with self._lock:
                self._queued -= 1
                self._starting += 1
            try:
                sb = self._new_sandbox(spec)
            finally:
                with self._lock:
                    self._starting -= 1
        entry = Entry(sandbox=sb, spec=spec, lease_expires=0.0, exec_log=None, pool=pool)
        try:
            if pool is None:
                self._activate(entry, spec)
                if first is not None:  # in this start thread: the batch's execs run at once
                    entry.first = self._run_first(entry, first)
            else:
                # a first exec costs ~10x the next ones (the agent's first connection): pay it
                # while the sandbox waits in the pool, not in the claimer's first command
                sb.exec("true", timeout=30)
                self._write_record(entry)
        except BaseException:
            with contextlib.suppress(Exception):
                sb.close()
            raise
        return entry

    def _activate(self, entry: Entry, spec: CreateSpec) -> None:
        """Give a sandbox its lease, labels and exec log, and record them on disk."""
        entry.spec = spec
        entry.pool = None
        entry.lease_expires = time.time() + (spec.ttl or DEFAULT_TTL)
        entry.token = secrets.token_hex(32) if self._data else None
        if spec.exec_log:
            from runtime_shim.fleet import execlog

            entry.exec_log = entry.sandbox.id
            execlog.start(self.store, entry.exec_log, lock=spec.lock, node_id=self.node_id)
        self._write_record(entry)

    def close(self, sandbox_id: str) -> None:
        """Close one sandbox; idempotent for one this daemon closed, ``SandboxNotFound``
        for an id it never had."""
        check_sdk_id(sandbox_id)
        with self._lock:
            entry = self._entries.pop(sandbox_id, None)
        if entry is None:
            if os.path.lexists(self.layout.sandbox(sandbox_id).root):
                from runtime_shim.sdk.sandbox import remove_sandbox

                remove_sandbox(self.layout, sandbox_id, self.config.runtime)
                return
            raise self._not_found(sandbox_id)
        self._close_entry(entry)

    def close_all(self, lock: str | None = None,
                  labels: Sequence[tuple[str, str]] = ()) -> list[str]:
        """Close every (non-pooled) sandbox, or those of ``lock`` / with ``labels``."""
        with self._lock:
            chosen = [k for k, e in self._entries.items() if not e.pool
                      and (lock is None or e.spec.lock == lock) and matches(e.spec, labels)]
            entries = [self._entries.pop(k) for k in chosen]
        self._close_entries(entries)
        return chosen

    def _close_entries(self, entries: Sequence[Entry]) -> None:
        """Close these, ``max_starting`` at a time (a close is node-local work like a start)."""
        def close(e: Entry) -> None:
            with contextlib.suppress(Exception):
                self._close_entry(e)

        if len(entries) < 2:
            for e in entries:
                close(e)
            return
        with ThreadPoolExecutor(max_workers=max(1, self.config.max_starting)) as pool:
            list(pool.map(close, entries))

    def shutdown(self, remove: bool = True) -> list[str]:
        """Stop the reaper and pools; with ``remove``, close every sandbox of the node (the
        pooled ones too). The ids closed."""
        self._stop.set()
        self._refill.set()
        self._pool_thread.join(timeout=120)  # a pool start in flight finishes (or is closed)
        with self._lock:
            self._pools.clear()
            entries = list(self._entries.items()) if remove else []
            for k, _ in entries:
                self._entries.pop(k, None)
        self._close_entries([e for _, e in entries])
        diskpool.unmount_all_idle()  # what the closes left in its grace: ray.kill runs no atexit
        self._starter.shutdown(wait=False)
        if self._workers is not None:
            self._workers.shutdown()
        if self._data is not None:
            self._data.close()
        return [k for k, _ in entries]

    def attach(self, sandbox_id: str, ttl: float | None = None) -> SandboxRecord:
        """The record of a live sandbox; renews its lease."""
        return self.renew(sandbox_id, ttl)

    def renew(self, sandbox_id: str, ttl: float | None = None) -> SandboxRecord:
        entry = self._entry(sandbox_id)
        entry.lease_expires = time.time() + (ttl or entry.spec.ttl or DEFAULT_TTL)
        with self._lock:
            self._entries.leased(sandbox_id)
        self._write_record(entry)
        return self._handed(entry)

    def gc(self) -> builtins.list[str]:
        """Close sandboxes past their lease and remove dirs of sandboxes nobody owns."""
        removed = self._reap_expired()
        with self._lock:
            known = set(self._entries)
        from runtime_shim.sdk.sandbox import list_sandboxes, remove_sandbox

        for info in list_sandboxes(self.layout):
            if info.id in known or info.pid == os.getpid() or child_of(info.pid, os.getpid()):
                continue  # ours, or being created by this daemon (or its worker) right now
            with contextlib.suppress(EnvbuildError, OSError):
                remove_sandbox(self.layout, info.id, self.config.runtime)
                removed.append(info.id)
        return removed

    # -- sandbox methods -------------------------------------------------------------------

    def exec(self, sandbox_id: str, cmd: str | Sequence[str], kwargs: Mapping[str, Any]
             ) -> ExecResult:
        entry = self._entry(sandbox_id)
        result = entry.sandbox.exec(cmd, **kwargs)
        self._log(entry, "exec", cmd=cmd, kwargs=kwargs, result=result)
        return result

    def exec_stream(self, sandbox_id: str, cmd: str | Sequence[str],
                    kwargs: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        """Like ``exec``, yielding ``("stdout"|"stderr", bytes)`` as output arrives, then
        ``("result", ExecResult)`` (or ``("error", exception)``)."""
        entry = self._entry(sandbox_id)
        chunks: queue.Queue[tuple[str, Any]] = queue.Queue()

        def run() -> None:
            try:
                result = entry.sandbox.exec(
                    cmd, on_stdout=lambda b: chunks.put(("stdout", bytes(b))),
                    on_stderr=lambda b: chunks.put(("stderr", bytes(b))), **kwargs)
                self._log(entry, "exec", cmd=cmd, kwargs=kwargs, result=result)
                chunks.put(("result", result))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                chunks.put(("error", e))

        threading.Thread(target=run, daemon=True, name="fleet-exec-stream").start()
        while True:
            kind, value = chunks.get()
            yield kind, value
            if kind in ("result", "error"):
                return

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        return self._entry(sandbox_id).sandbox.read_file(path)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        entry = self._entry(sandbox_id)
        entry.sandbox.write_file(path, data, mode)
        self._log(entry, "write", path=path, data=data, mode=mode)

    def set_network(self, sandbox_id: str, network: bool | Sequence[str]) -> None:
        """``Sandbox.set_network`` (not in the exec log: a replay keeps its sandbox's own)."""
        self._entry(sandbox_id).sandbox.set_network(
            network if isinstance(network, bool) else list(network))

    def pack_diff(self, sandbox_id: str, publish: str | None, kwargs: Mapping[str, Any]):
        return self._entry(sandbox_id).sandbox.pack_diff(publish, **kwargs)

    def grade(self, sandbox_id: str, task: str, kwargs: Mapping[str, Any]):
        """``runtime_shim.grade`` of sandbox ``sandbox_id`` of this node on ``task`` (a
        ``Verdict``): its changes are read here, the grading sandbox runs here, and the
        verdict is recorded in the fleet's store."""
        from runtime_shim.grading.grader import grade

        return grade(task, self._entry(sandbox_id).sandbox, store=self.store,
                     node_dir=self.layout, **kwargs)

    def replay(self, log_id: str, into_id: str, upto: int | None = None):
        """Re-run exec log ``log_id``'s first ``upto`` entries (all by default) in sandbox
        ``into_id`` of this node, in order: an ``execlog.ReplayReport``."""
        from runtime_shim.fleet import execlog

        self._entry(into_id)
        log = execlog.read(self.store, log_id)
        return execlog.replay_ops(log, lambda cmd, kw: self.exec(into_id, cmd, kw),
                                  lambda p, d, m: self.write_file(into_id, p, d, m), upto)

    def info(self, sandbox_id: str) -> tuple[SandboxInfo, SandboxRecord]:
        entry = self._entry(sandbox_id)
        return entry.sandbox.info(), self._record(entry)

    # -- internals -------------------------------------------------------------------------

    def _entry(self, sandbox_id: str) -> Entry:
        check_sdk_id(sandbox_id)
        with self._lock:
            entry = self._entries.get(sandbox_id)
        if entry is None or entry.pool:
            raise self._not_found(sandbox_id)
        return entry

    def _not_found(self, sandbox_id: str) -> SandboxNotFound:
        return SandboxNotFound(f"no sandbox {fleet_id(sandbox_id, self.node_id)} on node "
                               f"{self.node_id[:12]}",
                               hint="it was closed or its lease ran out; `envbuild fleet ls` "
                                    "lists the live ones")

    def _record(self, e: Entry) -> SandboxRecord:
        return record_of(e, self.node_id)

    def _handed(self, e: Entry) -> SandboxRecord:
        """The record for the sandbox's creator or attacher: with its data-plane token."""
        record = self._record(e)
        if self._data is None or not e.token:
            return record
        return dataclasses.replace(record, data_addr=self._data.address, token=e.token)

    def _data_answer(self, request: Any) -> dict[str, Any]:
        return answer(self, request)

    def data_sandbox(self, sandbox_id: str) -> Any:
        return self._entry(sandbox_id).sandbox

    def data_token(self, sandbox_id: str) -> str | None:
        """The data-plane token of a live, handed-out sandbox (None: no such sandbox)."""
        with self._lock:
            entry = self._entries.get(check_sdk_id(sandbox_id))
        return entry.token if entry is not None and not entry.pool else None

    def _write_record(self, e: Entry) -> None:
        write_record(e, self.node_id)

    def _log(self, entry: Entry, op: str, **fields: Any) -> None:
        if not entry.exec_log:
            return
        from runtime_shim.fleet import execlog

        with entry.log_lock:  # one sandbox's entries in the order they ran
            entry.seq += 1
            execlog.append(self.store, entry.exec_log, entry.seq, op, **fields)

    def _close_entry(self, e: Entry) -> None:
        e.sandbox.close()

    def _reserve(self, spec: CreateSpec, count: int) -> None:
        need = memory_of(spec) * count
        with self._lock:
            pooled = self._entries.pool_count(spec.pool_key())
            used = len(self._entries) + self._reserved - min(pooled, count)
            memory_used = self._reserved_memory + self._entries.memory
            if used + count > self.config.slots or memory_used + need > self._memory_budget():
                raise RuntimeShimError(
                    f"node {self.node_id[:12]} has room for {max(0, self.config.slots - used)} "
                    f"more sandbox(es), {count} asked", reference="fleet-full",
                    hint="create fewer, close some (`envbuild fleet rm`), or add nodes")
            self._reserved += count
            self._reserved_memory += need

    def _release(self, spec: CreateSpec, count: int) -> None:
        with self._lock:
            self._reserved -= count
            self._reserved_memory -= memory_of(spec) * count

    def _memory_budget(self) -> int:
        if self.config.memory_bytes is not None:
            return self.config.memory_bytes
        return 4 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def _count_pulled(self, lock: Any) -> None:
        from runtime_shim.node.nodecache import NodeCache

        node = NodeCache(self.layout.node)
        with self._lock:
            for layer in lock.layers:
                if layer.digest not in self._counted and not node.on_node(layer.digest):
                    self._pulled += layer.size
                self._counted.add(layer.digest)

    def _reap_expired(self) -> list[str]:
        now = time.time()
        with self._lock:
            expired = self._entries.expired(now)  # not a scan of every sandbox
            entries = [self._entries.pop(k) for k in expired]
        for e in entries:
            with contextlib.suppress(Exception):
                self._close_entry(e)
        return expired

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.config.reap_interval):
            with contextlib.suppress(Exception):
                self._reap_expired()


def reap_node_dir(node_dir: str | os.PathLike[str]) -> list[str]:
    """Remove every sandbox of a node dir (what a daemon does for a node that is gone): the
    ids removed. For operators and tests after a node was lost."""
    from runtime_shim.sdk.sandbox import list_sandboxes, remove_sandbox

    node_dir = os.path.realpath(node_dir)  # mounts are listed by their real path
    removed = []
    for info in list_sandboxes(node_dir):
        with contextlib.suppress(SandboxNotFound):
            remove_sandbox(node_dir, info.id)
            removed.append(info.id)
    return removed


# the data types and ids live in runtime_shim.fleet.model, the record in .leases; importable
# from here as before
__all__ = ["ACTOR_PREFIX", "DEFAULT_TTL", "FLEET_RECORD", "FLEET_RECORD_VERSION", "NAMESPACE",
           "REFILL_DELAY", "CreateSpec", "DaemonConfig", "FirstExec", "NodeDaemon", "NodeStatus",
           "SandboxRecord", "actor_name", "fleet_id", "reap_node_dir", "split_fleet_id"]
