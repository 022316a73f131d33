"""The node daemon: one per Ray node that offers ``envbuild_node``, owning that node's sandboxes.

``NodeDaemon`` is a plain class (so it is usable and testable without Ray) that the fleet runs
as a named, detached Ray actor (``actor_name(node_id)`` in namespace ``NAMESPACE``, started by
``runtime_shim.fleet.client.start_daemons``, ``num_cpus=0`` plus one unit of ``envbuild_node``
so exactly one fits a node). It makes every sandbox with the SDK (``Sandbox.create``), so any
backend in ``runtime_shim.backends.base``'s registry works unchanged, against one node dir
(``DaemonConfig.node_dir``, a template in which ``{node_id}`` is the Ray node id, so several Ray
nodes on one test host do not collide) and one shared store (S3, or a directory for a
single-host cluster).

On-disk record (version ``FLEET_RECORD_VERSION``): next to each sandbox's ``sandbox.json``, a
``fleet.json`` ``{version, id, node_id, lock, backend, lazy, ttl, lease_expires, exec_log,
labels, pool}``, written before the daemon reports the sandbox. A daemon that starts (after a
crash, or Ray's restart of it) re-adopts every sandbox of its node dir that has a record, a
live lease and still runs (``Sandbox.attach``), and removes every other one (no record: a
create cut short; lease past; not running; a backend that cannot be attached, e.g. a microVM
whose QEMU died with the old daemon). Nothing is left for nobody.

Leases: a sandbox lives until closed or until ``lease_expires`` (``ttl`` seconds after create,
attach or ``renew``); the daemon's reaper thread closes expired ones. Admission control: at
most ``max_starting`` sandboxes of the node are STARTING at once; more wait in a queue (a
burst becomes a queue, not timeouts). Capacity: ``slots`` sandboxes and ``memory_bytes`` of
``Limits.memory_bytes`` per node; a batch that does not fit is refused whole
(``RuntimeShimError`` ``fleet-full``) before anything is started.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envbuild.errors import (
    BackendUnavailable,
    EnvbuildError,
    RuntimeShimError,
    SandboxNotFound,
)
from runtime_shim.node.layout import NodeLayout
from runtime_shim.node.model import ExecResult, Limits, SandboxInfo

NAMESPACE = "envbuild"
ACTOR_PREFIX = "envbuild-node-"
FLEET_RECORD = "fleet.json"
FLEET_RECORD_VERSION = 1
#: Seconds a warm pool waits after a claim before it starts the replacement.
REFILL_DELAY = 0.05
#: The lease of a sandbox created without ``ttl=`` (seconds).
DEFAULT_TTL = 3600.0


#: A command to run in each new sandbox within its create call: ``(cmd, Sandbox.exec kwargs)``.
FirstExec = tuple[Any, Mapping[str, Any]]


def actor_name(node_id: str) -> str:
    """The Ray actor name of the daemon of Ray node ``node_id`` (hex)."""
    return ACTOR_PREFIX + node_id


@dataclasses.dataclass(frozen=True)
class DaemonConfig:
    """How a node daemon runs. ``store``: an ``s3://BUCKET/PREFIX`` URL or a directory every
    node can read; ``node_dir``: the node dir, ``{node_id}`` replaced by the Ray node id;
    ``slots`` / ``memory_bytes``: capacity (sandboxes; sum of their ``Limits.memory_bytes``,
    None: 4 × the host's memory, since limits are caps, not reservations); ``max_starting``:
    admission control; ``runtime``: the OCI runtime; ``niceness``: the nice value the daemon's
    threads, and so the sandboxes they start, run at (Ray starts its workers at 15, which on a
    busy node starves starts and execs behind every normal process; None: leave Ray's)."""

    store: str
    node_dir: str
    s3_endpoint: str | None = None
    slots: int = 256
    memory_bytes: int | None = None
    max_starting: int = 4
    runtime: str = "runc"
    reap_interval: float = 1.0
    niceness: int | None = 0

    def node_dir_for(self, node_id: str) -> str:
        return self.node_dir.replace("{node_id}", node_id)


@dataclasses.dataclass(frozen=True)
class CreateSpec:
    """What to create (one ``Fleet.create`` call): ``lock`` is a digest (the client resolved
    it); the rest are ``Sandbox.create``'s arguments; ``ttl`` the lease (None: ``DEFAULT_TTL``);
    ``exec_log``: record every exec and file write in the store (``runtime_shim.fleet.execlog``);
    ``labels``: free-form ``(key, value)`` pairs that ``list``/``close_all`` filter on."""

    lock: str
    backend: str = "container"
    lazy: bool = False
    network: bool | tuple[str, ...] = False
    limits: Limits | None = None
    seccomp: str | None = None
    ttl: float | None = None
    exec_log: bool = False
    labels: tuple[tuple[str, str], ...] = ()

    def pool_key(self) -> str:
        """What makes two warm sandboxes interchangeable (not lease, log or labels)."""
        ident = {"lock": self.lock, "backend": self.backend, "lazy": self.lazy,
                 "network": list(self.network) if isinstance(self.network, tuple)
                 else self.network,
                 "limits": dataclasses.asdict(self.limits or Limits()), "seccomp": self.seccomp}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class SandboxRecord:
    """One fleet sandbox as its daemon reports it. ``id`` is ``SDK-ID@NODE`` (``fleet_id``)."""

    id: str
    node_id: str
    lock: str
    backend: str
    created: float
    ready: float
    lease_expires: float
    exec_log: str | None
    labels: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    """One node's capacity and load (``Fleet.nodes()``). ``cached``: of the layers asked
    about, those already in its node cache (locality); ``pulled_bytes``: layer bytes this
    daemon has fetched from the store since it started; ``warm``: ready pooled sandboxes;
    ``pools``: ``(pool key, ready count)`` of the pools asked about."""

    node_id: str
    node_dir: str
    store: str
    slots: int
    used: int
    starting: int
    queued: int
    memory_bytes: int
    memory_used: int
    warm: int
    pulled_bytes: int
    cached: tuple[str, ...] = ()
    pid: int = 0
    pools: tuple[tuple[str, int], ...] = ()

    @property
    def free(self) -> int:
        return max(0, self.slots - self.used)


_SDK_ID = re.compile(r"eb-[0-9a-f]{12}")


def _check_sdk_id(sandbox_id: object) -> str:
    """An SDK sandbox id (``eb-`` and 12 hex digits), never a path: ``SandboxNotFound``
    for anything else, before it is joined to the node dir."""
    if not isinstance(sandbox_id, str) or not _SDK_ID.fullmatch(sandbox_id):
        raise SandboxNotFound(f"{sandbox_id!r} is not a sandbox id",
                              hint="sandbox ids look like eb-0123456789ab")
    return sandbox_id


def fleet_id(sandbox_id: str, node_id: str) -> str:
    """The fleet's id of a sandbox: the SDK id and the first 12 hex digits of its Ray node."""
    return f"{sandbox_id}@{node_id[:12]}"


def split_fleet_id(value: str) -> tuple[str, str]:
    """``(sdk_id, node_prefix)`` of a fleet id, or ``SandboxNotFound`` if it is not one."""
    sdk_id, sep, node = value.partition("@")
    if not sep or not _SDK_ID.fullmatch(sdk_id) or len(node) != 12 or not all(
            c in "0123456789abcdef" for c in node):
        raise SandboxNotFound(f"{value!r} is not a fleet sandbox id",
                              hint="fleet ids look like eb-0123456789ab@0123456789ab; "
                                   "`envbuild fleet ls` lists them")
    return sdk_id, node


@dataclasses.dataclass
class _Entry:
    sandbox: Any  # runtime_shim.sdk.sandbox.Sandbox
    spec: CreateSpec
    lease_expires: float
    exec_log: str | None
    pool: str | None = None  # the pool key while it waits in a warm pool
    seq: int = 0  # exec log entries written
    first: ExecResult | None = None  # a batch's first exec, until it is handed back
    log_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class NodeDaemon:
    """The sandboxes of one node (see the module docstring). Thread-safe: the Ray actor runs
    it with many concurrent calls (``max_concurrency``)."""

    def __init__(self, config: DaemonConfig, node_id: str | None = None) -> None:
        from runtime_shim.sdk.sandbox import open_store

        if node_id is None:
            import ray

            node_id = ray.get_runtime_context().get_node_id()
        self.config = config
        self.node_id = node_id
        self._renice_threads()
        # the real path: the SDK finds a sandbox's mounts by it (a symlinked node dir would hide them)
        self.layout = NodeLayout(os.path.realpath(config.node_dir_for(node_id)))
        self.layout.ensure()
        self.store = open_store(_open_url(config.store, config.s3_endpoint))
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._reserved = 0  # slots of batches being started
        self._reserved_memory = 0
        self._starting = 0
        self._queued = 0
        self._admit = threading.BoundedSemaphore(max(1, config.max_starting))
        self._pulled = 0
        self._counted: set[str] = set()
        self._pools: dict[str, tuple[CreateSpec, int]] = {}  # key -> (spec, target)
        self._stop = threading.Event()
        self.adopted, self.reaped = self._adopt()
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
                "reaped": self.reaped}

    def status(self, layers: Sequence[str] = (), pool_keys: Sequence[str] = ()) -> NodeStatus:
        from runtime_shim.node.nodecache import NodeCache

        node = NodeCache(self.layout.node)
        cached = tuple(d for d in layers if node.has(d) or node.lazy_mounted(d))
        with self._lock:
            used = len(self._entries) + self._reserved
            memory_used = self._reserved_memory + sum(
                _memory(e.spec) for e in self._entries.values())
            warm = sum(1 for e in self._entries.values() if e.pool)
            pools = tuple((k, sum(1 for e in self._entries.values() if e.pool == k))
                          for k in pool_keys)
            return NodeStatus(node_id=self.node_id, node_dir=str(self.layout.root),
                              store=self.config.store, slots=self.config.slots, used=used,
                              starting=self._starting, queued=self._queued,
                              memory_bytes=self._memory_budget(), memory_used=memory_used,
                              warm=warm, pulled_bytes=self._pulled, cached=cached,
                              pid=os.getpid(), pools=pools)

    def list_sandboxes(self, labels: Sequence[tuple[str, str]] = ()) -> list[SandboxRecord]:
        with self._lock:
            entries = [(k, e) for k, e in self._entries.items() if not e.pool]
        return [self._record(e) for _, e in entries if _matches(e.spec, labels)]

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
        from runtime_shim.node.locks import resolve

        lock = resolve(self.store, spec.lock)  # LockNotFound before anything is reserved
        self._reserve(spec, count)
        made: list[_Entry] = []
        try:
            claimed = self._claim_warm(spec, count)
            made.extend(claimed)
            self._count_pulled(lock)
            rest = count - len(claimed)
            if rest:
                with ThreadPoolExecutor(max_workers=max(1, self.config.max_starting)) as pool:
                    futures = [pool.submit(self._start_one, spec, None, first)
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

    def _run_first(self, entry: _Entry, first: FirstExec) -> ExecResult:
        cmd, kwargs = first
        result = entry.sandbox.exec(cmd, **kwargs)
        self._log(entry, "exec", cmd=cmd, kwargs=kwargs, result=result)
        return result

    def _answer(self, entry: _Entry, first: FirstExec | None) -> Any:
        record = self._record(entry)
        if first is None:
            return record
        result, entry.first = entry.first, None
        return record, result

    def _start_one(self, spec: CreateSpec, pool: str | None = None,
                   first: FirstExec | None = None) -> _Entry:
        from runtime_shim.sdk.sandbox import Sandbox

        with self._lock:
            self._queued += 1
        with self._admit:
            with self._lock:
                self._queued -= 1
                self._starting += 1
            try:
                sb = Sandbox.create(
                    spec.lock, store=self.store, node_dir=str(self.layout.root), backend=spec.backend,
                    network=list(spec.network) if isinstance(spec.network, tuple)
                    else spec.network,
                    limits=spec.limits, runtime=self.config.runtime, keep=_can_keep(spec),
                    lazy=spec.lazy, seccomp=spec.seccomp, reap=False)
            finally:
                with self._lock:
                    self._starting -= 1
        entry = _Entry(sandbox=sb, spec=spec, lease_expires=0.0, exec_log=None, pool=pool)
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

    def _activate(self, entry: _Entry, spec: CreateSpec) -> None:
        """Give a sandbox its lease, labels and exec log, and record them on disk."""
        entry.spec = spec
        entry.pool = None
        entry.lease_expires = time.time() + (spec.ttl or DEFAULT_TTL)
        if spec.exec_log:
            from runtime_shim.fleet import execlog

            entry.exec_log = entry.sandbox.id
            execlog.start(self.store, entry.exec_log, lock=spec.lock, node_id=self.node_id)
        self._write_record(entry)

    def close(self, sandbox_id: str) -> None:
        """Close one sandbox; idempotent for one this daemon closed, ``SandboxNotFound``
        for an id it never had."""
        _check_sdk_id(sandbox_id)
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
                      and (lock is None or e.spec.lock == lock) and _matches(e.spec, labels)]
            entries = [self._entries.pop(k) for k in chosen]
        self._close_entries(entries)
        return chosen

    def _close_entries(self, entries: Sequence[_Entry]) -> None:
        """Close these, ``max_starting`` at a time (a close is node-local work like a start)."""
        def close(e: _Entry) -> None:
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
        return [k for k, _ in entries]

    def attach(self, sandbox_id: str, ttl: float | None = None) -> SandboxRecord:
        """The record of a live sandbox; renews its lease."""
        return self.renew(sandbox_id, ttl)

    def renew(self, sandbox_id: str, ttl: float | None = None) -> SandboxRecord:
        entry = self._entry(sandbox_id)
        entry.lease_expires = time.time() + (ttl or entry.spec.ttl or DEFAULT_TTL)
        self._write_record(entry)
        return self._record(entry)

    def gc(self) -> builtins.list[str]:
        """Close sandboxes past their lease and remove dirs of sandboxes nobody owns."""
        removed = self._reap_expired()
        with self._lock:
            known = set(self._entries)
        from runtime_shim.sdk.sandbox import list_sandboxes, remove_sandbox

        for info in list_sandboxes(self.layout):
            if info.id in known or info.pid == os.getpid():
                continue  # ours, or being created by this daemon right now
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

    # -- warm pools ------------------------------------------------------------------------

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
            return sum(1 for e in self._entries.values() if e.pool == key)

    def _claim_warm(self, spec: CreateSpec, count: int) -> list[_Entry]:
        key = spec.pool_key()
        with self._lock:
            ids = [k for k, e in self._entries.items() if e.pool == key][:count]
            return [self._entries.pop(k) for k in ids]

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
                while not self._stop.is_set():
                    with self._lock:
                        have = sum(1 for e in self._entries.values() if e.pool == key)
                        used = len(self._entries) + self._reserved
                        if (have >= target or used >= self.config.slots
                                or self._pools.get(key, (None, 0))[1] != target):
                            break
                        self._reserved += 1
                    try:
                        entry = self._start_one(spec, pool=key)
                    except Exception:  # noqa: BLE001 - a failing pool retries next round
                        with self._lock:
                            self._reserved -= 1
                        break
                    with self._lock:
                        self._reserved -= 1
                        stopped = self._stop.is_set()
                        dropped = key not in self._pools  # warm(per_node=0) meanwhile
                        if not stopped and not dropped:
                            self._entries[entry.sandbox.id] = entry
                    if stopped or dropped:  # nobody else will close it
                        with contextlib.suppress(Exception):
                            self._close_entry(entry)
                        if stopped:
                            return
                        break

    # -- internals -------------------------------------------------------------------------

    def _entry(self, sandbox_id: str) -> _Entry:
        _check_sdk_id(sandbox_id)
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

    def _record(self, e: _Entry) -> SandboxRecord:
        meta = _read_json(e.sandbox.paths.meta) or {}
        return SandboxRecord(id=fleet_id(e.sandbox.id, self.node_id), node_id=self.node_id,
                             lock=e.spec.lock, backend=e.spec.backend,
                             created=float(meta.get("created", 0.0)),
                             ready=float(meta.get("ready", 0.0)),
                             lease_expires=e.lease_expires, exec_log=e.exec_log,
                             labels=e.spec.labels)

    def _write_record(self, e: _Entry) -> None:
        spec = e.spec
        record = {"version": FLEET_RECORD_VERSION, "id": e.sandbox.id, "node_id": self.node_id,
                  "spec": {"lock": spec.lock, "backend": spec.backend, "lazy": spec.lazy,
                           "network": list(spec.network) if isinstance(spec.network, tuple)
                           else spec.network,
                           "limits": dataclasses.asdict(spec.limits) if spec.limits else None,
                           "seccomp": spec.seccomp, "ttl": spec.ttl,
                           "exec_log": spec.exec_log, "labels": [list(x) for x in spec.labels]},
                  "lease_expires": e.lease_expires, "exec_log": e.exec_log, "pool": e.pool}
        path = e.sandbox.paths.root / FLEET_RECORD
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)

    def _log(self, entry: _Entry, op: str, **fields: Any) -> None:
        if not entry.exec_log:
            return
        from runtime_shim.fleet import execlog

        with entry.log_lock:  # one sandbox's entries in the order they ran
            entry.seq += 1
            execlog.append(self.store, entry.exec_log, entry.seq, op, **fields)

    def _close_entry(self, e: _Entry) -> None:
        e.sandbox.close()

    def _reserve(self, spec: CreateSpec, count: int) -> None:
        need = _memory(spec) * count
        with self._lock:
            pooled = sum(1 for e in self._entries.values() if e.pool == spec.pool_key())
            used = len(self._entries) + self._reserved - min(pooled, count)
            memory_used = self._reserved_memory + sum(
                _memory(e.spec) for e in self._entries.values())
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
            self._reserved_memory -= _memory(spec) * count

    def _memory_budget(self) -> int:
        if self.config.memory_bytes is not None:
            return self.config.memory_bytes
        return 4 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def _count_pulled(self, lock: Any) -> None:
        from runtime_shim.node.nodecache import NodeCache

        node = NodeCache(self.layout.node)
        with self._lock:
            for layer in lock.layers:
                if layer.digest not in self._counted and not node.has(layer.digest) \
                        and not node.lazy_mounted(layer.digest):
                    self._pulled += layer.size
                self._counted.add(layer.digest)

    def _reap_expired(self) -> list[str]:
        now = time.time()
        with self._lock:
            expired = [k for k, e in self._entries.items()
                       if not e.pool and e.lease_expires and e.lease_expires <= now]
            entries = [self._entries.pop(k) for k in expired]
        for e in entries:
            with contextlib.suppress(Exception):
                self._close_entry(e)
        return expired

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.config.reap_interval):
            with contextlib.suppress(Exception):
                self._reap_expired()

    def _adopt(self) -> tuple[list[str], list[str]]:
        """Re-adopt the node dir's live sandboxes, remove the rest (module docstring)."""
        from runtime_shim.sdk.sandbox import Sandbox, list_sandboxes, remove_sandbox

        adopted: list[str] = []
        reaped: list[str] = []
        now = time.time()
        for info in list_sandboxes(self.layout):
            record = _read_json(info.path / FLEET_RECORD)
            entry = None
            if record and record.get("version") == FLEET_RECORD_VERSION and (
                    record.get("pool") or record.get("lease_expires", 0) > now):
                with contextlib.suppress(EnvbuildError, OSError):
                    sb = Sandbox.attach(info.id, store=self.store, node_dir=str(self.layout.root),
                                        runtime=self.config.runtime)
                    spec = _spec_from_record(record["spec"])
                    entry = _Entry(sandbox=sb, spec=spec,
                                   lease_expires=float(record.get("lease_expires", 0.0)),
                                   exec_log=record.get("exec_log"), pool=record.get("pool"))
                    if entry.exec_log:
                        from runtime_shim.fleet import execlog

                        entry.seq = execlog.length(self.store, entry.exec_log)
            if entry is not None:
                self._entries[info.id] = entry
                adopted.append(info.id)
                continue
            with contextlib.suppress(EnvbuildError, OSError):
                remove_sandbox(self.layout, info.id, self.config.runtime)
            reaped.append(info.id)
        # a pooled sandbox's pool is gone with the old daemon: close it, keep the claimed ones
        for k in [k for k, e in self._entries.items() if e.pool]:
            with contextlib.suppress(Exception):
                self._close_entry(self._entries.pop(k))
            adopted.remove(k)
            reaped.append(k)
        return adopted, reaped


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


def _open_url(store: str, s3_endpoint: str | None):
    if store.startswith("s3://"):
        from envbuild.store import open_store

        return open_store(store, s3_endpoint=s3_endpoint)
    return store


def _can_keep(spec: CreateSpec) -> bool:
    """keep=True (the sandbox outlives its creator: the daemon may crash and re-adopt it)
    where the backend allows it."""
    from runtime_shim.backends.base import get_backend

    try:
        get_backend(spec.backend).check(keep=True, seccomp=spec.seccomp, lazy=spec.lazy)
    except BackendUnavailable:
        return False
    return True


def _memory(spec: CreateSpec) -> int:
    limits = spec.limits or Limits()
    return limits.memory_bytes or 0


def _matches(spec: CreateSpec, labels: Sequence[tuple[str, str]]) -> bool:
    have = set(spec.labels)
    return all(tuple(x) in have for x in labels)


def _read_json(path: os.PathLike[str] | str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _spec_from_record(obj: Mapping[str, Any]) -> CreateSpec:
    limits = obj.get("limits")
    network = obj.get("network", False)
    return CreateSpec(lock=obj["lock"], backend=obj.get("backend", "container"),
                      lazy=bool(obj.get("lazy")),
                      network=tuple(network) if isinstance(network, list) else bool(network),
                      limits=Limits(**limits) if limits else None, seccomp=obj.get("seccomp"),
                      ttl=obj.get("ttl"), exec_log=bool(obj.get("exec_log")),
                      labels=tuple((str(k), str(v)) for k, v in obj.get("labels", ())))


__all__ = ["ACTOR_PREFIX", "DEFAULT_TTL", "NAMESPACE", "CreateSpec", "DaemonConfig", "NodeDaemon",
           "NodeStatus", "SandboxRecord", "actor_name", "fleet_id",
           "reap_node_dir", "split_fleet_id"]
