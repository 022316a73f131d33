"""The Ray task of one layer (``envbuild build --executor ray``; runs on a builder node).

``envbuild.build.ray_executor`` (the driver) documents the whole scheme. A task opens its
node's cache and the shared store once per worker process (``node_context``), builds its layer
with the local executor under the store's lease, sends its progress to the driver's actor in
batches and watches it for a cancel (``_Events``), and returns a JSON-able result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray

from envbuild.build.engine import _KeyLock, build_under_lease
from envbuild.build.executor import BuildContext, sweep_stale_scratch
from envbuild.build.layerjob import BuildEvent, LayerJob
from envbuild.errors import EnvbuildError, StepFailed
from envbuild.settings import Settings
from envbuild.store import KeyRecord, LocalStore, Store, open_store, put_file

#: Where a failed build's full log is recorded (``{"log": digest, ...}``).
LOG_RECORDS = "logs/v1"
LOG_RECORD_VERSION = 1
#: The internal event a task sends last (its scratch is gone, its lease dropped).
ENDED = "ended"
#: How often a running task asks the driver whether the build was cancelled (seconds).
CANCEL_POLL = 0.5
#: A file each task appends its phase times to (profiling; see ``_Outbox``).
TRACE_ENV = "ENVBUILD_RAY_TRACE"


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """What a task needs to open the store and its node cache: plain data, pickled to it."""

    settings: Settings
    environ: Mapping[str, str]
    #: The driver's working directory: definition origins below it are relative to it.
    cwd: str = "/"


_stores: dict[tuple[str, str | None], Store] = {}
_nodes: dict[str, tuple[Any, Any, Any]] = {}
_node_lock = threading.Lock()


def node_context(settings: Settings, node_id: str) -> BuildContext:
    """The ``BuildContext`` of this node: its own node cache (``{node_id}`` in the node dir
    expanded), the shared store, both opened once per worker process and reused by every task
    it runs, and a fresh ``cancelled``. Each call first reaps the build dirs of dead builders
    in this node cache (``envbuild.build.reaper``: a task killed with its worker or its node's
    raylet leaves its mounts, loop disk, container and cgroups; the next task here undoes them;
    a look at the owner files, ~0.1 ms, when there is nothing to reap)."""
    from runtime_shim.isolation import OciRuntime
    from runtime_shim.node import BudgetSettings, NodeCache, NodeLayout

    node_dir = str(settings.node_dir).replace("{node_id}", node_id)
    with _node_lock:
        key = (settings.store_url, settings.s3_endpoint)
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = open_store(settings.store_url, s3_endpoint=settings.s3_endpoint,
                                              registry_insecure=settings.registry_insecure)
        state = _nodes.get(node_dir)
        if state is None:
            layout = NodeLayout(Path(node_dir))
            state = _nodes[node_dir] = (layout, NodeCache(layout.node), OciRuntime(
                settings.oci_runtime, state_root=str(layout.runc)))
    layout, cache, runtime = state
    log_root = store.root / "logs" if isinstance(store, LocalStore) else layout.logs
    ctx = BuildContext(store=store, node=cache, runtime=runtime,
                       scratch_root=layout.builds, log_root=log_root,
                       source_date_epoch=settings.source_date_epoch,
                       disk_bytes=settings.build_disk_bytes, inodes=settings.build_inodes,
                       admission=BudgetSettings.from_env(dict(settings.budget_env)),
                       lease_ttl=settings.lease_ttl, lease_label=f"ray:{node_id}")
    sweep_stale_scratch(ctx.scratch_root, ctx.runtime)
    return ctx


def _error_json(e: EnvbuildError) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(e).__name__, "message": e.message, "hint": e.hint,
                           "context": e.context, "reference": e.reference}
    if isinstance(e, StepFailed):
        out.update(argv=list(e.argv), exit_code=e.exit_code, output_tail=e.output_tail,
                   log_path=e.log_path)
    return out


def _store_log(ctx: BuildContext, job: LayerJob, node_id: str, err: StepFailed) -> str | None:
    """Put a failed step's full log into the store; returns where (for the hint)."""
    if not err.log_path or not os.path.exists(err.log_path):
        return None
    try:
        info = put_file(ctx.store, err.log_path)
        ctx.store.put_record(LOG_RECORDS, job.key.removeprefix("sha256:"), {
            "version": LOG_RECORD_VERSION, "name": job.name, "node": node_id, "log": info.digest,
            "size": info.size, "exit_code": err.exit_code, "time": time.time()})
    except EnvbuildError:
        return None
    return info.digest


def run_layer(spec: NodeSpec, job: LayerJob, no_cache: bool, events: Any,
              lower: Mapping[str, Mapping[str, Any]], *below: Mapping[str, Any]
              ) -> dict[str, Any]:
    """The Ray task of one layer. ``lower``: key records of layers below it that the driver
    found in the store; ``below``: the results of the tasks of the layers it builds on (Ray
    passes them once those finished). Returns a JSON-able result: ``status`` built, cached,
    failed or skipped, ``key``, ``node``, ``seconds``, the key record or the error."""
    node_id = ray.get_runtime_context().get_node_id()
    short = node_id[:8]
    for b in below:
        if b["status"] in ("failed", "skipped"):
            return {"status": "skipped", "node": short, "blocked_by": b.get("blocked_by") or b["name"],
                    "name": job.name}
    os.environ.update(spec.environ)
    # Definition files below the driver's working directory are named relative to it
    # (envbuild.defs.load), so builds resolve their sources from there, as the driver would.
    os.chdir(spec.cwd)
    out = _Outbox(events, short, os.environ.get(TRACE_ENV))
    started = time.monotonic()
    if _driver_cancelled(events):  # started after the driver's Ctrl-C: do nothing
        return {"status": "skipped", "node": short, "blocked_by": "cancelled", "name": job.name}
    ctx = node_context(spec.settings, node_id)
    known = {k: KeyRecord.from_json(r) for k, r in lower.items()}
    known.update((b["key"], KeyRecord.from_json(b["record"])) for b in below
                 if b.get("key") and b.get("record"))
    ctx.known_records = known
    out.progress(BuildEvent(job.name, "started"))
    out.flush()
    result: dict[str, Any] = {}
    worker = threading.Thread(target=_build, args=(ctx, job, no_cache, node_id, out, result),
                              name=f"build-{job.name}", daemon=True)
    _follow(worker, ctx, events, out, job.name)
    result.update(node=short, seconds=round(time.monotonic() - started, 3), name=job.name,
                  key=job.key)
    if out.trace_to:
        _trace(out.trace_to, job.name, short, out.marks, result["status"])
    return result


class _Outbox:
    """A task's progress events, sent to the driver's actor in batches (one actor call per
    ``CANCEL_POLL``, not one per event: each call costs CPU on this worker, the actor and
    Ray's RPC layers). With ``ENVBUILD_RAY_TRACE=FILE`` (forward it with --ray-env) it also
    notes when (unix time, on its node) the task reached each phase, for
    benchmarks/ray_build.py."""

    def __init__(self, events: Any, node: str, trace_to: str | None) -> None:
        self.events, self.node, self.trace_to = events, node, trace_to
        self.marks: list[tuple[str, float]] = [("task", time.time())]
        self._outbox: list[BuildEvent] = []
        self._lock = threading.Lock()

    def progress(self, e: BuildEvent) -> None:
        if self.trace_to:
            self.marks.append((e.phase, time.time()))
        with self._lock:
            self._outbox.append(dataclasses.replace(e, node=self.node))

    def flush(self) -> None:
        with self._lock:
            batch = self._outbox[:]
            self._outbox.clear()
        if batch:
            self.events.put_many.remote(batch)


def _build(ctx: BuildContext, job: LayerJob, no_cache: bool, node_id: str, out: _Outbox,
           result: dict[str, Any]) -> None:
    """Build ``job`` under its lease (on the task's build thread); ``result`` gets its status
    and record, or its error (a failed step's full log put into the store)."""
    try:
        with _KeyLock(ctx.node.root / "locks", job.key, ctx.cancelled):
            # The driver planned the key missing; the lease re-checks the record once it
            # holds the lease (and a waiter polls it), so no look of our own first.
            got = build_under_lease(ctx, job, out.progress, no_cache=no_cache)
        if isinstance(got, KeyRecord):
            result.update(status="cached", record=got.to_json())
        else:
            result.update(status="built", record=got[0].to_json())
    except EnvbuildError as e:
        result.update(status="failed", error=_error_json(e))
        if isinstance(e, StepFailed):
            digest = _store_log(ctx, job, node_id, e)
            if digest is not None:
                result["error"]["hint"] = (f"full log in the store: blob {digest} "
                                           f"(record {LOG_RECORDS}/{job.key[7:]}), "
                                           f"on node {node_id[:8]}: {e.log_path}")
    except BaseException as e:  # noqa: BLE001 - a bug: reported on the driver
        result.update(status="failed", error={"type": "bug", "message":
                                               f"{job.name}: {type(e).__name__}: {e}"})


def _follow(worker: threading.Thread, ctx: BuildContext, events: Any, out: _Outbox,
            name: str) -> None:
    """Run the build thread ``worker`` to its end. This thread watches for the driver's cancel
    (a flag on the progress actor; the actor gone means the driver is gone) and for
    ray.cancel's KeyboardInterrupt, and turns either into the build's ``cancelled`` event
    (container killed, scratch removed, lease dropped, nothing published)."""
    try:
        worker.start()
        while worker.is_alive():
            worker.join(CANCEL_POLL)
            if worker.is_alive():
                out.flush()
                if not ctx.cancelled.is_set() and _driver_cancelled(events):
                    ctx.cancelled.set()
    except BaseException:
        # ray.cancel: a KeyboardInterrupt, repeated by Ray until the task ends; stop the build
        # and wait until it cleaned up, sitting out every further interrupt.
        while True:
            try:
                ctx.cancelled.set()
                while worker.is_alive():
                    worker.join(0.1)
                break
            except BaseException:  # noqa: BLE001, S112 - a repeated interrupt
                continue
        raise
    finally:
        # After everything this task did: the driver of a cancelled build waits for it, as
        # Ray counts a cancelled task done at once and kills a job's workers when it exits.
        out.progress(BuildEvent(name, ENDED))
        out.flush()


def _trace(path: str, name: str, node: str, marks: list[tuple[str, float]], status: str) -> None:
    line = json.dumps({"name": name, "node": node, "pid": os.getpid(), "status": status,
                       "marks": marks}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    try:
        os.write(fd, line.encode())  # one append of one short line: whole, never interleaved
    finally:
        os.close(fd)


_cancel_watch: dict[str, Any] = {}


def _driver_cancelled(events: Any) -> bool:
    """Whether the driver cancelled the build (or is gone), without a round trip: one pending
    ``wait_cancelled`` call per worker process and build, which the actor answers when the
    driver cancels and which fails when the actor dies with its driver; a look at it is a
    local ``ray.wait``."""
    key = events._actor_id.hex()
    with _node_lock:
        ref = _cancel_watch.get(key)
        if ref is None:
            ref = _cancel_watch[key] = events.wait_cancelled.remote()
    done, _ = ray.wait([ref], timeout=0)
    if not done:
        return False
    try:
        return bool(ray.get(ref))
    except ray.exceptions.ActorUnavailableError:  # restarting elsewhere: watch it again
        with _node_lock:
            _cancel_watch.pop(key, None)
        return False
    except ray.exceptions.RayError:  # the actor died with its driver
        return True


class _Events:
    """The progress mailbox: tasks ``put_many`` events, the driver ``drain``s them; the
    driver's ``cancel`` answers every pending ``wait_cancelled`` (what running tasks watch).
    An async actor, so that those pending calls (one per worker process) cost no thread."""

    def __init__(self) -> None:
        self._events: list[BuildEvent] = []
        self._cancelled = False
        self._cancel: Any = None

    def _event(self) -> Any:
        import asyncio

        if self._cancel is None:
            self._cancel = asyncio.Event()
        return self._cancel

    async def cancel(self) -> None:
        self._cancelled = True
        self._event().set()

    async def cancelled(self) -> bool:
        return self._cancelled

    async def wait_cancelled(self) -> bool:
        await self._event().wait()
        return True

    async def put(self, e: BuildEvent) -> None:
        self._events.append(e)

    async def put_many(self, batch: list[BuildEvent]) -> None:
        self._events.extend(batch)

    async def drain(self) -> list[BuildEvent]:
        out, self._events = self._events, []
        return out

