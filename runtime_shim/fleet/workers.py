"""A node daemon's create workers: processes that run ``Sandbox.create`` so that a node's
starts do not share the daemon's one GIL (issue 39: "a node daemon that scales with its
cores").

With ``DaemonConfig.workers`` > 0 the daemon hands each start of a backend that can outlive
its creator (``keep=True``: containers) to one of that many worker processes (spawned, never
forked: the daemon is a Ray actor full of threads). A worker makes the sandbox with
``keep=True`` and answers its id; the daemon then ``Sandbox.attach``es it, so the sandbox is
the daemon's as if it had made it (exec, files, close, leases, re-adoption: unchanged). Each
worker runs one start at a time, so ``workers`` is also the node's start concurrency
(admission's ``max_starting`` still bounds it). A worker that dies mid-start fails that start
(``RuntimeShimError``) and the pool is made again for the next; a sandbox a worker made but
the daemon could not attach is removed.

What stays in the daemon's process per create: the Ray call, admission, the attach (reading
the sandbox's record and lock) and the fleet record: ``benchmarks/fleet_workers.py`` measures
it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from envbuild.errors import RuntimeShimError
from runtime_shim.fleet.model import CreateSpec, DaemonConfig, open_url

_STATE: dict[str, Any] = {}


def _init(config: DaemonConfig, node_dir: str) -> None:
    """A worker's start: open the store once, take the daemon's niceness."""
    from runtime_shim.sdk.sandbox import open_store

    _STATE.update(store=open_store(open_url(config.store, config.s3_endpoint)),
                  node_dir=node_dir, runtime=config.runtime)
    if config.niceness is not None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, config.niceness)


def _create(spec: CreateSpec) -> str:
    """In a worker: one sandbox of ``spec``, kept (it outlives this process): its id."""
    from runtime_shim.sdk.sandbox import Sandbox

    sb = Sandbox.create(
        spec.lock, store=_STATE["store"], node_dir=_STATE["node_dir"], backend=spec.backend,
        network=list(spec.network) if isinstance(spec.network, tuple) else spec.network,
        limits=spec.limits, runtime=_STATE["runtime"], keep=True, lazy=spec.lazy,
        seccomp=spec.seccomp, reap=False)
    return sb.id


def _ping() -> int:
    return os.getpid()


class CreateWorkers:
    """``count`` worker processes of one daemon (module docstring)."""

    def __init__(self, count: int, config: DaemonConfig, node_dir: str) -> None:
        self.count = count
        self._args = (config, node_dir)
        self._lock = threading.Lock()
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=self.count,
                                   mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init, initargs=self._args)

    def start(self) -> list[int]:
        """Start every worker now (a spawned Python takes ~1 s): their pids. Each of the
        first ``count`` calls spawns one (none is idle yet); this process's children are
        the workers."""
        for f in [self._pool.submit(_ping) for _ in range(self.count)]:
            f.result()
        return sorted(p.pid for p in multiprocessing.active_children() if p.pid)

    def create(self, spec: CreateSpec) -> str:
        """The id of a new kept sandbox of ``spec``, made in a worker."""
        with self._lock:
            pool = self._pool
        try:
            return pool.submit(_create, spec).result()
        except BrokenProcessPool as e:
            with self._lock:
                if self._pool is pool:
                    self._pool = self._new_pool()
            raise RuntimeShimError(f"a create worker died during a start: {e}",
                                   hint="the next start uses a new worker; the node's "
                                        "memory or pids may be exhausted") from None

    def shutdown(self) -> None:
        with self._lock:
            self._pool.shutdown(wait=False, cancel_futures=True)


def start_sandbox(spec: CreateSpec, *, store: Any, node_dir: str, runtime: str,
                  workers: CreateWorkers | None) -> Any:
    """One started ``Sandbox`` of ``spec``: made in a worker and attached here when there are
    workers and the backend can be kept, else made in this process (keep=True where the
    backend allows it: the daemon may crash and re-adopt it)."""
    from runtime_shim.sdk.sandbox import Sandbox, remove_sandbox

    keep = can_keep(spec)
    if workers is not None and keep:
        sandbox_id = workers.create(spec)
        try:
            return Sandbox.attach(sandbox_id, store=store, node_dir=node_dir, runtime=runtime)
        except BaseException:
            with contextlib.suppress(Exception):
                remove_sandbox(node_dir, sandbox_id, runtime)
            raise
    return Sandbox.create(
        spec.lock, store=store, node_dir=node_dir, backend=spec.backend,
        network=list(spec.network) if isinstance(spec.network, tuple) else spec.network,
        limits=spec.limits, runtime=runtime, keep=keep, lazy=spec.lazy, seccomp=spec.seccomp,
        reap=False)


def can_keep(spec: CreateSpec) -> bool:
    """Whether ``spec``'s backend lets a sandbox outlive its creator (``keep=True``)."""
    from envbuild.errors import BackendUnavailable
    from runtime_shim.backends.base import get_backend

    try:
        get_backend(spec.backend).check(keep=True, seccomp=spec.seccomp, lazy=spec.lazy)
    except BackendUnavailable:
        return False
    return True


def child_of(pid: int, parent: int) -> bool:
    """Whether process ``pid`` is a child of ``parent`` (a daemon's worker)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, ValueError, IndexError):
        return False


__all__ = ["CreateWorkers", "can_keep", "child_of", "start_sandbox"]
