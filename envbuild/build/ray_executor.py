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

Ray is imported only here and in ``envbuild.build.ray_task`` (the task side), and these only by
``--executor ray`` (CLI start-up stays fast).
"""

from __future__ import annotations

import dataclasses
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
    cached_outcomes,
    finish_build,
    make_jobs,
    prepare_plan,
)
from envbuild.build.layerjob import BuildEvent, LayerJob, Progress
from envbuild.build.pin import Snapshot
from envbuild.build.ray_task import (  # noqa: F401  (node_context, run_layer: re-exported)
    ENDED,
    LOG_RECORDS,
    TRACE_ENV,
    NodeSpec,
    _Events,
    _trace,
    node_context,
    run_layer,
)
from envbuild.errors import BuildError, EnvbuildError, SettingsError, StepFailed
from envbuild.plan.planner import BuildPlan
from envbuild.settings import Settings
from envbuild.store import KeyRecord, Store, open_store

#: The custom resource a node offers to run builds (its amount: build slots).
BUILDER_RESOURCE = "envbuild_builder"
#: How often the driver drains progress events (seconds).
PROGRESS_PERIOD = 0.25
#: How long a cancelled build may take to stop before the driver gives up waiting (seconds).
CANCEL_WAIT = 60.0


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
    spec = NodeSpec(settings, {k: os.environ[k] for k in request.forward_env
                               if k in os.environ}, cwd=os.getcwd())
    marks: list[tuple[str, float]] = [("build_ray", time.time())]
    records: dict[str, KeyRecord] = {}
    plan, events, connect_error = _plan_and_connect(
        ws, store, targets, request, marks,
        lambda: prepare_plan(ws, store, targets, no_cache=no_cache, cache_from=cache_from,
                             records=records))
    to_build = [s for s in plan.steps if no_cache or s.status == "missing"]
    outcomes = cached_outcomes(plan, store, to_build, progress, records)
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


def _plan_and_connect(ws: Snapshot, store: Store, targets: Iterable[str] | None,
                      request: RayBuildRequest, marks: list[tuple[str, float]],
                      make_plan: Any) -> tuple[BuildPlan, Any, SettingsError | None]:
    """(the plan, the progress actor or None, why the cluster cannot be reached or None).
    Joining the cluster and starting the progress actor overlap the plan (its store lookups):
    the plan on a thread, ray.init on this one (it installs signal handlers). No task starts
    before the plan, so nodes start only the worker processes its layers need (each costs a
    Python start, envbuild's imports and a store client): a warm-up task per build slot
    started workers no layer used, and the first layer waited for one of them
    (docs/cluster-builds.md, "start-up")."""
    planned: dict[str, Any] = {}

    def plan_it() -> None:
        try:
            planned["plan"] = make_plan()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            planned["error"] = e

    planner = threading.Thread(target=plan_it, name="plan", daemon=True)
    planner.start()
    connect_error: SettingsError | None = None
    events = None
    try:
        connect(request.address)
        marks.append(("connected", time.time()))
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
    return planned["plan"], events, connect_error


def _error_from_json(d: Mapping[str, Any]) -> EnvbuildError:
    if d.get("type") == "StepFailed":
        return StepFailed(d["message"], argv=list(d.get("argv") or []), exit_code=d["exit_code"],
                          output_tail=d.get("output_tail") or "", log_path=d.get("log_path"),
                          hint=d.get("hint"))
    return BuildError(d["message"], hint=d.get("hint"), context=d.get("context"),
                      reference=d.get("reference"))


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


def _run_tasks(spec: NodeSpec, jobs: Mapping[str, LayerJob],
               deps: Mapping[str, Sequence[str]], request: RayBuildRequest, no_cache: bool,
               progress: Progress, known: Mapping[str, Mapping[str, Any]] | None = None,
               events: Any = None) -> dict[str, dict[str, Any]]:
    """Submit one task per job (dependencies as arguments), follow them, return each result.
    ``events``: the progress actor (``start_events``; killed here at the end), else one is
    started."""
    if events is None:
        events = start_events()
    refs = _submit(spec, jobs, deps, request, no_cache, progress, known, events)
    names_of: dict[Any, list[str]] = {}
    for name, ref in refs.items():
        names_of.setdefault(ref, []).append(name)
    results: dict[str, dict[str, Any]] = {}
    pending = list(names_of)
    failed_by_ray: dict[str, str] = {}
    relay = _Relay(events, progress)
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
        for name in sorted(relay.running):
            progress(BuildEvent(name, "cancelling"))
        deadline = time.monotonic() + CANCEL_WAIT
        while relay.running and time.monotonic() < deadline:
            relay(PROGRESS_PERIOD)
        _cancel(pending)
        raise
    finally:
        ray.kill(events)
    return results


def _submit(spec: NodeSpec, jobs: Mapping[str, LayerJob], deps: Mapping[str, Sequence[str]],
            request: RayBuildRequest, no_cache: bool, progress: Progress,
            known: Mapping[str, Mapping[str, Any]] | None, events: Any) -> dict[str, Any]:
    """Submit one task per job, in plan order (its dependencies' tasks as its arguments);
    returns name -> the task's ref (one task for the same key under two names)."""
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
    return refs


class _Relay:
    """Hands the tasks' progress events to ``progress`` and keeps which tasks are running
    (started and not ended). A call never blocks the loop on the actor (it may still be
    starting): it takes what is there, waiting at most ``wait`` seconds."""

    def __init__(self, events: Any, progress: Progress) -> None:
        self.events, self.progress = events, progress
        self.running: set[str] = set()
        self._drain = events.drain.remote()

    def __call__(self, wait: float = 0.0) -> None:
        done, _ = ray.wait([self._drain], timeout=wait)
        if not done:
            return
        try:
            got = ray.get(done[0])
        except ray.exceptions.RayActorError:  # restarting on another node: ask again
            got = []
        for e in got:
            if e.phase == ENDED:
                self.running.discard(e.name)
                continue
            if e.phase == "started":
                self.running.add(e.name)
            self.progress(e)
        self._drain = self.events.drain.remote()


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

