"""``envbuild build --executor ray``: every missing layer a Ray task, the store the only shared state.

The driver plans as a local build does (the same ``BuildPlan``, the same remote-cache pull),
then submits one Ray task per missing layer, in DAG order: a layer's task takes the results of
the tasks of the layers it builds on as arguments, so Ray starts it only once they finished
(and the task itself returns ``skipped`` when one of them failed). Each task asks for a share
of the custom resource ``envbuild_builder`` (``1 / jobs_per_node`` of a unit: a node offering
``envbuild_builder: 2`` runs two builds at once by default) and runs the existing executor
(``envbuild.build.executor.build_layer``: runc over overlayfs) on its node, with that node's
node cache, under the store's lease on its key (``envbuild.store.lease``), reading the layers
below and publishing blob then key record through the shared store (S3, or a directory every
node sees).

Where things live on a node:

* the node cache is ``settings.node_dir`` with ``{node_id}`` replaced by the Ray node id, so
  several builder nodes on one host (tests, a big machine) never share scratch space;
* definitions are read where the driver loaded them (a task works in the driver's working
  directory, against which ``origin`` paths are relative): every builder node needs the
  checkout at the same path (a CI checkout, a shared volume);
* the store is opened from ``settings`` (``--store``, ``--s3-endpoint``); credentials come
  from the node's own environment, plus the driver variables named in ``forward_env``.

Faults:

* a node that dies mid-build: its task is a Ray system failure and is retried
  (``max_retries``) on another node; nothing was published (blob first, record second, both
  only at the end), and the retry takes the dead builder's lease over (at once when it was on
  this host, else after the lease ``ttl``);
* Ctrl-C (or SIGTERM) of the driver: every unfinished task is cancelled (``ray.cancel``: a
  ``KeyboardInterrupt`` in the task, which sets its build's ``cancelled`` event: the step's
  container is killed, the scratch removed, the lease dropped, nothing published), the driver
  waits for them to end, then re-raises;
* a failed step: the task returns the command, exit code and output tail (printed by the
  driver like a local failure); the full log is stored as a blob and named by the record
  ``logs/v1/<key-hex>`` (``{"version": 1, "name", "node", "log": digest, ...}``); only the
  failed layer's dependents are skipped.

Progress: tasks send their ``BuildEvent``s (with ``node`` set) to a small actor the driver
drains four times a second, so the live table shows each layer's node and step.

Ray is imported only here, and this module only by ``--executor ray`` (CLI start-up stays fast).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from envbuild.build.engine import (
    BuildReport,
    LayerOutcome,
    _KeyLock,
    build_under_lease,
    finish_build,
    make_jobs,
    prepare_plan,
)
from envbuild.build.executor import BuildContext, BuildEvent, LayerJob, Progress, sweep_stale_scratch
from envbuild.build.pin import Snapshot
from envbuild.errors import BuildError, EnvbuildError, SettingsError, StepFailed
from envbuild.settings import Settings
from envbuild.store import KeyRecord, LocalStore, Store, get_key_record, open_store, put_file

#: The custom resource a node offers to run builds (its amount: build slots).
BUILDER_RESOURCE = "envbuild_builder"
#: Where a failed build's full log is recorded (``{"log": digest, ...}``).
LOG_RECORDS = "logs/v1"
LOG_RECORD_VERSION = 1
#: How often the driver drains progress events (seconds).
PROGRESS_PERIOD = 0.25
#: How long a cancelled build may take to stop before the driver gives up waiting (seconds).
CANCEL_WAIT = 60.0
#: The internal event a task sends last (its scratch is gone, its lease dropped).
ENDED = "ended"
#: How often a running task asks the driver whether the build was cancelled (seconds).
CANCEL_POLL = 0.5
#: A file each task appends its phase times to (profiling; see ``run_layer``).
TRACE_ENV = "ENVBUILD_RAY_TRACE"


@dataclasses.dataclass(frozen=True)
class RayBuildRequest:
    """How to run a build on Ray (the driver side): where the cluster is, how many builds a
    node runs at once (``jobs_per_node``: each task takes ``1/jobs_per_node`` of a unit of
    ``envbuild_builder``), how often a task lost with its node is retried, and which of the
    driver's environment variables the tasks get (e.g. ``AWS_ACCESS_KEY_ID`` where nodes have
    no credentials of their own; they travel through Ray's object store)."""

    address: str | None = None
    jobs_per_node: int = 1
    max_retries: int = 3
    forward_env: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class _NodeSpec:
    """What a task needs to open the store and its node cache: plain data, pickled to it."""

    settings: Settings
    environ: Mapping[str, str]
    #: The driver's working directory: definition origins below it are relative to it.
    cwd: str = "/"


# -- the task (runs on a builder node) --------------------------------------------------------

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
    from runtime_shim.isolation.runc import OciRuntime
    from runtime_shim.node.admission import BudgetSettings
    from runtime_shim.node.layout import NodeLayout
    from runtime_shim.node.nodecache import NodeCache

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


def _error_from_json(d: Mapping[str, Any]) -> EnvbuildError:
    if d.get("type") == "StepFailed":
        return StepFailed(d["message"], argv=list(d.get("argv") or []), exit_code=d["exit_code"],
                          output_tail=d.get("output_tail") or "", log_path=d.get("log_path"),
                          hint=d.get("hint"))
    return BuildError(d["message"], hint=d.get("hint"), context=d.get("context"),
                      reference=d.get("reference"))


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


def run_layer(spec: _NodeSpec, job: LayerJob, no_cache: bool, events: Any,
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

    # ENVBUILD_RAY_TRACE=FILE (forward it with --ray-env): each task appends one JSON line
    # of when (unix time, on its node) it reached each phase, for benchmarks/ray_build.py.
    trace_to = os.environ.get(TRACE_ENV)
    marks: list[tuple[str, float]] = [("task", time.time())]

    # Events are sent in batches (one actor call per CANCEL_POLL, not one per event): each
    # call costs CPU on this worker, the actor and Ray's RPC layers.
    outbox: list[BuildEvent] = []
    outbox_lock = threading.Lock()

    def progress(e: BuildEvent) -> None:
        if trace_to:
            marks.append((e.phase, time.time()))
        with outbox_lock:
            outbox.append(dataclasses.replace(e, node=short))

    def flush() -> None:
        with outbox_lock:
            batch = outbox[:]
            outbox.clear()
        if batch:
            events.put_many.remote(batch)

    started = time.monotonic()
    if _driver_cancelled(events):  # started after the driver's Ctrl-C: do nothing
        return {"status": "skipped", "node": short, "blocked_by": "cancelled", "name": job.name}
    ctx = node_context(spec.settings, node_id)
    known = {k: KeyRecord.from_json(r) for k, r in lower.items()}
    known.update((b["key"], KeyRecord.from_json(b["record"])) for b in below
                 if b.get("key") and b.get("record"))
    ctx.known_records = known
    progress(BuildEvent(job.name, "started"))
    flush()
    result: dict[str, Any] = {}

    def body() -> None:
        try:
            with _KeyLock(ctx.node.root / "locks", job.key, ctx.cancelled):
                # The driver planned the key missing; the lease re-checks the record once it
                # holds the lease (and a waiter polls it), so no look of our own first.
                got = build_under_lease(ctx, job, progress, no_cache=no_cache)
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
                                               f"on node {short}: {e.log_path}")
        except BaseException as e:  # noqa: BLE001 - a bug: reported on the driver
            result.update(status="failed", error={"type": "bug", "message":
                                                   f"{job.name}: {type(e).__name__}: {e}"})

    worker = threading.Thread(target=body, name=f"build-{job.name}", daemon=True)
    try:
        worker.start()
        # The build runs on its own thread; this one watches for the driver's cancel (a flag
        # on the progress actor; the actor gone means the driver is gone) and for ray.cancel's
        # KeyboardInterrupt, and turns either into the build's ``cancelled`` event (container
        # killed, scratch removed, lease dropped, nothing published).
        while worker.is_alive():
            worker.join(CANCEL_POLL)
            if worker.is_alive():
                flush()
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
        progress(BuildEvent(job.name, ENDED))
        flush()
    result.update(node=short, seconds=round(time.monotonic() - started, 3), name=job.name,
                  key=job.key)
    if trace_to:
        _trace(trace_to, job.name, short, marks, result["status"])
    return result


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


# -- the driver -------------------------------------------------------------------------------


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (else ``$RAY_ADDRESS``, else a running local one);
    an already initialised Ray (library callers) is used as it is."""
    if ray.is_initialized():
        return
    try:
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto",
                 log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SettingsError(f"cannot reach a Ray cluster at {address or 'auto'}: {e}",
                            hint="start one (ray start --head) or pass --ray-address HOST:PORT"
                            ) from None
    total = ray.cluster_resources().get(BUILDER_RESOURCE, 0)
    if total <= 0:
        raise SettingsError(f"no node of the Ray cluster offers the resource {BUILDER_RESOURCE}",
                            hint=f"start builder nodes with ray start --resources "
                                 f"'{{\"{BUILDER_RESOURCE}\": 2}}'")


def _warm(spec: _NodeSpec) -> str:
    """A warm-up task: this worker process imports the build code, opens the store and the
    node cache (and reaps it) before the first layer arrives."""
    os.environ.update(spec.environ)
    node_id = ray.get_runtime_context().get_node_id()
    try:
        node_context(spec.settings, node_id)
    except Exception:  # noqa: BLE001 - the layer's own task reports it, with its name
        return ""
    return node_id


def warm_up(spec: _NodeSpec, request: RayBuildRequest) -> list[Any]:
    """Start one warm-up task per build slot of the cluster (not waited for): Ray starts this
    job's worker processes on every builder node meanwhile, and reuses them for the layers."""
    slots = int(ray.cluster_resources().get(BUILDER_RESOURCE, 0) * request.jobs_per_node)
    task = ray.remote(_warm).options(num_cpus=0,
                                     resources={BUILDER_RESOURCE: 1.0 / request.jobs_per_node},
                                     max_retries=0, scheduling_strategy="SPREAD")
    return [task.remote(spec) for _ in range(min(slots, 256))]


def disconnect() -> None:
    """Leave the cluster (the CLI, at the end of its build; library callers keep theirs)."""
    if ray.is_initialized():
        ray.shutdown()


def _absolute(settings: Settings) -> Settings:
    """Paths the tasks use, made absolute (a Ray worker's working directory is not ours)."""
    url = settings.store_url
    if "://" not in url:
        url = str(Path(url).absolute())
    return dataclasses.replace(settings, store_url=url,
                               node_dir=Path(os.path.abspath(settings.node_dir)))


def build_ray(
    ws: Snapshot,
    settings: Settings,
    targets: Iterable[str] | None = None,
    *,
    request: RayBuildRequest = RayBuildRequest(),
    no_cache: bool = False,
    progress: Progress = lambda e: None,
    cache_from: Store | None = None,
    cache_to: Store | None = None,
    store: Store | None = None,
) -> BuildReport:
    """Build every missing layer of ``targets`` on the Ray cluster and lock every env (the
    library form of ``envbuild build --executor ray``; same report as ``engine.build``, with
    each built layer's ``node``). ``settings`` names the store and the node cache template;
    load ``ws`` from an absolute definitions path (tasks read sources where it points)."""
    if request.jobs_per_node < 1:
        raise SettingsError("--jobs-per-node must be at least 1")
    settings = _absolute(settings)
    store = store or open_store(settings.store_url, s3_endpoint=settings.s3_endpoint,
                                registry_insecure=settings.registry_insecure)
    spec = _NodeSpec(settings, {k: os.environ[k] for k in request.forward_env
                                if k in os.environ}, cwd=os.getcwd())
    # Joining the cluster (seconds: ray.init, then each node starting this job's worker
    # processes, which import envbuild and open the store) overlaps the plan (its store
    # lookups): the plan on a thread, ray.init on this one (it installs signal handlers).
    records: dict[str, KeyRecord] = {}
    planned: dict[str, Any] = {}

    def plan_it() -> None:
        try:
            planned["plan"] = prepare_plan(ws, store, targets, no_cache=no_cache,
                                           cache_from=cache_from, records=records)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            planned["error"] = e

    marks: list[tuple[str, float]] = [("build_ray", time.time())]
    planner = threading.Thread(target=plan_it, name="plan", daemon=True)
    planner.start()
    connect_error: SettingsError | None = None
    events = None
    try:
        connect(request.address)
        marks.append(("connected", time.time()))
        warm_up(spec, request)
        events = start_events()
    except SettingsError as e:  # only an error if there is something to build
        connect_error = e
    finally:
        planner.join()
        marks.append(("planned", time.time()))
    if "error" in planned and events is not None:
        ray.kill(events)
    if "error" in planned:
        raise planned["error"]
    plan = planned["plan"]
    outcomes: dict[str, LayerOutcome] = {}
    to_build = [s for s in plan.layers if no_cache or s.status == "missing"]
    for s in plan.layers:
        if s not in to_build:
            outcomes[s.name] = LayerOutcome(s.name, s.kind, s.key, "cached",
                                            record=records.get(s.key) or get_key_record(store, s.key))
            progress(BuildEvent(s.name, "cached"))
    if not to_build and events is not None:
        ray.kill(events)
    if to_build:
        if connect_error is not None:
            raise connect_error
        known = {o.key: o.record.to_json() for o in outcomes.values() if o.record is not None}
        results = _run_tasks(spec, make_jobs(ws, [s.name for s in to_build]),
                             {s.name: s.depends_on for s in to_build}, request, no_cache,
                             progress, known, events)
        marks.append(("results", time.time()))
        for s in to_build:
            outcomes[s.name] = _outcome(s.name, s.kind, s.key, results[s.name])
    report = finish_build(ws, store, plan, outcomes, cache_to)
    if os.environ.get(TRACE_ENV):
        marks.append(("finished", time.time()))
        _trace(os.environ[TRACE_ENV], "", "driver", marks, "driver")
    return report


def _outcome(name: str, kind: str, key: str, r: Mapping[str, Any]) -> LayerOutcome:
    status = r["status"]
    record = KeyRecord.from_json(r["record"]) if r.get("record") else None
    error = _error_from_json(r["error"]) if r.get("error") else None
    return LayerOutcome(name, kind, key, status, record=record, seconds=r.get("seconds", 0.0),
                        error=error, blocked_by=r.get("blocked_by"), node=r.get("node", ""))


def start_events() -> Any:
    """Start the progress actor (its worker process starts meanwhile; calls queue up)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # The progress actor lives with the driver where it can; if its node dies anyway (the
    # driver's raylet need not be the head's), Ray restarts it elsewhere and retries the calls
    # made meanwhile: only progress lines are lost, never the build. It still dies with its
    # owner, the driver, which is what tasks read as "cancel".
    return ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(_Events).options(
        max_concurrency=100_000, scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=True)).remote()


def _run_tasks(spec: _NodeSpec, jobs: Mapping[str, LayerJob],
               deps: Mapping[str, Sequence[str]], request: RayBuildRequest, no_cache: bool,
               progress: Progress, known: Mapping[str, Mapping[str, Any]] | None = None,
               events: Any = None) -> dict[str, dict[str, Any]]:
    """Submit one task per job (dependencies as arguments), follow them, return each result.
    ``events``: the progress actor (``start_events``; killed here at the end), else one is
    started."""
    if events is None:
        events = start_events()
    task = ray.remote(run_layer).options(
        num_cpus=0, resources={BUILDER_RESOURCE: 1.0 / request.jobs_per_node},
        max_retries=request.max_retries, retry_exceptions=False,
        # one layer per node first: a farm's nodes all start working at once
        scheduling_strategy="SPREAD")
    refs: dict[str, Any] = {}
    by_key: dict[str, Any] = {}
    spec_ref = ray.put(spec)  # once, not pickled into every task's arguments
    for name in jobs:  # plan order: dependencies first
        job = jobs[name]
        if job.key in by_key:  # the same key under two names: one build
            refs[name] = by_key[job.key]
            continue
        below = [refs[d] for d in deps.get(name, ()) if d in refs]
        # the records of its lower layers the driver has (those already in the store); the
        # ones built in this run come with the results in ``below``
        lower = {k: known[k] for k in job.lower_keys if known and k in known}
        refs[name] = by_key[job.key] = task.remote(spec_ref, job, no_cache, events, lower,
                                                   *below)
        progress(BuildEvent(name, "queued"))
    names_of: dict[Any, list[str]] = {}
    for name, ref in refs.items():
        names_of.setdefault(ref, []).append(name)
    results: dict[str, dict[str, Any]] = {}
    pending = list(names_of)
    failed_by_ray: dict[str, str] = {}

    drain = [events.drain.remote()]
    running: set[str] = set()  # tasks that started and have not ended

    def relay(wait: float = 0.0) -> None:
        # never blocks the loop on the actor (it may still be starting): take what is there
        done, _ = ray.wait(drain, timeout=wait)
        if done:
            try:
                got = ray.get(done[0])
            except ray.exceptions.RayActorError:  # restarting on another node: ask again
                got = []
            for e in got:
                if e.phase == ENDED:
                    running.discard(e.name)
                    continue
                if e.phase == "started":
                    running.add(e.name)
                progress(e)
            drain[0] = events.drain.remote()

    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=PROGRESS_PERIOD,
                                      fetch_local=True)
            relay()
            for ref in ready:
                for name in names_of[ref]:
                    results[name] = _result_of(ref, name, deps, results, failed_by_ray)
                    _report(progress, name, results[name])
    except BaseException:
        # Tell running tasks to stop (they poll the flag) and wait until each has cleaned up
        # ("ended"), then cancel what is still queued; Ray's own cancel of a running task is
        # only the fallback (it counts the task done at once, and a job's workers are killed
        # when its driver exits).
        events.cancel.remote()
        relay(PROGRESS_PERIOD)  # "started" events sent before the interrupt
        for name in sorted(running):
            progress(BuildEvent(name, "cancelling"))
        deadline = time.monotonic() + CANCEL_WAIT
        while running and time.monotonic() < deadline:
            relay(PROGRESS_PERIOD)
        _cancel(pending)
        raise
    finally:
        ray.kill(events)
    return results


def _result_of(ref: Any, name: str, deps: Mapping[str, Sequence[str]],
               results: Mapping[str, Mapping[str, Any]], failed_by_ray: dict[str, str]
               ) -> dict[str, Any]:
    try:
        return dict(ray.get(ref))
    except ray.exceptions.RayError as e:
        # A task error: the task itself never raises for a build failure (it returns one), so
        # this is Ray's: a dependency's task was lost for good (its error propagates to its
        # dependents' arguments), or this task's node died more often than max_retries.
        for d in deps.get(name, ()):
            if d in failed_by_ray or (d in results and results[d]["status"] in ("failed", "skipped")):
                return {"status": "skipped", "blocked_by": failed_by_ray.get(d, d), "name": name}
        failed_by_ray[name] = name
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"status": "failed", "name": name, "error": {
            "type": "BuildError", "message": f"{name}: the Ray task failed: {first}",
            "hint": "nothing was published for this layer; see the Ray logs of its node"}}


def _report(progress: Progress, name: str, r: Mapping[str, Any]) -> None:
    node, status = r.get("node", ""), r["status"]
    if status == "built":
        progress(BuildEvent(name, "done", seconds=r.get("seconds", 0.0), node=node))
    elif status == "cached":
        progress(BuildEvent(name, "cached", node=node))
    elif status == "failed":
        progress(BuildEvent(name, "failed", detail=(r.get("error") or {}).get("message", ""),
                            node=node))
    else:
        progress(BuildEvent(name, "skipped", detail=f"{r.get('blocked_by')} failed", node=node))


def _cancel(pending: list[Any]) -> None:
    """Cancel every unfinished task: each one's build sees ``cancelled``, kills its step,
    removes its scratch, drops its lease and then sends ``ended`` (the caller waits for it)."""
    for ref in pending:
        try:
            ray.cancel(ref, force=False, recursive=False)  # not its progress messages
        except Exception:  # noqa: BLE001 - already finished or lost: nothing to cancel
            pass


def forward_names(names: Iterable[str]) -> tuple[str, ...]:
    """Validate ``--ray-env`` names (variable names only, never values on the command line)."""
    out = []
    for n in names:
        if not n or not all(c.isalnum() or c == "_" for c in n):
            raise SettingsError(f"--ray-env takes a variable name, not {n!r}",
                                hint="e.g. --ray-env AWS_ACCESS_KEY_ID")
        out.append(n)
    return tuple(out)

